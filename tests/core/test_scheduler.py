"""Scheduler: batching, chunked prefill, reuse, publication, flights, pages and every fault."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflight.core import (
    LRU,
    S3FIFO,
    BlockHasher,
    ConfigError,
    FinishReason,
    FlightConfig,
    FlightCoordinator,
    PrefixCache,
    PublishMode,
    ReleasePolicy,
    RequestReport,
    Scheduler,
    SchedulerConfig,
    StepResult,
    UsageError,
)
from prefixflight.core.flight import RequestState, Role
from prefixflight.specs import FakeBackend

BS = 4


def make(
    num_pages: int = 64,
    *,
    budget: int = 64,
    max_running: int = 8,
    publish: PublishMode = PublishMode.PER_STEP,
    flight: ReleasePolicy = ReleasePolicy.INDEPENDENT,
    eviction: LRU | S3FIFO | None = None,
    sharing: bool = True,
    max_wait: float | None = None,
    min_shared_blocks: int | None = None,
) -> tuple[Scheduler, FakeBackend]:
    config = SchedulerConfig(
        num_pages=num_pages,
        block_size=BS,
        max_batch_tokens=budget,
        max_running=min(max_running, budget),
        publish=publish,
        same_step_sharing=sharing,
    )
    sched = Scheduler.build(
        config,
        eviction=eviction,
        release=flight,
        max_wait=max_wait,
        min_shared_blocks=min_shared_blocks,
    )
    return sched, FakeBackend(num_pages, BS, lambda rid, pos: 1000 + pos)


class Host:
    """Drives a scheduler on the fake backend; one time unit per step."""

    def __init__(self, sched: Scheduler, backend: FakeBackend) -> None:
        self.s = sched
        self.b = backend
        self.now = 0.0
        self.reports: dict[object, RequestReport] = {}

    def add(
        self, rid: object, prompt: Sequence[int], max_new: int = 2, **kw: object
    ) -> RequestState:
        self.b.sequences[rid] = list(prompt)  # type: ignore[index]
        return self.s.add_request(rid, prompt, max_new_tokens=max_new, now=self.now, **kw)  # type: ignore[arg-type]

    def step(self) -> bool:
        plan = self.s.schedule(self.now)
        if plan.is_empty:
            return False
        result = self.b.run(plan)
        self.now += 1.0
        out = self.s.complete_step(result, self.now)
        for r in out.finished:
            self.reports[r.request_id] = r
        self.s.check_invariants()
        return True

    def drain(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.s.has_unfinished:
                return
            assert self.step(), "stuck with unfinished requests"
        raise AssertionError("did not drain")


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def snapshot(s: Scheduler) -> object:
    return (s.requests(), s.page_usage(), s.stats, s.outstanding, s.now, s.coordinator.placements())


# -- configuration ---------------------------------------------------------------------
def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="num_pages"):
        SchedulerConfig(num_pages=0)
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        SchedulerConfig(num_pages=8, max_running=8, max_batch_tokens=4)
    with pytest.raises(ConfigError, match="publish"):
        SchedulerConfig(num_pages=8, publish="per_step")  # type: ignore[arg-type]
    config = SchedulerConfig(num_pages=8, block_size=BS)
    with pytest.raises(ConfigError, match="block_size"):
        Scheduler(config, cache=PrefixCache(LRU(8), 16))
    with pytest.raises(ConfigError, match="block_size"):
        Scheduler(config, coordinator=FlightCoordinator(FlightConfig(block_size=16)))
    cache = PrefixCache(LRU(8), BS)
    cache.publish([b"x"], [0])
    with pytest.raises(ConfigError, match="empty"):
        Scheduler(config, cache=cache)


def test_build_gives_the_block_size_to_cache_and_coordinator() -> None:
    events: list[object] = []
    config = SchedulerConfig(num_pages=8, block_size=2)
    sched = Scheduler.build(
        config,
        eviction=S3FIFO(5),
        release=ReleasePolicy.ON_COMPLETION,
        max_wait=1.5,
        min_shared_blocks=2,
        event_sink=events.append,
    )
    assert sched.cache.block_size == 2 and sched.cache.policy.capacity == 5
    assert sched.coordinator.config == FlightConfig(
        policy=ReleasePolicy.ON_COMPLETION, max_wait=1.5, min_shared_blocks=2, block_size=2
    )
    h = Host(sched, FakeBackend(8, 2, lambda rid, pos: 7))
    h.add("a", [1, 2, 3, 4, 5], max_new=1)
    h.drain()
    assert events, "the event sink received no KV event"
    default = Scheduler.build(config)
    assert isinstance(default.cache.policy, LRU) and default.cache.policy.capacity == 8
    assert default.coordinator.config.policy is ReleasePolicy.INDEPENDENT
    with pytest.raises(UsageError, match="config"):
        Scheduler.build(FlightConfig())  # type: ignore[arg-type]


# -- batching and chunked prefill -------------------------------------------------------
def test_chunked_prefill_then_batched_decode() -> None:
    h = Host(*make(budget=8))
    h.add("a", prompt(18), max_new=3)
    h.add("b", prompt(5, 100), max_new=3)
    plans = []
    while h.s.has_unfinished:
        plans.append(h.s.schedule(h.now))
        result = h.b.run(plans[-1])
        h.now += 1
        for r in h.s.complete_step(result, h.now).finished:
            h.reports[r.request_id] = r
    for plan in plans:
        assert plan.num_tokens <= 8
    first = plans[0].prefills
    assert [(p.request_id, p.start, len(p.token_ids), p.sample) for p in first] == [
        ("a", 0, 8, False)
    ]
    # "a" is chunked over the budget; "b" joins as soon as there is room
    starts = [p.start for plan in plans for p in plan.prefills if p.request_id == "a"]
    assert starts == [0, 8, 16]
    # every decode of a step is batched: once both decode they do so together
    both = [plan for plan in plans if len(plan.decodes) == 2]
    assert both
    for rid in ("a", "b"):
        r = h.reports[rid]
        assert r.finish_reason is FinishReason.LENGTH
        assert len(r.output_token_ids) == 3
        assert r.cached_tokens == 0 and r.computed_prompt_tokens == r.prompt_tokens
        assert r.output_token_ids == tuple(h.b.sequences[rid][r.prompt_tokens :])


def test_stop_token_finishes_early() -> None:
    sched, backend = make()
    h = Host(sched, backend)
    stop = 1000 + 7  # the fake backend samples 1000 + position: position 7 is the 2nd token
    h.add("a", prompt(6), max_new=10, stop_token_ids=[stop])
    h.drain()
    r = h.reports["a"]
    assert r.finish_reason is FinishReason.STOP
    assert r.output_token_ids == (1006, 1007)


def test_max_running_caps_admission() -> None:
    h = Host(*make(max_running=2))
    for i in range(3):
        h.add(i, prompt(5, 10 * i))
    h.step()
    assert h.s.requests() == {
        0: RequestState.RUNNING,
        1: RequestState.RUNNING,
        2: RequestState.QUEUED,
    }
    h.drain()
    assert set(h.reports) == {0, 1, 2}


def test_empty_plan_is_not_outstanding() -> None:
    sched, _ = make()
    plan = sched.schedule(0.0)
    assert plan.is_empty and sched.outstanding is None
    assert sched.schedule(0.0).step == plan.step  # nothing consumed


# -- reuse ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [8, 9, 11, 12])
def test_reuse_is_clamped_so_the_last_prompt_token_is_computed(n: int) -> None:
    h = Host(*make())
    h.add("a", prompt(n))
    h.drain()
    h.add("b", prompt(n))
    h.step()
    table = h.s.page_table("b")
    h.drain()
    r = h.reports["b"]
    assert r.cached_tokens == (n - 1) // BS * BS
    assert r.computed_prompt_tokens == n - r.cached_tokens >= 1
    # the reused pages are the ones "a" published, first in the table
    k = r.cached_tokens // BS
    blocks = BlockHasher(BS).hash_tokens(prompt(n))
    assert list(table[:k]) == [h.s.cache.page(b) for b in blocks[:k]]


def test_namespaces_never_share_blocks() -> None:
    h = Host(*make())
    h.add("a", prompt(12), namespace="t1")
    h.drain()
    h.add("b", prompt(12), namespace="t2")
    h.drain()
    assert h.reports["b"].cached_tokens == 0


def test_incremental_publication_lets_a_late_request_reuse_while_the_first_decodes() -> None:
    def late_hit(publish: PublishMode) -> int:
        h = Host(*make(publish=publish))
        h.add("a", prompt(13), max_new=20)
        h.step()  # a's prefill
        h.step()  # a decodes
        h.add("b", prompt(13), max_new=2)
        h.drain()
        return h.reports["b"].cached_tokens

    assert late_hit(PublishMode.PER_STEP) == 12
    assert late_hit(PublishMode.ON_COMPLETION) == 0


def test_publication_includes_decoded_blocks() -> None:
    h = Host(*make())
    h.add("a", prompt(6), max_new=8)  # positions 0..12 computed: 3 full blocks
    h.drain()
    seq = h.b.sequences["a"]
    blocks = BlockHasher(BS).hash_tokens(seq[:12])
    assert all(b in h.s.cache for b in blocks)
    # a follow-up turn reuses the generated blocks too
    h.add("b", [*seq, 5, 5])
    h.drain()
    assert h.reports["b"].cached_tokens == 12


def test_duplicate_blocks_stay_private_and_are_freed() -> None:
    h = Host(*make(sharing=False))
    h.add("a", prompt(12), max_new=1)
    h.add("b", prompt(12), max_new=1)  # independent, no same-step sharing: both compute all
    h.drain()
    st = h.s.stats
    assert st.published_blocks == 3 and st.duplicate_blocks == 3
    usage = h.s.page_usage()
    assert usage.cached == 3 and usage.private == 0 and usage.free == usage.total - 3


# -- same-step sharing ------------------------------------------------------------------------
def test_requests_admitted_together_read_the_prefix_as_it_is_written() -> None:
    h = Host(*make())  # no coordination: only same-step sharing
    for rid in "abcd":
        h.add(rid, prompt(13), max_new=2)
    plan = h.s.schedule(h.now)
    assert [(p.request_id, p.start, p.reads_from) for p in plan.prefills] == [
        ("a", 0, ()),
        ("b", 12, ("a",)),
        ("c", 12, ("a",)),
        ("d", 12, ("a",)),
    ]
    a_pages = plan.prefills[0].pages[:3]  # a writes them in this very step
    assert all(p.pages[:3] == a_pages for p in plan.prefills[1:])
    h.now += 1.0
    h.s.complete_step(h.b.run(plan), h.now)
    h.drain()
    assert {h.reports[r].first_token_step for r in "abcd"} == {0}
    assert [h.reports[r].cached_tokens for r in "abcd"] == [0, 12, 12, 12]
    st = h.s.stats
    assert st.prefill_tokens == 13 + 3 * 1 and st.duplicate_blocks == 0


def test_without_same_step_sharing_requests_admitted_together_race() -> None:
    h = Host(*make(sharing=False))
    for rid in "abcd":
        h.add(rid, prompt(13), max_new=2)
    plan = h.s.schedule(h.now)
    assert all(not p.reads_from and p.start == 0 for p in plan.prefills)
    h.now += 1.0
    h.s.complete_step(h.b.run(plan), h.now)
    h.drain()
    st = h.s.stats
    assert st.prefill_tokens == 4 * 13 and st.duplicate_blocks == 3 * 3


def test_prompts_sharing_a_document_with_different_tails_compute_it_once() -> None:
    h = Host(*make())
    doc = prompt(16, 500)
    for i in range(4):
        h.add(i, [*doc, *prompt(3, 10 * i)], max_new=1)
    h.drain()
    assert [h.reports[i].cached_tokens for i in range(4)] == [0, 16, 16, 16]
    assert h.s.stats.prefill_tokens == 16 + 4 * 3


def test_arrivals_during_a_chunked_prefill_compute_only_their_tail() -> None:
    h = Host(*make(budget=8))  # a 30-token prompt takes four steps
    h.add("a", prompt(30))
    h.step()
    h.add("b", prompt(30))  # arrive while "a" is half way
    h.step()
    h.add("c", prompt(30))
    h.drain()
    assert [h.reports[r].cached_tokens for r in "abc"] == [0, 28, 28]
    assert h.s.stats.prefill_tokens == 30 + 2 * 2
    assert h.reports["b"].first_token_step == h.reports["a"].first_token_step


@pytest.mark.parametrize("sharing", [True, False])
def test_followers_start_in_the_step_that_ends_their_leaders_prompt(sharing: bool) -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, budget=8, sharing=sharing))
    h.add("L", prompt(21))  # three chunks: [0, 8), [8, 16), [16, 21)
    h.add("F1", prompt(21))
    h.add("F2", prompt(21))
    h.drain()
    lead = h.reports["L"].first_token_step
    assert lead == 2
    for f in ("F1", "F2"):
        r = h.reports[f]
        assert r.role is Role.FOLLOWER and r.cached_tokens == 20
        # released when the leader's last chunk is planned, they read it as it is written;
        # otherwise they are released after that step and start one step later
        assert r.first_token_step == (lead if sharing else lead + 1)
    assert h.s.stats.prefill_tokens == 21 + 2 * 1


def test_partial_prefix_waiters_start_in_the_step_that_writes_their_prefix() -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, budget=8, min_shared_blocks=1))
    h.add("L", prompt(21))
    h.add("P", [*prompt(8), 99, 98, 97])  # shares two blocks with L's first chunk
    assert h.s.state("P") is RequestState.WAITING
    plan = h.s.schedule(h.now)
    assert [(p.request_id, p.reads_from) for p in plan.prefills] == [("L", ())]  # no budget
    h.now += 1
    h.s.complete_step(h.b.run(plan), h.now)
    assert h.s.state("P") is RequestState.QUEUED  # released when L's chunk was planned
    h.drain()
    assert h.reports["P"].cached_tokens == 8


def test_a_failed_step_takes_its_blocks_back_out_of_the_cache() -> None:
    h = Host(*make(max_running=2))
    h.add("a", prompt(13), max_new=2)
    h.add("b", prompt(13), max_new=2)
    h.add("later", prompt(13), max_new=2)  # queued: not in the step that fails
    plan = h.s.schedule(h.now)
    assert [p.reads_from for p in plan.prefills] == [(), ("a",)]
    assert len(h.s.cache) == 3  # registered when planned
    h.b.run(plan)
    for page in h.b.written:  # the step "failed": what it wrote is garbage
        h.b.pages[page] = [None] * BS
    h.now += 1
    reports = h.s.fail_step(h.now)
    assert [(r.request_id, r.finish_reason) for r in reports] == [
        ("a", FinishReason.ABORTED),
        ("b", FinishReason.ABORTED),
    ]
    h.s.check_invariants()
    assert len(h.s.cache) == 0 and h.s.page_usage().free == h.s.config.num_pages
    assert h.s.requests() == {"later": RequestState.QUEUED}
    h.drain()  # "later" computes the prompt again: the fake backend checks every read
    assert h.reports["later"].cached_tokens == 0
    with pytest.raises(UsageError, match="no step is outstanding"):
        h.s.fail_step(h.now)


def test_a_failed_step_aborts_the_requests_aborting_with_it() -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, budget=4))
    h.add("L", prompt(10))
    h.add("F", prompt(10))
    plan = h.s.schedule(h.now)
    h.b.run(plan)
    h.s.abort("L", h.now)
    assert h.s.state("L") is RequestState.ABORTING
    assert h.s.state("F") is RequestState.QUEUED  # promoted: it leads now
    h.now += 1
    assert h.s.fail_step(h.now) == ()  # nothing of the plan was still running
    assert h.s.state("L") is None
    h.drain()
    assert h.reports["F"].role is Role.FOLLOWER and h.reports["F"].cached_tokens == 0


_BURST_BS = 4


@settings(max_examples=60, deadline=None)
@given(
    n_tokens=st.integers(_BURST_BS + 1, 60),
    followers=st.integers(1, 7),
    warm=st.booleans(),
    budget=st.integers(8, 80),
    max_running=st.integers(1, 8),
    policy=st.sampled_from(ReleasePolicy),
    arrivals=st.lists(st.integers(0, 6), min_size=8, max_size=8),
    max_new=st.integers(1, 6),
)
def test_a_burst_never_recomputes_the_shared_prompt(
    n_tokens: int,
    followers: int,
    warm: bool,
    budget: int,
    max_running: int,
    policy: ReleasePolicy,
    arrivals: list[int],
    max_new: int,
) -> None:
    """Identical prompts arriving together or spread over the steps, the prefix warm or
    cold, coordinated or not: with same-step sharing the prompt's full blocks are computed
    once, every other request reuses all of them, and the fake backend sees every read."""
    h = Host(*make(num_pages=512, budget=budget, max_running=max_running, flight=policy))
    # every request samples its own tokens: only their prompts have blocks in common
    h.b.sampler = lambda rid, pos: 2000 + 100 * len(str(rid)) + ord(str(rid)[-1]) + pos
    text = prompt(n_tokens, 7)
    if warm:
        h.add("warm", text, max_new=max_new)
        h.drain()
    ids = [f"r{i}" for i in range(followers + 1)]
    when = sorted(arrivals[: len(ids)])
    step = 0
    for rid, at in zip(ids, when, strict=True):
        while step < at and h.s.has_unfinished:
            h.step()
            step += 1
        h.add(rid, text, max_new=max_new)
    h.drain()
    reuse = (n_tokens - 1) // _BURST_BS * _BURST_BS
    cached = sorted(h.reports[r].cached_tokens for r in ids)
    computers = 0 if warm else 1
    assert cached == [0] * computers + [reuse] * (len(ids) - computers)
    total = (n_tokens - reuse) * (len(ids) - computers) + n_tokens * (computers + warm)
    st_ = h.s.stats
    assert st_.prefill_tokens == total
    # the last prompt token is always computed: when it ends a block, that one is computed
    # again by every request that reuses the rest (kept private, a duplicate)
    repeats = len(ids) - computers if n_tokens % _BURST_BS == 0 else 0
    assert st_.duplicate_blocks == repeats


# -- single flight --------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [ReleasePolicy.AFTER_PREFILL, ReleasePolicy.ON_COMPLETION])
def test_followers_wait_then_reuse_every_full_block(policy: ReleasePolicy) -> None:
    h = Host(*make(flight=policy, budget=8))
    n = 21
    assert h.add("L", prompt(n), max_new=4) is RequestState.QUEUED
    for f in ("F1", "F2"):
        assert h.add(f, prompt(n), max_new=4) is RequestState.WAITING
    h.drain()
    lead = h.reports["L"]
    assert lead.role is Role.LEADER and lead.cached_tokens == 0
    for f in ("F1", "F2"):
        r = h.reports[f]
        assert r.role is Role.FOLLOWER
        assert r.cached_tokens == (n - 1) // BS * BS
        assert r.flight_wait > 0
        assert r.admitted_at is not None and r.admitted_at >= r.arrived_at + r.flight_wait
        if policy is ReleasePolicy.ON_COMPLETION:
            assert r.admitted_at >= lead.finished_at
        else:
            assert lead.first_token_at is not None and r.admitted_at < lead.finished_at
    assert h.s.stats.prefill_tokens == n + 2 * (n - (n - 1) // BS * BS)


def test_on_completion_publication_still_serves_after_prefill_followers() -> None:
    """Releasing after prefill means publishing the prompt then, even in the baseline mode."""
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, publish=PublishMode.ON_COMPLETION))
    h.add("L", prompt(13), max_new=6)
    h.add("F", prompt(13), max_new=6)
    h.drain()
    assert h.reports["F"].cached_tokens == 12


def test_leader_abort_promotes_a_follower_that_computes_the_prompt() -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, budget=4))
    h.add("L", prompt(10))
    h.add("F1", prompt(10))
    h.add("F2", prompt(10))
    h.step()  # L computes its first chunk
    report = h.s.abort("L", h.now)
    assert report.finish_reason is FinishReason.ABORTED and report.role is Role.LEADER
    assert h.s.state("F1") is RequestState.QUEUED and h.s.state("F2") is RequestState.WAITING
    h.drain()
    assert h.reports["F1"].role is Role.LEADER
    assert h.reports["F2"].cached_tokens == 8
    assert h.s.coordinator.stats.promotions == 1


def test_max_wait_releases_a_follower_to_compute_alone() -> None:
    h = Host(*make(flight=ReleasePolicy.ON_COMPLETION, max_wait=2.0))
    h.add("L", prompt(9), max_new=10)
    h.add("F", prompt(9), max_new=2)
    h.drain()
    f = h.reports["F"]
    assert f.flight_wait > 2.0
    assert h.reports["L"].finished_at > f.arrived_at + f.flight_wait  # did not wait to the end
    assert h.s.coordinator.stats.timeouts == 1


# -- aborts -----------------------------------------------------------------------------------
def test_abort_during_a_step_frees_pages_when_the_step_completes() -> None:
    h = Host(*make())
    h.add("a", prompt(10), max_new=4)
    h.add("b", prompt(7, 50), max_new=4)
    plan = h.s.schedule(h.now)
    result = h.b.run(plan)
    private_before = h.s.page_usage().private
    r = h.s.abort("a", h.now)
    assert r.finish_reason is FinishReason.ABORTED and r.finished_step is None
    assert h.s.state("a") is RequestState.ABORTING  # until the step is over
    assert h.s.page_usage().private == private_before  # the backend is still writing them
    with pytest.raises(UsageError, match="aborting"):
        h.s.abort("a", h.now)
    with pytest.raises(UsageError, match="duplicate"):
        h.s.add_request("a", prompt(3), max_new_tokens=1, now=h.now)
    out = h.s.complete_step(result, h.now + 1)
    assert [rid for rid, _ in out.tokens] == ["b"]  # a's token is ignored
    h.s.check_invariants()
    assert h.s.page_usage().private < private_before
    assert h.s.state("a") is None
    with pytest.raises(UsageError, match="unknown"):
        h.s.abort("a", h.now + 1)


def test_abort_of_a_decoding_request_during_a_step() -> None:
    h = Host(*make())
    h.add("a", prompt(5), max_new=5)
    h.add("b", prompt(5, 50), max_new=5)
    h.step()  # both prefill; next step both decode
    plan = h.s.schedule(h.now)
    assert {d.request_id for d in plan.decodes} == {"a", "b"}
    result = h.b.run(plan)
    h.s.abort("b", h.now)
    out = h.s.complete_step(result, h.now + 1)
    assert [rid for rid, _ in out.tokens] == ["a"]
    h.s.check_invariants()
    cached = {h.s.cache.page(b) for b in h.s.cache.policy.resident()}
    # only a's pages that are not published yet are private: b's went back to the pool
    assert h.s.page_usage().private == sum(p not in cached for p in h.s.page_table("a"))


@pytest.mark.parametrize("where", ["queued", "waiting", "running"])
def test_abort_anywhere_leaves_no_trace(where: str) -> None:
    # budget 4: L's 9-token prompt takes three steps, so F still waits after the first
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, max_running=1, budget=4))
    h.add("L", prompt(9))
    h.add("F", prompt(9))
    h.add("Q", prompt(5, 50))
    h.step()
    rid = {"queued": "Q", "waiting": "F", "running": "L"}[where]
    assert h.s.state(rid) is RequestState[where.upper()]
    h.s.abort(rid, h.now)
    h.s.check_invariants()
    h.drain()
    assert rid not in h.reports
    usage = h.s.page_usage()
    assert usage.private == 0 and usage.pinned == 0


# -- pages --------------------------------------------------------------------------------------
def test_backpressure_waits_for_pages_and_changes_nothing() -> None:
    # each request needs ceil((8 + 4 - 1) / 4) = 3 pages; the pool has 5
    h = Host(*make(num_pages=5))
    h.add("a", prompt(8, 0), max_new=4)
    h.add("b", prompt(8, 100), max_new=4)
    h.step()
    assert h.s.requests() == {"a": RequestState.RUNNING, "b": RequestState.QUEUED}
    assert h.s.stats.admission_stalls == 1
    h.drain()
    assert h.reports["b"].admitted_at is not None
    assert h.reports["b"].admitted_at >= h.reports["a"].finished_at


def test_admission_evicts_unpinned_blocks_never_pinned_ones() -> None:
    h = Host(*make(num_pages=8))
    h.add("a", prompt(9, 0), max_new=4)  # 3 pages
    h.drain()  # a's 3 computed blocks are cached
    assert h.s.page_usage().cached == 3
    h.add("b", prompt(9, 0), max_new=8)  # reuses 2 cached blocks, pins them, needs 2 more
    h.add("c", prompt(12, 500), max_new=9)  # needs 5 pages: must evict, but not b's pins
    h.drain()
    assert h.reports["b"].cached_tokens == 8
    assert h.s.stats.evicted_blocks >= 1


def test_request_larger_than_the_pool_is_rejected() -> None:
    sched, _ = make(num_pages=2)
    with pytest.raises(UsageError, match="needs 3 pages"):
        sched.add_request("a", prompt(9), max_new_tokens=1, now=0.0)


def test_eviction_is_chain_aware() -> None:
    # budget 4 = one block per step: a's blocks are published in three different steps,
    # so LRU holds the parent as the oldest; evicting it takes its descendants along
    h = Host(*make(num_pages=6, budget=4))
    h.add("a", prompt(13, 0), max_new=1)  # 4 pages, 3 full blocks cached at the end
    h.drain()
    assert h.s.page_usage().cached == 3
    h.add("b", prompt(13, 100), max_new=1)  # 4 pages: 2 free, 2 must come from the cache
    h.drain()
    st = h.s.stats
    # LRU picks a's first block (published first, so least recent); its two descendants
    # become unreachable and go with it: one eviction frees three pages
    assert (st.evicted_blocks, st.orphans_evicted) == (1, 2)
    # no cached block is unreachable
    resident = h.s.cache.policy.resident()
    blocks = BlockHasher(BS).hash_tokens(prompt(13, 0))
    reachable = blocks[: h.s.cache.lookup(blocks)]
    assert resident & set(blocks) == set(reachable)


def test_s3fifo_cache_with_a_small_capacity_keeps_pages_consistent() -> None:
    h = Host(*make(num_pages=12, eviction=S3FIFO(3)))
    for i in range(6):
        h.add(i, prompt(9 + i, 7 * (i % 2)), max_new=3)
        h.step()
    h.drain()
    usage = h.s.page_usage()
    assert usage.cached <= 3 and usage.private == 0 and usage.pinned == 0
    assert usage.free + usage.cached == 12


# -- rejected calls leave the state unchanged ---------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.add_request("a", [1, 2], max_new_tokens=1, now=1.0),  # duplicate
        lambda s: s.add_request("z", [], max_new_tokens=1, now=1.0),
        lambda s: s.add_request("z", [1, -2], max_new_tokens=1, now=1.0),
        lambda s: s.add_request("z", [1, True], max_new_tokens=1, now=1.0),
        lambda s: s.add_request("z", [1], max_new_tokens=0, now=1.0),
        lambda s: s.add_request("z", [1], max_new_tokens=1, now=1.0, stop_token_ids=["x"]),
        lambda s: s.add_request("z", [1], max_new_tokens=1, now=0.5),  # time went backwards
        lambda s: s.add_request(1.5, [1], max_new_tokens=1, now=1.0),
        lambda s: s.abort("nobody", 1.0),
        lambda s: s.schedule(0.0),
        lambda s: s.complete_step(StepResult(step=0), 1.0),  # nothing outstanding
        lambda s: s.page_table("nobody"),
    ],
)
def test_rejected_calls_leave_the_state_unchanged(call: object) -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL))
    h.add("a", prompt(6))
    h.add("b", prompt(6))
    h.step()
    before = snapshot(h.s)
    with pytest.raises(UsageError):
        call(h.s)  # type: ignore[operator]
    assert snapshot(h.s) == before
    h.s.check_invariants()


@pytest.mark.parametrize("kind", ["wrong_step", "missing", "extra"])
def test_rejected_results_leave_the_state_unchanged(kind: str) -> None:
    h = Host(*make())
    h.add("a", prompt(6))
    h.add("b", prompt(6, 50))
    plan = h.s.schedule(0.0)
    good = h.b.run(plan)
    bad = {
        "wrong_step": StepResult(step=plan.step + 1, sampled=good.sampled),
        "missing": StepResult(step=plan.step, sampled=good.sampled[1:]),
        "extra": StepResult(step=plan.step, sampled=(*good.sampled, ("c", 1))),
    }[kind]
    before = snapshot(h.s)
    with pytest.raises(UsageError):
        h.s.complete_step(bad, 1.0)
    assert snapshot(h.s) == before
    with pytest.raises(UsageError, match="outstanding"):
        h.s.schedule(1.0)
    h.s.complete_step(good, 1.0)
    h.s.check_invariants()


@pytest.mark.parametrize(
    ("sampled", "match"),
    [
        ((("a", 1), ("a", 2)), "'a' sampled twice"),
        ((("a", -1),), r"request 'a'.*-1"),
        ((("a", True),), r"request 'a'.*True"),
        ((("a", 1), ("b",)), r"\('b',\)"),
        (((True, 1),), "sampled entries"),
        ([("a", 1)], "tuple"),
    ],
)
def test_a_step_result_checks_its_entries_when_made(sampled: object, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        StepResult(step=0, sampled=sampled)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="step"):
        StepResult(step=-1)


def test_a_coordinator_that_already_knows_requests_is_rejected() -> None:
    from prefixflight.core import FlightKey
    from prefixflight.core.flight import Arrived

    coord = FlightCoordinator(FlightConfig(block_size=2))
    coord.handle(Arrived(request_id="elsewhere", key=FlightKey.of([1, 2, 3]), now=0.0))
    with pytest.raises(ConfigError, match="'elsewhere'"):
        Scheduler(SchedulerConfig(num_pages=8, block_size=2), coordinator=coord)


@pytest.mark.parametrize("namespace", [5, None, ["a"]])
def test_a_namespace_must_be_text_or_bytes(namespace: object) -> None:
    sched = Scheduler(SchedulerConfig(num_pages=8, block_size=2))
    with pytest.raises(UsageError, match=repr(namespace).replace("[", r"\[")):
        sched.add_request("r", [1, 2, 3], max_new_tokens=1, now=0.0, namespace=namespace)  # type: ignore[arg-type]
    assert sched.requests() == {}


@pytest.mark.parametrize("bad", [(1,), ([1], 0), "r0"])
def test_a_malformed_sampled_entry_is_rejected_without_change(bad: object) -> None:
    sched = Scheduler(SchedulerConfig(num_pages=8, block_size=2))
    sched.add_request("r", [1, 2, 3], max_new_tokens=2, now=0.0)
    plan = sched.schedule(0.0)
    with pytest.raises(UsageError, match="sampled entries"):
        sched.complete_step(StepResult(step=plan.step, sampled=(bad,)), now=1.0)  # type: ignore[arg-type]
    assert sched.outstanding == plan
    outcome = sched.complete_step(StepResult(step=plan.step, sampled=(("r", 7),)), now=1.0)
    assert outcome.tokens == (("r", 7),)


# -- inputs found by outside probing -------------------------------------------------------
_INF = float("inf")


@pytest.mark.parametrize("now", [_INF, -_INF], ids=["inf", "minus-inf"])
@pytest.mark.parametrize("where", ["add_request", "schedule", "abort", "complete_step"])
def test_times_must_be_finite(where: str, now: float) -> None:
    """Infinity used to be accepted as ``now``; every later call then failed ("time went
    backwards") or statistics became NaN. A time is a finite number, checked before any
    change."""
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL))
    h.add("a", prompt(6))
    h.add("b", prompt(6))
    h.step()
    plan = h.s.schedule(h.now) if where == "complete_step" else None
    result = None if plan is None else h.b.run(plan)
    before = snapshot(h.s)
    with pytest.raises(UsageError, match="finite"):
        match where:
            case "add_request":
                h.s.add_request("z", [1, 2, 3], max_new_tokens=1, now=now)
            case "schedule":
                h.s.schedule(now)
            case "abort":
                h.s.abort("a", now)
            case _:
                assert result is not None
                h.s.complete_step(result, now)
    assert snapshot(h.s) == before
    if result is not None:
        h.reports.update((r.request_id, r) for r in h.s.complete_step(result, h.now).finished)
    h.s.check_invariants()
    h.drain()  # the scheduler keeps working with finite times
    assert set(h.reports) == {"a", "b"}


_VOCAB = 2000


@pytest.mark.parametrize(
    ("token", "vocab"),
    [(2**63, None), (2**64 + 5, None), (-1, None), (1.0, None), ("7", None), (_VOCAB, _VOCAB)],
    ids=["2**63", "2**64+5", "negative", "float", "str", "outside-vocabulary"],
)
def test_sampled_token_ids_are_checked_before_any_change(token: object, vocab: int | None) -> None:
    """A sampled id >= 2**63 used to be appended, the step half applied, and the next step
    failed: the request never finished. The whole result is checked first; where the
    scheduler knows the vocabulary, ids outside it are rejected too."""
    config = SchedulerConfig(num_pages=32, block_size=BS, max_batch_tokens=64)
    if vocab is not None:  # (a config without vocab_size: the regression runs on old code)
        config = attrs.evolve(config, vocab_size=vocab)
    sched = Scheduler(config)
    backend = FakeBackend(32, BS, lambda rid, pos: 1000 + pos)
    h = Host(sched, backend)
    h.add("a", prompt(5), max_new=4)
    h.add("b", prompt(7, 100), max_new=4)
    h.step()  # both prefilled: the next step decodes both
    plan = h.s.schedule(h.now)
    good = h.b.run(plan)
    assert len(good.sampled) == 2
    sampled = (good.sampled[0], (good.sampled[1][0], token))
    before = snapshot(h.s)
    report_before = h.s.page_table("a"), h.s.page_table("b")
    with pytest.raises(UsageError, match=repr(token).replace("(", r"\(")):
        # a token id outside the vocabulary only the scheduler knows is rejected there;
        # any other bad id already when the result is made
        h.s.complete_step(StepResult(step=plan.step, sampled=sampled), h.now + 1.0)  # type: ignore[arg-type]
    assert snapshot(h.s) == before
    assert (h.s.page_table("a"), h.s.page_table("b")) == report_before
    h.now += 1.0
    h.s.complete_step(good, h.now)  # the good result still applies, exactly once
    h.s.check_invariants()
    h.drain()
    for rid in ("a", "b"):
        out = h.reports[rid].output_token_ids
        assert len(out) == 4 and all(0 <= t < _VOCAB for t in out)


def test_prompt_and_stop_ids_outside_the_vocabulary_are_rejected() -> None:
    sched = Scheduler(SchedulerConfig(num_pages=8, block_size=2, vocab_size=10))
    for prompt_ids, stop in (([1, 10], ()), ([1, 2**63], ()), ([1, 2], (10,))):
        with pytest.raises(UsageError, match="vocabulary"):
            sched.add_request("r", prompt_ids, max_new_tokens=1, now=0.0, stop_token_ids=stop)
        assert sched.requests() == {} and sched.page_usage().free == 8
    sched.add_request("r", [1, 9], max_new_tokens=1, now=0.0, stop_token_ids=(9,))


# -- roles and statistics -----------------------------------------------------------------
def test_a_leader_nobody_followed_reports_itself_independent() -> None:
    """`Lead` is the coordinator's decision at arrival; the report says what happened."""
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL))
    h.add("alone", prompt(9))
    h.drain()
    assert h.reports["alone"].role is Role.INDEPENDENT
    assert h.s.coordinator.stats.flights_opened == 1  # it did lead a flight
    h.add("L", prompt(9, 50))
    h.add("F", prompt(9, 50))
    h.drain()
    assert (h.reports["L"].role, h.reports["F"].role) == (Role.LEADER, Role.FOLLOWER)


def test_a_leader_whose_follower_left_still_reports_leader() -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, budget=4))
    h.add("L", prompt(10))
    h.add("F", prompt(10))
    assert h.s.abort("F", h.now).role is Role.FOLLOWER
    h.drain()
    assert h.reports["L"].role is Role.LEADER  # someone waited for its prompt


def test_a_promoted_follower_nobody_waits_for_reports_follower() -> None:
    h = Host(*make(flight=ReleasePolicy.AFTER_PREFILL, budget=4))
    h.add("L", prompt(10))
    h.add("F", prompt(10))
    h.step()
    assert h.s.abort("L", h.now).role is Role.LEADER
    h.drain()
    assert h.reports["F"].role is Role.FOLLOWER  # it waited; then nobody waited for it
    assert h.s.coordinator.stats.promotions == 1


def test_stats_count_the_engines_prefix_cache_queries_and_hits() -> None:
    """`PrefixCache.stats` counts replayed requests; the engine's lookups are here."""
    h = Host(*make())
    h.add("a", prompt(10))
    h.drain()
    h.add("b", prompt(10))  # reuses (10 - 1) // 4 = 2 blocks
    h.add("c", prompt(6, 500))  # nothing cached
    h.drain()
    st = h.s.stats
    assert (st.prefix_queries, st.prefix_query_tokens) == (3, 26)
    assert st.prefix_hit_tokens == st.cached_tokens == 8
    assert st.prefix_hit_rate == pytest.approx(8 / 26)
    assert h.s.cache.stats.requests == 0  # the replay counters saw no replayed request
    d = st.to_dict()
    assert d["prefix_query_tokens"] == 26 and set(d) == {f.name for f in attrs.fields(type(st))}


def test_stats_add_up_the_scheduler_and_page_pool_counters() -> None:
    """Every `SchedulerStats` field is counted by exactly one of the two counters."""
    from prefixflight.core.flight._pages import PageCounters
    from prefixflight.core.flight._scheduler import _Counters

    ours = {f.name for f in attrs.fields(_Counters)}
    pool = {f.name for f in attrs.fields(PageCounters)}
    assert not ours & pool
    assert ours | pool == {f.name for f in attrs.fields(type(make()[0].stats))}
