"""The scheduler conformance machine: our Scheduler passes under its declaration; broken
schedulers and wrong declarations are caught; a hand-replayed sequence reaches the checks;
declarations reject what is not modelled. (vLLM's Scheduler runs in tests/peers.)"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import Scheduler, StepOutcome, StepPlan, StepResult, UsageError
from prefixflight.specs import (
    SchedulerConformance,
    SchedulerLimits,
    SchedulerSemantics,
    declared_differences,
    sampled_token,
)
from prefixflight.specs.adapters import PrefixflightSchedulerAdapter

TestPrefixflightScheduler = SchedulerConformance.TestCase  # as it stands: ours

_CATCH = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    database=None,
    derandomize=True,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    suppress_health_check=list(HealthCheck),
)


def _caught(machine: type[Any]) -> str:
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(machine, settings=_CATCH)
    return str(caught.value)


class _UndeclaredSharing(Scheduler):  # type: ignore[misc]  # Scheduler is final: a mutant
    """Shares pages written in the same step without saying so (``reads_from`` dropped)."""

    def schedule(self, now: float) -> StepPlan:
        plan = super().schedule(now)
        prefills = tuple(attrs.evolve(p, reads_from=()) for p in plan.prefills)
        return attrs.evolve(plan, prefills=prefills)


class _SilentFinish(Scheduler):  # type: ignore[misc]
    """Ends requests without reporting them."""

    def complete_step(self, result: StepResult, now: float) -> StepOutcome:
        return attrs.evolve(super().complete_step(result, now), finished=())


class _EarlyDecode(Scheduler):  # type: ignore[misc]
    """Tells the backend a decode's position one too far: it attends past what was
    computed."""

    def schedule(self, now: float) -> StepPlan:
        plan = super().schedule(now)
        decodes = tuple(attrs.evolve(d, position=d.position + 1) for d in plan.decodes)
        return attrs.evolve(plan, decodes=decodes)


def _fork(cls: type[Scheduler]) -> type[SchedulerConformance]:
    return SchedulerConformance.for_adapter(
        functools.partial(PrefixflightSchedulerAdapter, scheduler_cls=cls)
    )


@pytest.mark.parametrize(
    ("cls", "says"),
    [
        (_UndeclaredSharing, "whose reads_from is []"),
        (_SilentFinish, "the scheduler says go on"),
        (_EarlyDecode, "computes"),
    ],
)
def test_broken_schedulers_are_caught(cls: type[Scheduler], says: str) -> None:
    assert says in _caught(_fork(cls))


def test_a_wrong_declaration_is_caught() -> None:
    """Declared never to read a page written in its own step, our scheduler (which shares
    same-step pages) fails with the step that does."""
    strict = SchedulerSemantics(same_step_reads="none")
    machine = SchedulerConformance.for_adapter(PrefixflightSchedulerAdapter, semantics=strict)
    assert "in this same step (its reads_from), but same_step_reads='none'" in _caught(machine)


def test_a_hand_replayed_sequence_reaches_the_checks() -> None:
    """The rules' helpers replay a sequence without Hypothesis: two identical prompts admitted
    in one step share the leader's pages as they are written, and both finish."""
    machine = SchedulerConformance()
    machine._begin(SchedulerLimits(block_size=4, pages=6, max_running=2, max_batch_tokens=16))
    prompt = list(range(1000, 1010))
    machine._add(prompt, 2, False, 0)
    machine._add(prompt, 2, False, 0)
    machine._schedule()
    assert machine.rows is not None
    (lead, follow) = machine.rows
    assert follow.reads_from == (lead.request_id,) and follow.start == 8
    assert follow.pages[:2] == lead.pages[:2]  # the follower reads the pages being written
    machine._complete()
    machine.check_pages()
    machine.drain(0)
    assert machine.ended == {"r0": "finished (length)", "r1": "finished (length)"}


def test_the_runner_samples_a_function_of_the_sequence() -> None:
    assert sampled_token([5, 9, 1]) == sampled_token([7, 2, 1]) == (1 + 3) % 4


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"same_step_reads": "sometimes"}, "same_step_reads must be one of"),
        ({"preemption": "swap"}, "preemption must be one of"),
        ({"policies": {"lifo"}}, "unknown operations ['lifo']"),
        ({"policies": set()}, "at least one of"),
    ],
)
def test_declarations_reject_what_is_not_modelled(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(UsageError, match=None) as caught:
        SchedulerSemantics(**kwargs)
    assert says in str(caught.value)


def test_declared_differences_list_departures_not_capabilities() -> None:
    vllm_like = SchedulerSemantics(
        same_step_reads="any", preemption="recompute", policies={"fcfs", "priority"}
    )
    assert [d["name"] for d in declared_differences(vllm_like)] == [
        "same_step_reads",
        "preemption",
    ]
    assert declared_differences(PrefixflightSchedulerAdapter.semantics) == []


def test_for_adapter_takes_partials_and_their_declaration() -> None:
    fork = functools.partial(PrefixflightSchedulerAdapter, scheduler_cls=Scheduler)
    machine = SchedulerConformance.for_adapter(fork)
    assert machine.semantics == PrefixflightSchedulerAdapter.semantics
    assert machine.__name__ == "SchedulerConformance_PrefixflightSchedulerAdapter"
    with pytest.raises(UsageError, match="SchedulerSemantics, got 'any'"):
        SchedulerConformance.for_adapter(fork, semantics="any")  # type: ignore[arg-type]


def test_ours_does_not_take_a_policy_it_lacks() -> None:
    from prefixflight.specs import Unsupported

    limits = SchedulerLimits(
        block_size=4, pages=4, max_running=1, max_batch_tokens=4, policy="priority"
    )
    with pytest.raises(Unsupported, match="priority"):
        PrefixflightSchedulerAdapter(limits)
