"""Executable specification of single-flight coordination.

`FlightModel` is the reference: lists and linear scans, written as a literal reading of the
rules, slow and obviously right. `FlightCoordinatorMachine` drives an implementation and the
model side by side with random arrivals (identical and different prompts, several
namespaces), re-arrivals of ids in open flights, publications, completions, aborts, time
passing and bad ids, comparing decisions, placements, open flights and stats after every
step, and checking every accepted event against `FlightCoordinator.TRANSITIONS`.

Run it against your own coordinator::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import FlightCoordinatorMachine

    run_state_machine_as_test(FlightCoordinatorMachine.for_factory(MyCoordinator))

where ``MyCoordinator(config: FlightConfig)`` implements `CoordinatorUnderTest`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import (
    BlockHash,
    BlockHasher,
    FlightConfig,
    FlightCoordinator,
    FlightKey,
    ReleasePolicy,
    RequestId,
    UsageError,
)
from prefixflight.core.flight import (
    Aborted,
    Arrived,
    Finished,
    FlightDecision,
    FlightEvent,
    FlightStats,
    Independent,
    Lead,
    Placement,
    PrefillDone,
    Progress,
    Promote,
    Release,
    ReleaseReason,
    Tick,
    Wait,
)
from prefixflight.core.validate import assert_never

__all__ = ["CoordinatorUnderTest", "FlightCoordinatorMachine", "FlightModel"]


class CoordinatorUnderTest(Protocol):
    """What the machine needs from a coordinator."""

    def handle(self, event: FlightEvent) -> tuple[FlightDecision, ...]: ...
    def placements(self) -> dict[RequestId, Placement]: ...
    def flights(self) -> dict[int, tuple[RequestId | None, tuple[RequestId, ...]]]: ...
    @property
    def stats(self) -> FlightStats: ...
    def check_invariants(self) -> None: ...


class _Member:
    def __init__(self, rid: RequestId, arrived: float, need: int | None, tokens: int) -> None:
        self.rid = rid
        self.arrived = arrived
        self.need = need  # None: exact follower; else leading blocks awaited
        self.tokens = tokens


class _ModelFlight:
    def __init__(self, fid: int, key: FlightKey, leader: RequestId, blocks: tuple[BlockHash, ...]):
        self.id = fid
        self.key = key
        self.leader: RequestId | None = leader
        self.blocks = blocks
        self.members: list[_Member] = []  # waiting, in arrival order
        self.done = False
        self.published = 0


class FlightModel:
    """Reference single-flight coordinator. Same events and decisions as `FlightCoordinator`.

    Semantics, literally:
    - INDEPENDENT: every arrival runs independently.
    - An arrival whose key (namespace + exact tokens) matches an open flight waits in it;
      otherwise, with partial coordination on, it waits for the open flight whose leader
      shares the most leading blocks (at least ``min_shared_blocks``; oldest flight on a tie)
      unless those blocks are published already; otherwise it opens a flight and leads.
    - AFTER_PREFILL: the leader's PrefillDone releases every waiting member and closes the
      flight. ON_COMPLETION: the leader's end does. Partial waiters are released as soon as
      the leader has published the blocks they wait for.
    - A leader that aborts before its prefill is done hands the flight to the oldest exact
      follower (Promote); with none, partial waiters are released and the flight closes.
    - A waiting member whose ``arrived + max_wait < now`` is released alone (TIMEOUT), before
      the event itself is applied, oldest arrival first.
    - Released members and the leader of a closed flight stay known (released) until they
      finish or abort.
    """

    def __init__(self, config: FlightConfig) -> None:
        self.config = config
        self.flights: list[_ModelFlight] = []
        self.released: set[RequestId] = set()
        self.independent: set[RequestId] = set()
        self.next_id = 0
        self.now = float("-inf")
        self.arrival_seq: dict[RequestId, int] = {}
        self.seq = 0
        self.s: dict[str, Any] = dict(
            flights_opened=0, followers=0, partial_followers=0, tokens_not_recomputed=0,
            waits=0, total_wait=0.0, max_wait=0.0, promotions=0, timeouts=0,
        )  # fmt: skip

    # -- views ---------------------------------------------------------------------------
    def placements(self) -> dict[RequestId, Placement]:
        out: dict[RequestId, Placement] = {}
        for f in self.flights:
            if f.leader is not None:
                out[f.leader] = Placement.LEADING
            for m in f.members:
                out[m.rid] = Placement.WAITING
        for r in self.released:
            out[r] = Placement.RELEASED
        for r in self.independent:
            out[r] = Placement.INDEPENDENT
        return out

    def open_flights(self) -> dict[int, tuple[RequestId | None, tuple[RequestId, ...]]]:
        out = {}
        for f in self.flights:  # waiting members oldest first, exact and partial together
            out[f.id] = (f.leader, tuple(m.rid for m in f.members))
        return out

    @property
    def stats(self) -> FlightStats:
        return FlightStats(**self.s)

    # -- events --------------------------------------------------------------------------
    def handle(self, event: FlightEvent) -> list[FlightDecision]:
        place = self.placements()
        if event.now < self.now:
            raise UsageError("time went backwards")
        rid = getattr(event, "request_id", None)
        if isinstance(event, Arrived):
            if rid in place:
                raise UsageError("duplicate")
        elif isinstance(event, (Progress, PrefillDone, Finished)):
            if rid not in place:
                raise UsageError("unknown")
            if place[rid] is Placement.WAITING:
                raise UsageError("waiting")
        elif isinstance(event, Aborted) and rid not in place:
            raise UsageError("unknown")
        self.now = float(event.now)
        out: list[FlightDecision] = []
        self._expire(out)
        if isinstance(event, Arrived):
            self._arrive(event, out)
        elif isinstance(event, Progress):
            f = self._led_by(event.request_id)
            if f is not None:
                f.published = max(f.published, event.published_blocks)
                self._release_partial(f, out, ReleaseReason.BLOCKS_PUBLISHED, everyone=False)
        elif isinstance(event, PrefillDone):
            f = self._led_by(event.request_id)
            if f is not None:
                f.done = True
                f.published = max(f.published, len(f.blocks))
                self._release_partial(f, out, ReleaseReason.BLOCKS_PUBLISHED, everyone=True)
                if self.config.policy is ReleasePolicy.AFTER_PREFILL:
                    self._close(f, out, ReleaseReason.PREFILL_PUBLISHED)
        elif isinstance(event, (Finished, Aborted)):
            self._terminate(event.request_id, out, aborted=isinstance(event, Aborted))
        return out

    def _led_by(self, rid: RequestId) -> _ModelFlight | None:
        for f in self.flights:
            if f.leader == rid:
                return f
        return None

    def _arrive(self, ev: Arrived, out: list[FlightDecision]) -> None:
        rid = ev.request_id
        self.arrival_seq[rid] = self.seq
        self.seq += 1
        if self.config.policy is ReleasePolicy.INDEPENDENT:
            self.independent.add(rid)
            out.append(Independent(request_id=rid))
            return
        for f in self.flights:
            if f.key == ev.key:
                f.members.append(_Member(rid, self.now, None, ev.key.num_tokens))
                self.s["followers"] += 1
                out.append(Wait(request_id=rid, flight=f.id))
                return
        m = self.config.min_shared_blocks
        if m is not None and ev.blocks:
            best: _ModelFlight | None = None
            best_shared = 0
            for f in self.flights:  # opening order: oldest first, so ties keep the oldest
                shared = 0
                while (
                    shared < min(len(f.blocks), len(ev.blocks))
                    and f.blocks[shared] == ev.blocks[shared]
                ):
                    shared += 1
                if shared >= m and shared > best_shared:
                    best, best_shared = f, shared
            if best is not None and not best.done and best.published < best_shared:
                best.members.append(_Member(rid, self.now, best_shared, ev.key.num_tokens))
                self.s["partial_followers"] += 1
                out.append(Wait(request_id=rid, flight=best.id, blocks=best_shared))
                return
        f = _ModelFlight(self.next_id, ev.key, rid, ev.blocks)
        self.next_id += 1
        self.flights.append(f)
        self.s["flights_opened"] += 1
        out.append(Lead(request_id=rid, flight=f.id))

    def _terminate(self, rid: RequestId, out: list[FlightDecision], *, aborted: bool) -> None:
        f = self._led_by(rid)
        if f is not None:
            f.leader = None
            exact = [m for m in f.members if m.need is None]
            if aborted and not f.done and exact:
                new = exact[0]
                f.members.remove(new)
                self._waited(new)
                f.leader = new.rid
                self.s["promotions"] += 1
                out.append(Promote(flight=f.id, request_id=new.rid))
                return
            if aborted:
                self._release_partial(f, out, ReleaseReason.LEADER_ABORTED, everyone=True)
                self._close(f, out, ReleaseReason.LEADER_ABORTED)
            else:
                f.done = True
                self._release_partial(f, out, ReleaseReason.BLOCKS_PUBLISHED, everyone=True)
                self._close(f, out, ReleaseReason.LEADER_FINISHED)
            return
        for f in self.flights:
            for m in f.members:
                if m.rid == rid:
                    f.members.remove(m)
                    return
        self.released.discard(rid)
        self.independent.discard(rid)

    def _release_partial(
        self, f: _ModelFlight, out: list[FlightDecision], reason: ReleaseReason, *, everyone: bool
    ) -> None:
        ready = [m for m in f.members if m.need is not None and (everyone or m.need <= f.published)]
        if not ready:
            return
        bs = self.config.block_size
        for m in ready:
            f.members.remove(m)
            self.released.add(m.rid)
            self._waited(m)
            if reason is ReleaseReason.BLOCKS_PUBLISHED:
                assert m.need is not None
                self.s["tokens_not_recomputed"] += min(m.need * bs, max(m.tokens - 1, 0) // bs * bs)
        out.append(Release(flight=f.id, request_ids=tuple(m.rid for m in ready), reason=reason))

    def _close(self, f: _ModelFlight, out: list[FlightDecision], reason: ReleaseReason) -> None:
        self.flights.remove(f)
        if f.leader is not None:
            self.released.add(f.leader)
        if f.members:
            bs = self.config.block_size
            for m in f.members:
                self.released.add(m.rid)
                self._waited(m)
            if f.done:
                reusable = max(f.key.num_tokens - 1, 0) // bs * bs
                self.s["tokens_not_recomputed"] += len(f.members) * reusable
            out.append(
                Release(flight=f.id, request_ids=tuple(m.rid for m in f.members), reason=reason)
            )

    def _expire(self, out: list[FlightDecision]) -> None:
        mw = self.config.max_wait
        if mw is None:
            return
        late = [(m, f) for f in self.flights for m in f.members if m.arrived + mw < self.now]
        late.sort(key=lambda mf: self.arrival_seq[mf[0].rid])
        for m, f in late:
            f.members.remove(m)
            self.released.add(m.rid)
            self._waited(m)
            self.s["timeouts"] += 1
            out.append(Release(flight=f.id, request_ids=(m.rid,), reason=ReleaseReason.TIMEOUT))

    def _waited(self, m: _Member) -> None:
        w = self.now - m.arrived
        self.s["waits"] += 1
        self.s["total_wait"] += w
        self.s["max_wait"] = max(self.s["max_wait"], w)


# -- the machine -------------------------------------------------------------------------
_BLOCK = 2
_FAMILIES: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4, 5, 6, 7),
    (1, 2, 3, 4, 9, 9),
    (1, 2, 8, 8, 8),
    (5, 5, 5, 5, 5, 5, 5, 5),
)
_IDS = tuple(range(8))


class FlightCoordinatorMachine(RuleBasedStateMachine):
    """Implementation vs `FlightModel`, compared after every event."""

    factory: ClassVar[Callable[[FlightConfig], CoordinatorUnderTest]] = FlightCoordinator

    @classmethod
    def for_factory(
        cls, factory: Callable[[FlightConfig], CoordinatorUnderTest]
    ) -> type[FlightCoordinatorMachine]:
        """A subclass of this machine that tests coordinators made by ``factory``."""
        return type(f"{cls.__name__}For{getattr(factory, '__name__', 'Factory')}", (cls,),
                    {"factory": staticmethod(factory)})  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.impl: Any = None
        self.model: FlightModel | None = None
        self.now = 0.0
        self.config: FlightConfig | None = None
        self.hashers = {ns: BlockHasher(_BLOCK, namespace=ns) for ns in (b"a", b"b")}
        self.prompts: dict[RequestId, tuple[tuple[int, ...], bytes]] = {}

    @initialize(
        policy=st.sampled_from(ReleasePolicy),
        max_wait=st.one_of(st.none(), st.sampled_from([0.0, 1.0, 2.5])),
        min_shared=st.one_of(st.none(), st.integers(1, 2)),
    )
    def setup(self, policy: ReleasePolicy, max_wait: float | None, min_shared: int | None) -> None:
        self.config = FlightConfig(
            policy=policy, max_wait=max_wait, min_shared_blocks=min_shared, block_size=_BLOCK
        )
        note(f"config = {self.config!r}")
        self.impl = type(self).factory(self.config)
        self.model = FlightModel(self.config)

    # -- helpers -------------------------------------------------------------------------
    def _send(self, event: FlightEvent) -> None:
        assert self.model is not None
        note(f"handle({event!r})")
        placed_before = self.model.placements()
        try:
            expected = self.model.handle(event)
        except UsageError:
            before = (self.impl.placements(), self.impl.flights(), self.impl.stats)
            try:
                self.impl.handle(event)
            except UsageError:
                pass
            else:
                raise AssertionError(f"{event!r} should have been rejected") from None
            after = (self.impl.placements(), self.impl.flights(), self.impl.stats)
            assert before == after, "a rejected event changed the state"
            return
        placed_after = self.model.placements()
        got = self.impl.handle(event)
        note(f"  -> {got!r}")
        assert list(got) == expected, f"decisions differ: got {got!r}, expected {expected!r}"
        self._check_policy(event, got)
        self._check_transition(event, placed_before, placed_after)

    def _check_transition(
        self,
        event: FlightEvent,
        before: dict[RequestId, Placement],
        after: dict[RequestId, Placement],
    ) -> None:
        """The event's request moved as `FlightCoordinator.TRANSITIONS` allows."""
        if isinstance(event, Tick):
            return
        rid = event.request_id
        legal = FlightCoordinator.TRANSITIONS[before.get(rid)]
        assert type(event) in legal, f"{event!r} was accepted from {before.get(rid)}"
        assert after.get(rid) in legal[type(event)], f"{event!r} led to {after.get(rid)}"

    def _check_policy(self, event: FlightEvent, got: tuple[FlightDecision, ...]) -> None:
        """A follower is never released before its policy allows."""
        assert self.config is not None
        for d in got:
            if not isinstance(d, Release):
                continue
            match d.reason:
                case ReleaseReason.PREFILL_PUBLISHED:
                    assert self.config.policy is ReleasePolicy.AFTER_PREFILL
                    assert isinstance(event, PrefillDone)
                case ReleaseReason.LEADER_FINISHED:
                    assert isinstance(event, Finished)
                case ReleaseReason.LEADER_ABORTED:
                    assert isinstance(event, Aborted)
                case ReleaseReason.TIMEOUT:
                    assert self.config.max_wait is not None
                case ReleaseReason.BLOCKS_PUBLISHED:
                    assert self.config.min_shared_blocks is not None
                    assert isinstance(event, (Progress, PrefillDone, Finished))
                case _:
                    assert_never(d.reason)

    def _known(self) -> list[RequestId]:
        assert self.model is not None
        return sorted(self.model.placements(), key=repr)

    # -- rules ---------------------------------------------------------------------------
    def _arrive(self, rid: RequestId, tokens: tuple[int, ...], ns: bytes) -> None:
        blocks = self.hashers[ns].hash_tokens(tokens)
        self.prompts[rid] = (tokens, ns)
        self._send(
            Arrived(request_id=rid, key=FlightKey.of(tokens, ns), now=self.now, blocks=blocks)
        )

    @rule(
        rid=st.sampled_from(_IDS),
        family=st.integers(0, len(_FAMILIES) - 1),
        cut=st.integers(0, 2),
        ns=st.sampled_from([b"a", b"b"]),
    )
    def arrive(self, rid: int, family: int, cut: int, ns: bytes) -> None:
        self._arrive(rid, _FAMILIES[family][: len(_FAMILIES[family]) - cut], ns)

    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data(), rid=st.sampled_from(_IDS))
    def arrive_identical(self, data: st.DataObject, rid: int) -> None:
        """Same prompt and namespace as an earlier request: a follower if its flight is open."""
        other = data.draw(st.sampled_from(sorted(self.prompts, key=repr)))
        self._arrive(rid, *self.prompts[other])

    @precondition(lambda self: self.model is not None and bool(self.model.placements()))
    @rule(data=st.data(), what=st.sampled_from(["prefill_done", "finish", "abort", "progress"]))
    def event(self, data: st.DataObject, what: str) -> None:
        rid = data.draw(st.sampled_from(self._known()))
        self._send(self._event(what, rid, data))

    def _event(self, what: str, rid: RequestId, data: st.DataObject) -> FlightEvent:
        match what:
            case "prefill_done":
                return PrefillDone(request_id=rid, now=self.now)
            case "finish":
                return Finished(request_id=rid, now=self.now)
            case "abort":
                return Aborted(request_id=rid, now=self.now)
            case _:
                n = data.draw(st.integers(0, 4))
                return Progress(request_id=rid, published_blocks=n, now=self.now)

    def _placed(self, *places: Placement) -> list[RequestId]:
        assert self.model is not None
        return sorted((r for r, p in self.model.placements().items() if p in places), key=repr)

    @precondition(lambda self: self.model is not None and bool(self._placed(Placement.LEADING)))
    @rule(data=st.data(), what=st.sampled_from(["prefill_done", "finish", "abort", "progress"]))
    def leader_event(self, data: st.DataObject, what: str) -> None:
        """The leader publishes, finishes or aborts: the transitions that release followers."""
        rid = data.draw(st.sampled_from(self._placed(Placement.LEADING)))
        self._send(self._event(what, rid, data))

    @precondition(
        lambda self: (
            self.model is not None and bool(self._placed(Placement.RELEASED, Placement.INDEPENDENT))
        )
    )
    @rule(data=st.data(), what=st.sampled_from(["finish", "abort"]))
    def running_ends(self, data: st.DataObject, what: str) -> None:
        rid = data.draw(st.sampled_from(self._placed(Placement.RELEASED, Placement.INDEPENDENT)))
        self._send(self._event(what, rid, data))

    @precondition(
        lambda self: (
            self.model is not None and bool(self._placed(Placement.LEADING, Placement.WAITING))
        )
    )
    @rule(data=st.data(), dt=st.sampled_from([0.5, 1.0]), via=st.sampled_from(["abort", "promote"]))
    def rejoin(self, data: st.DataObject, dt: float, via: str) -> None:
        """A waiting request (an existing one, or a new follower of an open flight) leaves
        its flight (aborts, or is promoted and then aborts) and re-arrives with the same id
        and prompt a little later, while the flight is still open. Time then moves just past
        its first arrival's deadline: the new arrival must wait ``max_wait`` from its own
        arrival, not inherit the old deadline (issue 9, defect 1)."""
        assert self.model is not None and self.config is not None
        waiting = self._placed(Placement.WAITING)
        leaders = self._placed(Placement.LEADING)
        free = [i for i in _IDS if i not in self.model.placements()]
        if leaders and free and (not waiting or data.draw(st.booleans())):
            rid: RequestId = data.draw(st.sampled_from(free))
            leader = data.draw(st.sampled_from(leaders))
            self._arrive(rid, *self.prompts[leader])  # an exact follower of its flight
            if self.model.placements().get(rid) is not Placement.WAITING:
                return
        elif waiting:
            rid = data.draw(st.sampled_from(waiting))
        else:
            return
        first = self._arrived(rid)
        self.now += dt
        self._send(Tick(now=self.now))
        if self.model.placements().get(rid) is not Placement.WAITING:
            return  # timed out meanwhile
        if via == "promote":
            head = next(f.leader for f in self.model.flights if rid in self._members(f))
            if head is not None:
                self._send(Aborted(request_id=head, now=self.now))
        if rid in self.model.placements():
            self._send(Aborted(request_id=rid, now=self.now))
        self._arrive(rid, *self.prompts[rid])
        mw = self.config.max_wait
        if mw is not None and first + mw + 0.25 > self.now:
            self.now = first + mw + 0.25
            self._send(Tick(now=self.now))

    def _arrived(self, rid: RequestId) -> float:
        assert self.model is not None
        for f in self.model.flights:
            for m in f.members:
                if m.rid == rid:
                    return m.arrived
        raise AssertionError(f"{rid!r} is not waiting")

    @staticmethod
    def _members(f: _ModelFlight) -> list[RequestId]:
        return [m.rid for m in f.members]

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._send(Tick(now=self.now))

    @rule(data=st.data(), what=st.sampled_from(["prefill_done", "finish", "abort", "progress"]))
    def unknown_id(self, data: st.DataObject, what: str) -> None:
        self._send(self._event(what, 99, data))

    @precondition(lambda self: self.now > 0)
    @rule()
    def time_backwards(self) -> None:
        self._send(Tick(now=self.now - 0.25))

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        assert self.model is not None  # invariants run after `setup`
        self.impl.check_invariants()
        assert self.impl.placements() == self.model.placements()
        assert self.impl.flights() == self.model.open_flights()
        assert self.impl.stats == self.model.stats

    @invariant()
    def one_flight_per_key_and_no_empty_flight(self) -> None:
        assert self.model is not None
        keys = [f.key for f in self.model.flights]
        assert len(keys) == len(set(keys))
        for _, (leader, waiting) in self.impl.flights().items():
            assert leader is not None or waiting, "a flight outlived its members"
