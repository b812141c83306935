"""Single-flight prefill coordination: one leader prefills, identical requests wait.

Identical prompts (same namespace, same tokens) that arrive while a flight is open elect
one leader that computes the prompt; the others wait as followers and, once released, reuse
the leader's published pages. Only prefill is coordinated: every follower then decodes on its
own with its own sampling settings.

The coordinator is a sans-I/O state machine: `FlightCoordinator.handle` takes one event and
returns the decisions the host must carry out. Every known request id is in exactly one
place (a `Placement`): leading a flight, waiting in a flight, released (tracked until it
terminates; there is no separate draining state), or running independently. Which events
each place accepts, and where they lead, is one literal table, `TRANSITIONS`; the
implementation validates every event against it before it changes anything.

Design after the single-flight prefill study of mini-vllm-rs; the table follows h11's
style (one literal dict of legal state x event pairs).
"""

from __future__ import annotations

import enum
import hashlib
import sys
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from typing import ClassVar, Final, TypeAlias, final

import attrs

from .._errors import ConfigError, UsageError
from ..cache._hashing import BlockHash
from ..validate import (
    assert_never,
    check_block_hashes,
    check_instance,
    check_int,
    check_time,
    instance_field,
    int_field,
    request_id_field,
    time_field,
)
from ._plan import RequestId

__all__ = [
    "Aborted",
    "Arrived",
    "FlightConfig",
    "FlightCoordinator",
    "FlightDecision",
    "FlightEvent",
    "FlightKey",
    "FlightStats",
    "Finished",
    "Independent",
    "Lead",
    "Placement",
    "PrefillDone",
    "Progress",
    "Promote",
    "Release",
    "ReleasePolicy",
    "ReleaseReason",
    "TRANSITIONS",
    "Tick",
    "Wait",
]


class ReleasePolicy(enum.Enum):
    """When the followers of a flight may be admitted."""

    AFTER_PREFILL = "after_prefill"
    """As soon as the leader's prompt pages are published (the default)."""
    ON_COMPLETION = "on_completion"
    """When the leader's whole request ends."""
    INDEPENDENT = "independent"
    """No coordination: every request computes on its own (the benchmarks' baseline)."""


class ReleaseReason(enum.Enum):
    """Why followers were released."""

    PREFILL_PUBLISHED = "prefill_published"
    LEADER_FINISHED = "leader_finished"
    BLOCKS_PUBLISHED = "blocks_published"
    """Partial-prefix waiters: the blocks they share with the leader are published."""
    LEADER_ABORTED = "leader_aborted"
    """Partial-prefix waiters of a flight whose last member aborted: they compute alone."""
    TIMEOUT = "timeout"
    """The follower waited longer than ``max_wait``: it computes on its own."""


@final
@attrs.frozen
class FlightKey:
    """What makes two requests identical: namespace plus the exact input tokens.

    Built with `FlightKey.of`; the tokens are kept as a SHA-256 digest (exact for every
    practical purpose and cheap to hash), with their count.
    """

    namespace: bytes = attrs.field(validator=instance_field(bytes, error=UsageError))
    digest: bytes = attrs.field(validator=instance_field(bytes, error=UsageError))
    num_tokens: int = attrs.field(validator=int_field(0, error=UsageError))

    @classmethod
    def of(cls, token_ids: Sequence[int], namespace: str | bytes = b"") -> FlightKey:
        if isinstance(namespace, str):
            ns = namespace.encode("utf-8")
        elif isinstance(namespace, bytes):
            ns = namespace
        else:
            raise UsageError(f"namespace must be a str or bytes, got {namespace!r}")
        if isinstance(token_ids, (str, bytes)):
            raise UsageError(f"token ids must be a sequence of ints, got {token_ids!r}")
        try:  # C speed; array("q") accepts exactly the ints of the int64 range
            data = array("q", token_ids)
        except (TypeError, OverflowError) as exc:
            raise UsageError(f"token ids must be ints in the int64 range: {exc}") from None
        return cls(ns, hashlib.sha256(data.tobytes()).digest(), len(data))


# -- events ------------------------------------------------------------------------------
@final
@attrs.frozen(kw_only=True)
class Arrived:
    """A request arrived. ``blocks`` (its chained full-block hashes) are only needed for
    partial-prefix coordination."""

    request_id: RequestId = attrs.field(validator=request_id_field())
    key: FlightKey = attrs.field(validator=instance_field(FlightKey, error=UsageError))
    now: float = attrs.field(validator=time_field())
    blocks: tuple[BlockHash, ...] = attrs.field(default=(), converter=check_block_hashes)


@final
@attrs.frozen(kw_only=True)
class Progress:
    """A request has published its first ``published_blocks`` full prompt blocks."""

    request_id: RequestId = attrs.field(validator=request_id_field())
    published_blocks: int = attrs.field(validator=int_field(0, error=UsageError))
    now: float = attrs.field(validator=time_field())


@final
@attrs.frozen(kw_only=True)
class PrefillDone:
    """A request's prompt is computed and its full prompt blocks are published."""

    request_id: RequestId = attrs.field(validator=request_id_field())
    now: float = attrs.field(validator=time_field())


@final
@attrs.frozen(kw_only=True)
class Finished:
    """A request ended normally."""

    request_id: RequestId = attrs.field(validator=request_id_field())
    now: float = attrs.field(validator=time_field())


@final
@attrs.frozen(kw_only=True)
class Aborted:
    """A request was aborted or failed (before or after its prefill)."""

    request_id: RequestId = attrs.field(validator=request_id_field())
    now: float = attrs.field(validator=time_field())


@final
@attrs.frozen(kw_only=True)
class Tick:
    """Time passed: followers that waited longer than ``max_wait`` are released."""

    now: float = attrs.field(validator=time_field())


FlightEvent: TypeAlias = Arrived | Progress | PrefillDone | Finished | Aborted | Tick
_EVENT_TYPES = (Arrived, Progress, PrefillDone, Finished, Aborted, Tick)


# -- decisions ---------------------------------------------------------------------------
@final
@attrs.frozen(kw_only=True)
class Lead:
    """The request leads ``flight``: admit it, it computes the prompt."""

    request_id: RequestId
    flight: int


@final
@attrs.frozen(kw_only=True)
class Wait:
    """The request waits in ``flight`` without pages. ``blocks`` is how many leading blocks
    it waits for (``None``: the whole prompt, an exact follower)."""

    request_id: RequestId
    flight: int
    blocks: int | None = None


@final
@attrs.frozen(kw_only=True)
class Independent:
    """The request is not coordinated: admit it, it computes on its own."""

    request_id: RequestId


@final
@attrs.frozen(kw_only=True)
class Release:
    """These waiting requests may be admitted now (oldest first); they look the prefix up."""

    flight: int
    request_ids: tuple[RequestId, ...]
    reason: ReleaseReason


@final
@attrs.frozen(kw_only=True)
class Promote:
    """The leader left before publishing: this follower (the oldest) leads ``flight`` now;
    admit it, it computes the prompt."""

    flight: int
    request_id: RequestId


FlightDecision: TypeAlias = Lead | Wait | Independent | Release | Promote


class Placement(enum.Enum):
    """Where a known request id is (exactly one place)."""

    LEADING = "leading"
    WAITING = "waiting"
    RELEASED = "released"
    INDEPENDENT = "independent"


_FLOAT_MAX: Final = sys.float_info.max
_LEADING, _WAITING = Placement.LEADING, Placement.WAITING
_RELEASED, _INDEPENDENT = Placement.RELEASED, Placement.INDEPENDENT

TRANSITIONS: Final[
    Mapping[Placement | None, Mapping[type[FlightEvent], frozenset[Placement | None]]]
] = {
    # place of the event's request -> {legal event: where that request may be afterwards}
    # (None: unknown, never seen or terminated). A pair not listed is rejected with
    # `UsageError` before anything changes. `Tick` names no request: always legal.
    None: {
        Arrived: frozenset({_LEADING, _WAITING, _INDEPENDENT}),
    },
    _LEADING: {
        Progress: frozenset({_LEADING}),
        PrefillDone: frozenset({_LEADING, _RELEASED}),  # AFTER_PREFILL closes the flight
        Finished: frozenset({None}),
        Aborted: frozenset({None}),  # the oldest exact follower may be promoted
    },
    _WAITING: {
        Aborted: frozenset({None}),
    },
    _RELEASED: {
        Progress: frozenset({_RELEASED}),
        PrefillDone: frozenset({_RELEASED}),
        Finished: frozenset({None}),
        Aborted: frozenset({None}),
    },
    _INDEPENDENT: {
        Progress: frozenset({_INDEPENDENT}),
        PrefillDone: frozenset({_INDEPENDENT}),
        Finished: frozenset({None}),
        Aborted: frozenset({None}),
    },
}
"""The legal (placement x event) pairs of `FlightCoordinator`, and the places each leads to."""

_VERBS: Final[Mapping[type[FlightEvent], str]] = {
    Arrived: "arrive",
    Progress: "report progress",
    PrefillDone: "finish its prefill",
    Finished: "finish",
    Aborted: "abort",
}


@final
@attrs.frozen(kw_only=True)
class FlightConfig:
    """How the coordinator behaves.

    ``max_wait``: a follower that has waited longer than this (simulated seconds) is released
    to compute on its own; ``None`` waits forever. ``min_shared_blocks``: turns on
    partial-prefix coordination: a request sharing at least this many leading full blocks
    with an open flight's leader waits only for those blocks; ``None`` (default) is off.
    ``block_size`` converts a follower's reusable blocks into tokens for the stats.
    """

    policy: ReleasePolicy = ReleasePolicy.AFTER_PREFILL
    max_wait: float | None = None
    min_shared_blocks: int | None = None
    block_size: int = 16

    def __attrs_post_init__(self) -> None:
        check_instance("policy", self.policy, ReleasePolicy)
        if self.max_wait is not None:
            mw = check_time("max_wait", self.max_wait, error=ConfigError)
            if mw < 0:
                raise ConfigError(f"max_wait must be None or >= 0 seconds, got {mw!r}")
        if self.min_shared_blocks is not None:
            check_int("min_shared_blocks", self.min_shared_blocks, minimum=1)
        check_int("block_size", self.block_size, minimum=1)


@final
@attrs.frozen(kw_only=True)
class FlightStats:
    """Counters since the coordinator was made (times in the events' units)."""

    flights_opened: int = 0
    followers: int = 0
    partial_followers: int = 0
    tokens_not_recomputed: int = 0
    waits: int = 0
    total_wait: float = 0.0
    max_wait: float = 0.0
    promotions: int = 0
    timeouts: int = 0


# -- state -------------------------------------------------------------------------------
@attrs.define(eq=False, slots=True)
class _Member:
    """One arrival waiting in a flight. Identity matters: a deadline belongs to one arrival,
    so a re-used request id never inherits the deadline of an earlier incarnation."""

    arrived: float
    seq: int  # arrival order across the coordinator
    need: int  # leading blocks awaited (partial waiters; 0 for exact followers)
    tokens: int


@attrs.define(eq=False, slots=True)
class _Flight:
    id: int
    key: FlightKey
    leader: RequestId | None
    blocks: tuple[BlockHash, ...]
    followers: dict[RequestId, _Member] = attrs.Factory(dict)  # exact, in arrival order
    partial: dict[RequestId, _Member] = attrs.Factory(dict)  # partial-prefix, arrival order
    published: int = 0
    done: bool = False


@attrs.define(eq=False, slots=True)
class _MutableStats:
    flights_opened: int = 0
    followers: int = 0
    partial_followers: int = 0
    tokens_not_recomputed: int = 0
    waits: int = 0
    total_wait: float = 0.0
    max_wait: float = 0.0
    promotions: int = 0
    timeouts: int = 0

    def freeze(self) -> FlightStats:
        return FlightStats(**attrs.asdict(self, recurse=False))


@final
class FlightCoordinator:
    """Single-flight coordinator of identical prompts (see the module docstring).

    ``handle(event)`` returns the decisions in the order the host should apply them. A
    rejected event (unknown or duplicate id, time going backwards, an event the request's
    place does not allow: see `TRANSITIONS`) raises `UsageError` and leaves the state
    unchanged.
    """

    TRANSITIONS: ClassVar[
        Mapping[Placement | None, Mapping[type[FlightEvent], frozenset[Placement | None]]]
    ] = TRANSITIONS

    __slots__ = (
        "_by_key",
        "_config",
        "_deadlines",
        "_flights",
        "_independent",
        "_leading",
        "_next_id",
        "_now",
        "_places",
        "_prefix_index",
        "_released",
        "_seq",
        "_stats",
        "_waiting",
    )

    def __init__(self, config: FlightConfig | None = None) -> None:
        self._config = FlightConfig() if config is None else config
        check_instance("config", self._config, FlightConfig)
        self._flights: dict[int, _Flight] = {}
        self._by_key: dict[FlightKey, _Flight] = {}
        self._leading: dict[RequestId, _Flight] = {}
        self._waiting: dict[RequestId, _Flight] = {}
        # released / independent ids until they terminate (dicts: deterministic order)
        self._released: dict[RequestId, None] = {}
        self._independent: dict[RequestId, None] = {}
        # the one place a request's placement is read from: each place and its members
        self._places: tuple[tuple[Placement, Mapping[RequestId, object]], ...] = (
            (Placement.LEADING, self._leading),
            (Placement.WAITING, self._waiting),
            (Placement.RELEASED, self._released),
            (Placement.INDEPENDENT, self._independent),
        )
        # partial-prefix coordination: block hash -> open flights whose leader's prompt has
        # that block at depth >= min_shared_blocks - 1, oldest first. Hashes are chained
        # (`BlockHasher`), so a hash also fixes its depth and the whole prefix before it.
        self._prefix_index: dict[BlockHash, list[_Flight]] = {}
        # (deadline, request id, the arrival it belongs to), in deadline order
        self._deadlines: deque[tuple[float, RequestId, _Member]] = deque()
        self._next_id = 0
        self._seq = 0
        self._now = float("-inf")
        self._stats = _MutableStats()

    # -- views ---------------------------------------------------------------------------
    @property
    def config(self) -> FlightConfig:
        return self._config

    @property
    def stats(self) -> FlightStats:
        return self._stats.freeze()

    @property
    def now(self) -> float:
        """The latest time seen in an event (``-inf`` before the first)."""
        return self._now

    def placement(self, request_id: RequestId) -> Placement | None:
        """Where ``request_id`` is, or ``None`` if unknown (never seen, or terminated)."""
        for place, members in self._places:
            if request_id in members:
                return place
        return None

    def placements(self) -> dict[RequestId, Placement]:
        """A copy: every known request id and its place."""
        return {r: place for place, members in self._places for r in members}

    def flights(self) -> dict[int, tuple[RequestId | None, tuple[RequestId, ...]]]:
        """A copy: open flight id -> (leader, waiting members in arrival order, oldest
        first: exact followers and partial-prefix waiters together)."""
        out: dict[int, tuple[RequestId | None, tuple[RequestId, ...]]] = {}
        for f in self._flights.values():
            if f.partial and f.followers:
                members = sorted(
                    (*f.followers.items(), *f.partial.items()), key=lambda rm: rm[1].seq
                )
                out[f.id] = (f.leader, tuple(r for r, _ in members))
            else:
                out[f.id] = (f.leader, (*f.followers, *f.partial))
        return out

    def flight_of(self, key: FlightKey) -> int | None:
        """The open flight for ``key``, if any."""
        f = self._by_key.get(key)
        return None if f is None else f.id

    def __len__(self) -> int:
        """Open flights."""
        return len(self._flights)

    # -- the one entry point -------------------------------------------------------------
    def handle(self, event: FlightEvent) -> tuple[FlightDecision, ...]:
        """Apply one event; return the decisions to carry out, in order."""
        if not isinstance(event, _EVENT_TYPES):
            raise UsageError(f"not a flight event: {event!r}")
        # every check before any change: the event's fields were validated when it was
        # made; here the time and the (placement x event) pair
        now = event.now
        if type(now) is not float or not self._now <= now <= _FLOAT_MAX:  # NaN fails too
            now = check_time("now", now, after=self._now)  # converts or raises
        if not isinstance(event, Tick):
            rid = event.request_id
            place = self.placement(rid)
            if type(event) not in TRANSITIONS[place]:
                raise self._illegal(rid, place, event)
        out: list[FlightDecision] = []
        self._now = now
        self._expire(now, out)
        match event:
            case Arrived():
                self._arrive(event, now, out)
            case Progress():
                flight = self._leading.get(event.request_id)
                if flight is not None:
                    self._progress(flight, event.published_blocks, now, out)
            case PrefillDone():
                flight = self._leading.get(event.request_id)
                if flight is not None:
                    self._prefill_done(flight, now, out)
            case Finished():
                self._finish(event.request_id, now, out)
            case Aborted():
                self._abort(event.request_id, now, out)
            case Tick():
                pass
            case _:
                assert_never(event)
        return tuple(out)

    @staticmethod
    def _illegal(rid: RequestId, place: Placement | None, event: FlightEvent) -> UsageError:
        what = _VERBS[type(event)]
        if place is None:
            return UsageError(f"unknown request id {rid!r}: it cannot {what}")
        if isinstance(event, Arrived):
            return UsageError(f"duplicate request id {rid!r}: it is already known")
        return UsageError(f"request {rid!r} is {place.value} and cannot {what}")

    # -- transitions ---------------------------------------------------------------------
    def _arrive(self, ev: Arrived, now: float, out: list[FlightDecision]) -> None:
        rid = ev.request_id
        cfg = self._config
        if cfg.policy is ReleasePolicy.INDEPENDENT:
            self._independent[rid] = None
            out.append(Independent(request_id=rid))
            return
        flight = self._by_key.get(ev.key)
        if flight is not None:
            m = _Member(now, self._seq, 0, ev.key.num_tokens)
            self._seq += 1
            flight.followers[rid] = m
            self._waiting[rid] = flight
            self._stats.followers += 1
            if cfg.max_wait is not None:
                self._deadlines.append((now + cfg.max_wait, rid, m))
            out.append(Wait(request_id=rid, flight=flight.id))
            return
        if cfg.min_shared_blocks is not None and ev.blocks:
            partial = self._partial_match(ev.blocks)
            if partial is not None:
                host, shared = partial
                m = _Member(now, self._seq, shared, ev.key.num_tokens)
                self._seq += 1
                host.partial[rid] = m
                self._waiting[rid] = host
                self._stats.partial_followers += 1
                if cfg.max_wait is not None:
                    self._deadlines.append((now + cfg.max_wait, rid, m))
                out.append(Wait(request_id=rid, flight=host.id, blocks=shared))
                return
        flight = _Flight(self._next_id, ev.key, rid, ev.blocks)
        self._next_id += 1
        self._flights[flight.id] = flight
        self._by_key[ev.key] = flight
        self._leading[rid] = flight
        self._stats.flights_opened += 1
        if cfg.min_shared_blocks is not None:
            index = self._prefix_index
            for i in range(cfg.min_shared_blocks - 1, len(ev.blocks)):
                index.setdefault(ev.blocks[i], []).append(flight)
        out.append(Lead(request_id=rid, flight=flight.id))

    def _partial_match(self, blocks: tuple[BlockHash, ...]) -> tuple[_Flight, int] | None:
        """The open flight sharing the most leading blocks (at least ``min_shared_blocks``;
        the oldest flight on a tie), if its shared blocks are not all published yet."""
        m = self._config.min_shared_blocks
        assert m is not None
        index = self._prefix_index
        best: _Flight | None = None
        shared = 0
        for i in range(m - 1, len(blocks)):  # chained hashes: a hit at depth i is a hit
            fs = index.get(blocks[i])  # on the whole prefix, so keep the deepest
            if fs:
                best, shared = fs[0], i + 1
        if best is None or best.done or best.published >= shared:
            return None  # nothing to wait for: the shared blocks are already published
        return best, shared

    def _progress(
        self, flight: _Flight, published: int, now: float, out: list[FlightDecision]
    ) -> None:
        if published > flight.published:
            flight.published = published
        self._release_partial(flight, now, out, ReleaseReason.BLOCKS_PUBLISHED, all_=False)

    def _prefill_done(self, flight: _Flight, now: float, out: list[FlightDecision]) -> None:
        flight.done = True
        flight.published = max(flight.published, len(flight.blocks))
        self._release_partial(flight, now, out, ReleaseReason.BLOCKS_PUBLISHED, all_=True)
        if self._config.policy is ReleasePolicy.AFTER_PREFILL:
            self._close(flight, now, out, ReleaseReason.PREFILL_PUBLISHED)

    def _finish(self, rid: RequestId, now: float, out: list[FlightDecision]) -> None:
        """A finished leader's blocks are all published: its flight releases everyone."""
        flight = self._leading.pop(rid, None)
        if flight is None:
            self._forget(rid)
            return
        flight.leader = None
        flight.done = True
        self._release_partial(flight, now, out, ReleaseReason.BLOCKS_PUBLISHED, all_=True)
        self._close(flight, now, out, ReleaseReason.LEADER_FINISHED)

    def _abort(self, rid: RequestId, now: float, out: list[FlightDecision]) -> None:
        """An aborted leader before its prefill is done hands its flight to the oldest exact
        follower; otherwise the flight's members compute alone."""
        flight = self._leading.pop(rid, None)
        if flight is None:
            self._forget(rid)
            return
        flight.leader = None
        if not flight.done and flight.followers:
            new = next(iter(flight.followers))
            self._note_wait(flight.followers.pop(new).arrived, now)
            del self._waiting[new]
            flight.leader = new
            self._leading[new] = flight
            self._stats.promotions += 1
            out.append(Promote(flight=flight.id, request_id=new))
            return
        self._release_partial(flight, now, out, ReleaseReason.LEADER_ABORTED, all_=True)
        self._close(flight, now, out, ReleaseReason.LEADER_ABORTED)

    def _forget(self, rid: RequestId) -> None:
        """A request that leads no flight ends: it leaves the flight it waits in, if any."""
        flight = self._waiting.pop(rid, None)
        if flight is not None:
            if flight.followers.pop(rid, None) is None:
                del flight.partial[rid]
            return
        self._released.pop(rid, None)
        self._independent.pop(rid, None)

    def _release_partial(
        self,
        flight: _Flight,
        now: float,
        out: list[FlightDecision],
        reason: ReleaseReason,
        *,
        all_: bool,
    ) -> None:
        if not flight.partial:
            return
        ready = [r for r, m in flight.partial.items() if all_ or m.need <= flight.published]
        if not ready:
            return
        bs = self._config.block_size
        for r in ready:
            m = flight.partial.pop(r)
            del self._waiting[r]
            self._released[r] = None
            self._note_wait(m.arrived, now)
            if reason is ReleaseReason.BLOCKS_PUBLISHED:
                self._stats.tokens_not_recomputed += min(
                    m.need * bs, max(m.tokens - 1, 0) // bs * bs
                )
        out.append(Release(flight=flight.id, request_ids=tuple(ready), reason=reason))

    def _close(
        self, flight: _Flight, now: float, out: list[FlightDecision], reason: ReleaseReason
    ) -> None:
        """Remove the flight and its index entries; its members become released."""
        del self._flights[flight.id]
        del self._by_key[flight.key]
        m = self._config.min_shared_blocks
        if m is not None:
            index = self._prefix_index
            for i in range(m - 1, len(flight.blocks)):
                b = flight.blocks[i]
                fs = index[b]
                fs.remove(flight)
                if not fs:
                    del index[b]
        assert not flight.partial, "partial waiters are released before a flight closes"
        if flight.leader is not None:
            del self._leading[flight.leader]
            self._released[flight.leader] = None
            flight.leader = None
        if flight.followers:
            ids = tuple(flight.followers)
            for r, member in flight.followers.items():
                del self._waiting[r]
                self._released[r] = None
                self._note_wait(member.arrived, now)
            if flight.done:
                self._stats.tokens_not_recomputed += len(ids) * self._reusable(flight.key)
            out.append(Release(flight=flight.id, request_ids=ids, reason=reason))
            flight.followers.clear()

    def _reusable(self, key: FlightKey) -> int:
        bs = self._config.block_size
        return max(key.num_tokens - 1, 0) // bs * bs

    def _expire(self, now: float, out: list[FlightDecision]) -> None:
        """Release followers that have waited longer than ``max_wait`` (oldest first)."""
        dl = self._deadlines
        while dl and dl[0][0] < now:
            _, rid, member = dl.popleft()
            flight = self._waiting.get(rid)
            if flight is None:
                continue  # released, promoted or terminated
            if flight.followers.get(rid) is member:
                del flight.followers[rid]
            elif flight.partial.get(rid) is member:
                del flight.partial[rid]
            else:
                continue  # the id waits again, as a later arrival with its own deadline
            del self._waiting[rid]
            self._released[rid] = None
            self._note_wait(member.arrived, now)
            self._stats.timeouts += 1
            out.append(Release(flight=flight.id, request_ids=(rid,), reason=ReleaseReason.TIMEOUT))

    def _note_wait(self, arrived: float, now: float) -> None:
        s = self._stats
        w = now - arrived
        s.waits += 1
        s.total_wait += w
        if w > s.max_wait:
            s.max_wait = w

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise `AssertionError` if the internal state is inconsistent."""
        sets = [set(self._leading), set(self._waiting), set(self._released), set(self._independent)]
        total = sum(len(s) for s in sets)
        assert len(set().union(*sets)) == total, "a request id is in two places"
        assert len(self._by_key) == len(self._flights), "one flight per key"
        live: set[int] = set()
        for f in self._flights.values():
            assert self._by_key[f.key] is f
            members = [*f.followers, *f.partial]
            assert f.leader is not None or members, "a flight outlived all its members"
            if f.leader is not None:
                assert self._leading[f.leader] is f
            for r in members:
                assert self._waiting[r] is f
            assert all(m.need == 0 for m in f.followers.values())
            assert all(m.need > 0 for m in f.partial.values())
            live.update(id(m) for m in (*f.followers.values(), *f.partial.values()))
        for r, f in self._leading.items():
            assert f.leader == r and self._flights[f.id] is f
        for r, f in self._waiting.items():
            assert r in f.followers or r in f.partial
            assert self._flights[f.id] is f
        for fs in self._prefix_index.values():
            assert fs, "empty prefix index entry"
            for f in fs:
                assert self._flights.get(f.id) is f, "stale prefix index entry"
        if self._config.max_wait is not None:  # every waiting arrival has its own deadline
            queued = {id(m) for _, _, m in self._deadlines}
            assert live <= queued, "a waiting arrival has no deadline"
