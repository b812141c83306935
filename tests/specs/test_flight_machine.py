"""The coordinator against its reference model, and the machine against broken coordinators."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import (
    FlightConfig,
    FlightCoordinator,
    FlightDecision,
    FlightEvent,
    PrefillDone,
    ReleasePolicy,
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
MUTANT_SETTINGS = settings(_BOUNDED, phases=(Phase.explicit, Phase.reuse, Phase.generate))


TestFlightCoordinator = (
    FlightCoordinatorMachine.TestCase
)  # the profile's examples and steps (ci, dev, soak)


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
    """A coordinator that forgets released ids (seed 000's first bug): must be caught."""

    def __init__(self, config: FlightConfig) -> None:
        self._inner = FlightCoordinator(config)

    def handle(self, event: FlightEvent) -> tuple[FlightDecision, ...]:
        out = self._inner.handle(event)
        if isinstance(event, PrefillDone):
            self._inner._released.clear()  # the bug
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.mark.parametrize("broken", [_ReleasesEarly, _ForgetsReleased])
def test_machine_catches_broken_coordinators(broken: type) -> None:
    machine = FlightCoordinatorMachine.for_factory(broken)
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(machine, settings=MUTANT_SETTINGS)
