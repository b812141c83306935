"""Executable specification of the scheduler + prefix cache + coordinator.

`FakeBackend` executes `StepPlan`s instantly on a pool of pages that hold token ids instead
of KV, and checks every read: a prefill or decode may only attend to pages that hold exactly
the tokens of its own sequence, and reads a page written in the same step only from a writer
its ``reads_from`` declares. `SchedulerMachine` drives a scheduler with random arrivals
(identical and different prompts, two namespaces), steps, aborts (also while a step is
running), failed steps, bad results and unknown ids, with and without same-step sharing, and
checks after every step:

- pinned blocks are never evicted and page counts add up (``check_invariants``);
- every cached block's page holds exactly that block's tokens, or, between a plan and its
  run, is written by that plan (same-step sharing registers a block when its step is
  planned); a failed step's pages are wiped, so a block it left cached would be caught;
- requests are where the coordinator says they are;
- no page leaks once every request has ended;
- liveness: with arrivals stopped, everything finishes within a bound of steps;
- reports are consistent (cached + computed == prompt, outputs are the backend's tokens).

Run it against your own scheduler::

    run_state_machine_as_test(SchedulerMachine.for_factory(my_factory))

where ``my_factory(config, cache, coordinator)`` returns an object shaped like `Scheduler`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import (
    BlockHash,
    BlockHasher,
    FinishReason,
    FlightCoordinator,
    PrefixCache,
    PublishMode,
    ReleasePolicy,
    RequestId,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    UsageError,
)
from prefixflight.core.cache import POLICIES, make_policy
from prefixflight.core.flight import Placement, RequestState

from ._backend import FakeBackend

__all__ = ["FakeBackend", "SchedulerFactory", "SchedulerMachine"]

SchedulerFactory = Callable[[SchedulerConfig, PrefixCache, FlightCoordinator], Any]


def _default_factory(
    config: SchedulerConfig, cache: PrefixCache, coordinator: FlightCoordinator
) -> Scheduler:
    return Scheduler(config, cache=cache, coordinator=coordinator)


_BLOCK = 2
_FAMILIES: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4, 5, 6, 7),
    (1, 2, 3, 4, 9, 9),
    (1, 2, 8, 8, 8, 8, 8, 8),
    (5, 5, 5),
)
_IDS = tuple(range(8))
_STOP = 3


def _sampler(rid: RequestId, position: int) -> int:
    return position % 4  # identical across requests: decode blocks get shared too


class SchedulerMachine(RuleBasedStateMachine):
    """Scheduler + cache + coordinator on a `FakeBackend`, checked after every step."""

    factory: ClassVar[SchedulerFactory] = _default_factory

    @classmethod
    def for_factory(cls, factory: SchedulerFactory) -> type[SchedulerMachine]:
        """A subclass of this machine that tests schedulers made by ``factory``."""
        name = f"{cls.__name__}For{getattr(factory, '__name__', 'Factory')}"
        return type(name, (cls,), {"factory": staticmethod(factory)})

    def __init__(self) -> None:
        super().__init__()
        self.sched: Any = None
        self.backend: FakeBackend | None = None
        self.coordinator: FlightCoordinator | None = None
        self.cache: PrefixCache | None = None
        self.now = 0.0
        self.plan: StepPlan | None = None
        self.result: StepResult | None = None
        # live request -> (prompt, namespace, max_new_tokens, stops on _STOP)
        self.live: dict[RequestId, tuple[tuple[int, ...], bytes, int, bool]] = {}
        self.aborting: set[RequestId] = set()  # aborted while the outstanding plan runs
        self.added_tokens = 0  # prompt tokens of every accepted request
        self.added = 0
        self.block_tokens: dict[BlockHash, tuple[int, ...]] = {}
        self.hashers = {ns: BlockHasher(_BLOCK, namespace=ns) for ns in (b"a", b"b")}

    @initialize(
        num_pages=st.integers(5, 9),
        max_running=st.integers(1, 3),
        extra_tokens=st.integers(0, 4),
        publish=st.sampled_from(PublishMode),
        policy=st.sampled_from(sorted(POLICIES)),
        capacity_cut=st.integers(0, 3),
        sharing=st.booleans(),
        flight=st.sampled_from(ReleasePolicy),
        max_wait=st.one_of(st.none(), st.sampled_from([0.0, 2.0])),
        min_shared=st.one_of(st.none(), st.just(1)),
    )
    def setup(
        self,
        num_pages: int,
        max_running: int,
        extra_tokens: int,
        publish: PublishMode,
        policy: str,
        capacity_cut: int,
        sharing: bool,
        flight: ReleasePolicy,
        max_wait: float | None,
        min_shared: int | None,
    ) -> None:
        config = SchedulerConfig(
            num_pages=num_pages,
            block_size=_BLOCK,
            max_batch_tokens=max_running + extra_tokens,
            max_running=max_running,
            publish=publish,
            same_step_sharing=sharing,
        )
        capacity = max(num_pages - capacity_cut, 0)
        pol = make_policy(policy, capacity)
        # the parts Scheduler.build makes, handed to the factory before any call
        parts = Scheduler.build(
            config,
            eviction=pol,
            release=flight,
            max_wait=max_wait,
            min_shared_blocks=min_shared,
        )
        self.cache, self.coordinator = parts.cache, parts.coordinator
        note(f"{config!r}, {pol!r}, {self.coordinator.config!r}")
        self.sched = type(self).factory(config, self.cache, self.coordinator)
        self.backend = FakeBackend(num_pages, _BLOCK, _sampler)

    # -- helpers -------------------------------------------------------------------------
    def _snapshot(self) -> object:
        s = self.sched
        assert self.coordinator is not None
        return (s.requests(), s.page_usage(), s.stats, s.outstanding, self.coordinator.placements())

    def _rejected(self, call: Callable[[], object]) -> None:
        before = self._snapshot()
        try:
            call()
        except UsageError as exc:
            note(f"  rejected: {exc}")
        else:
            raise AssertionError("the call should have been rejected")
        assert self._snapshot() == before, "a rejected call changed the state"

    def _record_blocks(self, rid: RequestId) -> None:
        assert self.backend is not None
        seq = self.backend.sequences[rid]
        ns = self.live[rid][1]
        for j, h in enumerate(self.hashers[ns].hash_tokens(seq)):
            self.block_tokens[h] = tuple(seq[j * _BLOCK : (j + 1) * _BLOCK])

    def _check_report(self, report: Any) -> None:
        assert self.backend is not None
        rid = report.request_id
        prompt, _, max_new, stops = self.live.pop(rid)
        n = len(prompt)
        assert report.prompt_tokens == n
        assert report.cached_tokens % _BLOCK == 0
        assert report.cached_tokens <= (n - 1) // _BLOCK * _BLOCK, "the last token is computed"
        outputs = tuple(self.backend.sequences[rid][n:]) if rid in self.backend.sequences else ()
        if report.finish_reason is FinishReason.ABORTED:
            assert report.output_token_ids == outputs[: len(report.output_token_ids)]
            return
        assert report.cached_tokens + report.computed_prompt_tokens == n
        assert report.output_token_ids == outputs
        assert 1 <= len(outputs) <= max_new
        if report.finish_reason is FinishReason.LENGTH:
            assert len(outputs) == max_new
            assert not stops or _STOP not in outputs
        else:
            assert stops
            assert outputs[-1] == _STOP and _STOP not in outputs[:-1]
        assert report.first_token_at is not None and report.first_token_at <= report.finished_at

    @staticmethod
    def _plan_ids(plan: StepPlan) -> set[RequestId]:
        return {p.request_id for p in plan.prefills} | {d.request_id for d in plan.decodes}

    def _check_written_before_run(self, plan: StepPlan) -> None:
        """Before the backend runs ``plan``: every cached block holds its tokens already, or
        this plan writes its page (it was registered for same-step sharing)."""
        assert self.cache is not None and self.backend is not None
        writers = self.backend.writers(plan)
        for b in self.cache.policy.resident():
            page = self.cache.page(b)
            assert page is not None
            if page in writers:
                assert self.sched.config.same_step_sharing, f"block {b!r} cached before its KV"
                continue
            held = tuple(self.backend.pages[page])
            assert held == self.block_tokens[b], f"cached page {page} holds {held}"

    def _step(self, dt: float) -> bool:
        """Schedule and complete one step; False if the plan was empty."""
        self.schedule(dt)
        if self.plan is None:
            return False
        self.complete(0.5)
        return True

    # -- rules ---------------------------------------------------------------------------
    @rule(
        rid=st.sampled_from(_IDS),
        family=st.integers(0, len(_FAMILIES) - 1),
        cut=st.integers(0, 2),
        ns=st.sampled_from([b"a", b"b"]),
        max_new=st.integers(1, 3),
        stop=st.booleans(),
    )
    def add(self, rid: int, family: int, cut: int, ns: bytes, max_new: int, stop: bool) -> None:
        assert self.backend is not None
        prompt = _FAMILIES[family][: len(_FAMILIES[family]) - cut]
        stops = (_STOP,) if stop else ()
        note(f"add_request({rid!r}, {prompt!r}, max_new_tokens={max_new}, ns={ns!r})")

        def call() -> object:
            return self.sched.add_request(
                rid, prompt, max_new_tokens=max_new, now=self.now, namespace=ns,
                stop_token_ids=stops,
            )  # fmt: skip

        if rid in self.live or rid in self.aborting:
            self._rejected(call)
            return
        state = call()
        assert state in (RequestState.QUEUED, RequestState.WAITING)
        self.live[rid] = (prompt, ns, max_new, stop)
        self.backend.sequences[rid] = list(prompt)
        self.added += 1
        self.added_tokens += len(prompt)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), rid=st.sampled_from(_IDS), max_new=st.integers(1, 3))
    def add_identical(self, data: st.DataObject, rid: int, max_new: int) -> None:
        """Same prompt and namespace as a live request: joins its flight if one is open."""
        other = data.draw(st.sampled_from(sorted(self.live, key=repr)))
        prompt, ns, _, stop = self.live[other]
        family = next(i for i, f in enumerate(_FAMILIES) if f[: len(prompt)] == prompt)
        self.add(rid, family, len(_FAMILIES[family]) - len(prompt), ns, max_new, stop)

    @precondition(lambda self: self.sched is not None and self.plan is None)
    @rule(dt=st.sampled_from([0.0, 1.0]))
    def step(self, dt: float) -> None:
        self._step(dt)

    @precondition(lambda self: self.sched is not None and self.sched.outstanding is None)
    @rule(dt=st.sampled_from([0.0, 1.0, 2.5]))
    def schedule(self, dt: float) -> None:
        assert self.backend is not None
        self.now += dt
        decoding = {  # requests whose first token is out: they must all decode now
            rid
            for rid, (prompt, *_) in self.live.items()
            if len(self.backend.sequences[rid]) > len(prompt)
        }
        stalls = self.sched.stats.admission_stalls
        plan = self.sched.schedule(self.now)
        note(f"schedule({self.now}) -> {plan!r}")
        cfg = self.sched.config
        assert plan.num_tokens <= cfg.max_batch_tokens
        ids = [p.request_id for p in plan.prefills] + [d.request_id for d in plan.decodes]
        assert len(ids) == len(set(ids)) <= cfg.max_running
        assert {d.request_id for d in plan.decodes} == decoding, "every decoding request decodes"
        full = plan.num_tokens == cfg.max_batch_tokens
        for p in plan.prefills:  # a prompt is cut short only when the budget runs out
            assert p.sample or full, f"{p.request_id!r} chunked with budget left"
        states = self.sched.requests().values()
        running = sum(s is RequestState.RUNNING for s in states)
        if not full and running < cfg.max_running and RequestState.QUEUED in states:
            assert self.sched.stats.admission_stalls == stalls + 1, "admission left work idle"
        if plan.is_empty:
            assert self.sched.outstanding is None
            self.plan = None
            return
        if not cfg.same_step_sharing:
            assert all(not p.reads_from for p in plan.prefills), "shared without sharing"
        self._check_written_before_run(plan)
        self.plan = plan
        self.result = self.backend.run(plan)
        for rid in self._plan_ids(plan):
            if rid in self.live:
                self._record_blocks(rid)

    @precondition(lambda self: self.plan is not None)
    @rule(dt=st.sampled_from([0.0, 0.5]))
    def complete(self, dt: float) -> None:
        assert self.result is not None and self.plan is not None
        self.now += dt
        outcome = self.sched.complete_step(self.result, self.now)
        note(f"complete_step -> {outcome!r}")
        live_ids = [rid for rid, _ in self.result.sampled if rid in self.live]
        assert [rid for rid, _ in outcome.tokens] == live_ids
        for report in outcome.finished:
            assert report.finish_reason is not FinishReason.ABORTED
            self._check_report(report)
        self.plan = None
        self.result = None
        self.aborting.clear()

    @precondition(lambda self: self.plan is not None)
    @rule(kind=st.sampled_from(["wrong_step", "missing", "extra", "bad_token"]))
    def bad_result(self, kind: str) -> None:
        """A result that does not answer the plan (rejected by the scheduler) or is malformed
        (rejected already when it is made): either way, nothing changes."""
        assert self.result is not None
        r = self.result
        step, sampled = r.step, r.sampled
        match kind:
            case "wrong_step":
                step += 1
            case "missing":
                sampled = sampled[1:]
            case "extra":
                sampled = (*sampled, ("nobody", 1))
            case _:
                sampled = tuple((rid, -1) for rid, _ in sampled)
        if (step, sampled) == (r.step, r.sampled):
            return  # e.g. nothing sampled in this step: "missing" is the same result
        self._rejected(
            lambda: self.sched.complete_step(StepResult(step=step, sampled=sampled), self.now)
        )

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live, key=repr)))
        note(f"abort({rid!r})")
        report = self.sched.abort(rid, self.now)
        assert report.finish_reason is FinishReason.ABORTED
        plan = self.plan
        if plan is not None and rid in self._plan_ids(plan):
            self.aborting.add(rid)
        assert self.sched.state(rid) is (RequestState.ABORTING if rid in self.aborting else None)
        self._check_report(report)

    @precondition(lambda self: self.plan is not None)
    @rule(dt=st.sampled_from([0.0, 0.5]))
    def fail(self, dt: float) -> None:
        """The step's result never comes: the pages it wrote hold garbage from now on."""
        assert self.plan is not None and self.backend is not None
        self.now += dt
        in_plan = self._plan_ids(self.plan)
        note("fail_step()")
        reports = self.sched.fail_step(self.now)
        assert [r.request_id for r in reports] == [
            rid for rid in [*(p.request_id for p in self.plan.prefills),
                            *(d.request_id for d in self.plan.decodes)]
            if rid in self.live
        ]  # fmt: skip
        for report in reports:
            assert report.finish_reason is FinishReason.ABORTED
            self._check_report(report)
        assert not in_plan & set(self.live), "a request of the failed step is still live"
        for page in self.backend.written:
            self.backend.pages[page] = [None] * _BLOCK
        self.plan = None
        self.result = None
        self.aborting.clear()

    @precondition(lambda self: self.sched is not None)
    @rule(
        what=st.sampled_from(
            ["abort_unknown", "abort_aborting", "time_backwards", "schedule_twice", "no_step"]
        )
    )
    def misuse(self, what: str) -> None:
        match what:
            case "abort_unknown":
                self._rejected(lambda: self.sched.abort(99, self.now))
            case "abort_aborting":
                if self.aborting:
                    rid = min(self.aborting, key=repr)
                    self._rejected(lambda: self.sched.abort(rid, self.now))
            case "no_step":
                if self.plan is None:
                    self._rejected(lambda: self.sched.complete_step(StepResult(step=0), self.now))
                    self._rejected(lambda: self.sched.fail_step(self.now))
            case "time_backwards":
                if self.sched.now > float("-inf") and self.plan is None:
                    self._rejected(lambda: self.sched.schedule(self.sched.now - 1.0))
            case _:
                if self.plan is not None:
                    self._rejected(lambda: self.sched.schedule(self.now))

    @precondition(lambda self: self.sched is not None)
    @rule()
    def drain(self) -> None:
        """Liveness: with arrivals stopped, everything finishes within a bound of steps."""
        if self.plan is not None:
            self.complete(0.0)
        bound = sum(len(p) + m for p, _, m, _ in self.live.values()) + 2 * len(self.live) + 2
        for _ in range(bound):
            if not self.sched.has_unfinished:
                break
            self.check_pages()
            assert self._step(1.0), "an empty plan while requests are unfinished"
        assert not self.sched.has_unfinished, f"not finished after {bound} steps"
        assert not self.live
        usage = self.sched.page_usage()
        assert usage.private == 0 and usage.pinned == 0, f"pages leaked: {usage!r}"
        assert usage.free + usage.cached == usage.total

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def check_pages(self) -> None:
        if self.sched is None:
            return
        assert self.cache is not None and self.backend is not None
        self.sched.check_invariants()
        usage = self.sched.page_usage()
        assert usage.free + usage.cached + usage.private == usage.total
        for b in self.cache.policy.resident():
            page = self.cache.page(b)
            assert page is not None
            held = tuple(self.backend.pages[page])
            assert held == self.block_tokens[b], f"cached page {page} holds {held}"

    @invariant()
    def prefix_counters_add_up(self) -> None:
        """One lookup per admitted request: queries and hits never exceed what arrived."""
        if self.sched is None:
            return
        stats = self.sched.stats
        assert stats.prefix_queries <= self.added
        assert stats.prefix_query_tokens <= self.added_tokens
        assert stats.cached_tokens <= stats.prefix_query_tokens

    @invariant()
    def requests_agree_with_coordinator(self) -> None:
        if self.sched is None:
            return
        assert self.coordinator is not None
        reqs = self.sched.requests()
        assert set(reqs) == set(self.live) | self.aborting
        places = self.coordinator.placements()
        assert set(places) == set(self.live), "the coordinator and the scheduler disagree on ids"
        for rid, state in reqs.items():
            assert (state is RequestState.ABORTING) == (rid in self.aborting)
            if rid in self.live:
                assert (state is RequestState.WAITING) == (places[rid] is Placement.WAITING)
