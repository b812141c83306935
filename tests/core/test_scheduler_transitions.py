"""h2-style total transition test of the scheduler: every (request state x call) pair.

For each state a request can be in (reached in several ways, with and without a step
outstanding) and each call, build that state, make the call, and check that it is accepted
exactly when `Scheduler.TRANSITIONS` and `Scheduler.STEP_TRANSITIONS` list it, that the named
request lands where the table says, that every other request moves only as the table allows
(a step call moves every request along its row; add_request and abort move no one else, but
for a waiting follower that its coordinator releases or promotes), and that a rejected call
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from prefixflight.core import (
    FlightConfig,
    FlightCoordinator,
    ReleasePolicy,
    RequestId,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    UsageError,
)
from prefixflight.core.flight import RequestState, SchedulerCall, StepPhase
from prefixflight.specs import FakeBackend

BS = 2
PROMPT = tuple(range(1, 10))  # 9 tokens: 4 full blocks of 2


@attrs.define
class Built:
    sched: Scheduler
    backend: FakeBackend
    rid: RequestId
    result: StepResult | None = None  # the outstanding plan's result, once run


def _host(
    policy: ReleasePolicy = ReleasePolicy.AFTER_PREFILL,
    *,
    budget: int = 4,
    max_running: int = 2,
    sharing: bool = True,
) -> tuple[Scheduler, FakeBackend]:
    config = SchedulerConfig(
        num_pages=32,
        block_size=BS,
        max_batch_tokens=budget,
        max_running=max_running,
        same_step_sharing=sharing,
    )
    coordinator = FlightCoordinator(FlightConfig(policy=policy, block_size=BS, max_wait=50.0))
    return (
        Scheduler(config, coordinator=coordinator),
        FakeBackend(32, BS, lambda rid, pos: 20 + pos % 3),
    )


def _add(s: Scheduler, b: FakeBackend, rid: RequestId, prompt: tuple[int, ...] = PROMPT) -> None:
    b.sequences[rid] = list(prompt)
    s.add_request(rid, prompt, max_new_tokens=3, now=s.now if s.now > 0 else 0.0)


def _step(s: Scheduler, b: FakeBackend, now: float) -> None:
    plan = s.schedule(now)
    if not plan.is_empty:
        s.complete_step(b.run(plan), now)


def _outstanding(s: Scheduler, b: FakeBackend, now: float) -> StepResult:
    plan = s.schedule(now)
    assert not plan.is_empty
    return b.run(plan)


Build = Callable[[bool], Built]


def never_seen(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)
    _add(s, b, "a")
    return Built(s, b, "x")


def ended(sharing: bool) -> Built:
    s, b = _host(sharing=sharing, budget=16)
    _add(s, b, "a", (1, 2, 3))
    _add(s, b, "keep", (7, 7, 7, 7, 7))
    for t in range(1, 4):
        _step(s, b, float(t))
    assert s.state("a") is None
    return Built(s, b, "a")


def unknown_while_outstanding(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)
    _add(s, b, "a")
    return Built(s, b, "x", _outstanding(s, b, 1.0))


def waiting(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)
    _add(s, b, "lead")
    _add(s, b, "f")
    return Built(s, b, "f")


def waiting_while_outstanding(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)  # budget 4: the leader's first chunk does not end it
    _add(s, b, "lead")
    _add(s, b, "f")
    return Built(s, b, "f", _outstanding(s, b, 1.0))


def waiting_for_a_leader_that_finishes(sharing: bool) -> Built:
    s, b = _host(ReleasePolicy.ON_COMPLETION, sharing=sharing, budget=16)
    _add(s, b, "lead", (1, 2, 3))
    _add(s, b, "f", (1, 2, 3))
    _step(s, b, 1.0)  # the leader's prefill
    _step(s, b, 2.0)  # one decode
    return Built(s, b, "f", _outstanding(s, b, 3.0))  # its last decode: then it finishes


def queued(sharing: bool) -> Built:
    s, b = _host(sharing=sharing, max_running=1)
    _add(s, b, "a", (1, 2, 3))
    _add(s, b, "q", (5, 5, 5))
    _step(s, b, 1.0)
    return Built(s, b, "q")


def queued_while_outstanding(sharing: bool) -> Built:
    s, b = _host(sharing=sharing, max_running=1)
    _add(s, b, "a", (1, 2, 3))
    _add(s, b, "q", (5, 5, 5))
    return Built(s, b, "q", _outstanding(s, b, 1.0))


def running(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)
    _add(s, b, "a")
    _step(s, b, 1.0)
    return Built(s, b, "a")


def running_in_the_step(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)
    _add(s, b, "a")
    _add(s, b, "f")
    return Built(s, b, "a", _outstanding(s, b, 1.0))


def running_a_last_decode(sharing: bool) -> Built:
    s, b = _host(sharing=sharing, budget=16)
    _add(s, b, "a", (1, 2, 3))
    _step(s, b, 1.0)
    _step(s, b, 2.0)
    return Built(s, b, "a", _outstanding(s, b, 3.0))  # it finishes with this step


def running_reader_of_the_step(sharing: bool) -> Built:
    """Admitted in the step that writes its prefix (same-step sharing)."""
    s, b = _host(ReleasePolicy.INDEPENDENT, sharing=sharing, budget=16)
    _add(s, b, "w")
    _add(s, b, "r")
    return Built(s, b, "r", _outstanding(s, b, 1.0))


def aborting(sharing: bool) -> Built:
    s, b = _host(sharing=sharing)
    _add(s, b, "a")
    _add(s, b, "f")
    result = _outstanding(s, b, 1.0)
    s.abort("a", 1.0)
    return Built(s, b, "a", result)


BUILDS: dict[str, tuple[Build, RequestState | None, StepPhase]] = {
    "never_seen": (never_seen, None, StepPhase.IDLE),
    "ended": (ended, None, StepPhase.IDLE),
    "unknown_while_outstanding": (unknown_while_outstanding, None, StepPhase.OUTSTANDING),
    "waiting": (waiting, RequestState.WAITING, StepPhase.IDLE),
    "waiting_while_outstanding": (
        waiting_while_outstanding,
        RequestState.WAITING,
        StepPhase.OUTSTANDING,
    ),
    "waiting_for_a_leader_that_finishes": (
        waiting_for_a_leader_that_finishes,
        RequestState.WAITING,
        StepPhase.OUTSTANDING,
    ),
    "queued": (queued, RequestState.QUEUED, StepPhase.IDLE),
    "queued_while_outstanding": (
        queued_while_outstanding,
        RequestState.QUEUED,
        StepPhase.OUTSTANDING,
    ),
    "running": (running, RequestState.RUNNING, StepPhase.IDLE),
    "running_in_the_step": (running_in_the_step, RequestState.RUNNING, StepPhase.OUTSTANDING),
    "running_a_last_decode": (running_a_last_decode, RequestState.RUNNING, StepPhase.OUTSTANDING),
    "running_reader_of_the_step": (
        running_reader_of_the_step,
        RequestState.RUNNING,
        StepPhase.OUTSTANDING,
    ),
    "aborting": (aborting, RequestState.ABORTING, StepPhase.OUTSTANDING),
}


def _call(built: Built, call: SchedulerCall) -> object:
    s = built.sched
    now = s.now + 1.0
    match call:
        case SchedulerCall.ADD_REQUEST:
            return s.add_request(built.rid, (9, 9, 9), max_new_tokens=1, now=now)
        case SchedulerCall.ABORT:
            return s.abort(built.rid, now)
        case SchedulerCall.SCHEDULE:
            return s.schedule(now)
        case SchedulerCall.COMPLETE_STEP:
            return s.complete_step(built.result or StepResult(step=0), now)
        case SchedulerCall.FAIL_STEP:
            return s.fail_step(now)


def _snapshot(s: Scheduler) -> object:
    return (
        s.requests(),
        s.page_usage(),
        s.stats,
        s.outstanding,
        s.now,
        s.coordinator.placements(),
        s.phase,
    )


def test_the_tables_cover_every_state_and_phase() -> None:
    table, steps = Scheduler.TRANSITIONS, Scheduler.STEP_TRANSITIONS
    assert set(table) == {None, *RequestState}
    assert set(steps) == set(StepPhase)
    assert {state for _, state, _ in BUILDS.values()} == set(table)
    assert {phase for _, _, phase in BUILDS.values()} == set(StepPhase)
    for row in table.values():
        assert all(targets for targets in row.values()), "no empty targets"
    # a request aborted during a step exists only while that step is outstanding
    assert set(table[RequestState.ABORTING]) <= set(steps[StepPhase.OUTSTANDING])


@pytest.mark.parametrize("sharing", [True, False], ids=["same_step_sharing", "after_step"])
@pytest.mark.parametrize("call", list(SchedulerCall), ids=lambda c: c.value)
@pytest.mark.parametrize("state", list(BUILDS))
def test_every_state_call_pair(state: str, call: SchedulerCall, sharing: bool) -> None:
    build, expected, phase = BUILDS[state]
    built = build(sharing)
    s = built.sched
    s.check_invariants()
    assert s.state(built.rid) is expected, "the builder reaches the state it names"
    assert s.phase is phase
    names_request = call in (SchedulerCall.ADD_REQUEST, SchedulerCall.ABORT)
    row = Scheduler.TRANSITIONS[expected]
    legal = call in Scheduler.STEP_TRANSITIONS[phase] and (not names_request or call in row)
    before = _snapshot(s)
    states = s.requests()
    if not legal:
        with pytest.raises(UsageError):
            _call(built, call)
        assert _snapshot(s) == before, "a rejected call changed the state"
        return
    _call(built, call)
    s.check_invariants()
    assert s.phase in Scheduler.STEP_TRANSITIONS[phase][call]
    assert s.state(built.rid) in row[call]
    after = s.requests()
    for rid, old in states.items():
        new = after.get(rid)
        if rid == built.rid:
            continue
        if names_request:  # bystanders stay, but for a follower its coordinator lets go
            assert new is old or (old, new) == (RequestState.WAITING, RequestState.QUEUED)
        else:
            assert new in Scheduler.TRANSITIONS[old][call], f"{rid!r}: {old} -> {new}"


def test_a_failed_step_is_a_step_too() -> None:
    """After `fail_step` the next plan is handed out as usual: scheduling goes on."""
    s, b = _host(ReleasePolicy.INDEPENDENT, budget=16)
    _add(s, b, "w")
    _add(s, b, "r")
    plan: StepPlan = s.schedule(1.0)
    assert [p.reads_from for p in plan.prefills] == [(), ("w",)]
    assert [r.request_id for r in s.fail_step(2.0)] == ["w", "r"]
    assert s.phase is StepPhase.IDLE and not s.has_unfinished
    _add(s, b, "again")
    assert s.schedule(3.0).step == plan.step + 1
