"""The coordinator against its reference model, and the machine against broken coordinators."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import FlightConfig, FlightCoordinator, ReleasePolicy
from prefixflight.core.flight import (
    Arrived,
    FlightDecision,
    FlightEvent,
    PrefillDone,
    Release,
    ReleaseReason,
)
from prefixflight.specs import FlightCoordinatorMachine

_BOUNDED = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,
)
# finding the bug is what matters, not shrinking it
MUTANT_SETTINGS = settings(
    _BOUNDED, derandomize=True, phases=(Phase.explicit, Phase.reuse, Phase.generate)
)


TestFlightCoordinator = FlightCoordinatorMachine.TestCase  # the profile's examples (ci, dev, soak)
# A failing soak must report within a minute. Hypothesis's explain phase ran for minutes on a
# 200-step failure of this machine (its model is slow by design), so it is off, and a run
# has at most 100 steps; the shrunk report of a planted defect then takes about 10 s.
TestFlightCoordinator.settings = settings(
    TestFlightCoordinator.settings,
    phases=tuple(p for p in TestFlightCoordinator.settings.phases if p is not Phase.explain),
    stateful_step_count=min(TestFlightCoordinator.settings.stateful_step_count, 100),
)


def test_a_failing_soak_reports_quickly() -> None:
    bound = TestFlightCoordinator.settings
    assert Phase.explain not in bound.phases and bound.stateful_step_count <= 100


class _ReleasesEarly:
    """A coordinator that treats ON_COMPLETION like AFTER_PREFILL: the machine must notice."""

    def __init__(self, config: FlightConfig) -> None:
        if config.policy is ReleasePolicy.ON_COMPLETION:
            config = FlightConfig(
                policy=ReleasePolicy.AFTER_PREFILL,
                max_wait=config.max_wait,
                min_shared_blocks=config.min_shared_blocks,
                block_size=config.block_size,
            )
        self._inner = FlightCoordinator(config)

    def handle(self, event: FlightEvent) -> tuple[FlightDecision, ...]:
        return self._inner.handle(event)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class _ForgetsReleased:
    """A coordinator that forgets released ids (the first bug of the single-flight prefill
    study of mini-vllm-rs): must be caught."""

    def __init__(self, config: FlightConfig) -> None:
        self._inner = FlightCoordinator(config)

    def handle(self, event: FlightEvent) -> tuple[FlightDecision, ...]:
        out = self._inner.handle(event)
        if isinstance(event, PrefillDone):
            self._inner._released.clear()  # the bug
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class _DeadlineByFlight(FlightCoordinator):  # type: ignore[misc]  # a mutant, on purpose
    """Issue 9's defect 1 put back: a deadline is matched by request id and flight only, so a
    follower that leaves and re-arrives in the same open flight inherits its old deadline."""

    __slots__ = ("_flight_of_arrival",)

    def __init__(self, config: FlightConfig) -> None:
        super().__init__(config)
        self._flight_of_arrival: dict[int, int] = {}

    def _arrive(self, ev: Arrived, now: float, out: list[FlightDecision]) -> None:
        n = len(self._deadlines)
        super()._arrive(ev, now, out)
        if len(self._deadlines) > n:
            _, rid, member = self._deadlines[-1]
            self._flight_of_arrival[id(member)] = self._waiting[rid].id

    def _expire(self, now: float, out: list[FlightDecision]) -> None:
        dl = self._deadlines
        while dl and dl[0][0] < now:
            _, rid, member = dl.popleft()
            fid = self._flight_of_arrival.pop(id(member))
            flight = self._waiting.get(rid)
            if flight is None or flight.id != fid:
                continue
            current = flight.followers.pop(rid, None) or flight.partial.pop(rid)
            del self._waiting[rid]
            self._released[rid] = None
            self._note_wait(current.arrived, now)
            self._stats.timeouts += 1
            out.append(Release(flight=fid, request_ids=(rid,), reason=ReleaseReason.TIMEOUT))

    def check_invariants(self) -> None:
        pass  # the mutant's deadline queue is stale on purpose


@pytest.mark.parametrize("broken", [_ReleasesEarly, _ForgetsReleased, _DeadlineByFlight])
def test_machine_catches_broken_coordinators(broken: type) -> None:
    """Each mutant is caught on CI's derandomized examples: deterministically, not by luck."""
    machine = FlightCoordinatorMachine.for_factory(broken)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=MUTANT_SETTINGS)
