"""Scheduler + cache + coordinator on the fake backend, and the machine against broken ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import FlightCoordinator, PrefixCache, Scheduler, SchedulerConfig
from prefixflight.specs import SchedulerMachine

_BOUNDED = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,
)
# finding the bug is what matters, not shrinking it
MUTANT_SETTINGS = settings(
    _BOUNDED,
    phases=(Phase.explicit, Phase.generate),
    database=None,
    derandomize=True,  # caught deterministically, under the same examples on every run
)


TestScheduler = SchedulerMachine.TestCase  # the profile's examples and steps (ci, dev, soak)


class _LeaksPages(Scheduler):  # type: ignore[misc]
    """Forgets to free the private pages of ended requests."""

    def _end(self, req: Any) -> None:
        self._pool.release(req.pinned, ())
        req.pinned = []
        req.private = set()


class _PublishesEarly(Scheduler):  # type: ignore[misc]
    """Publishes a block one step before all its tokens are computed.

    It overrides the scheduler's publication entry point once per request and step. (When
    the retry after a refused block re-entered this method, the mutant added its ``+ 1``
    again on every retry and never terminated: a RecursionError, not a caught bug.)
    """

    def _publish(self, req: Any, upto: int) -> list[int]:
        bs = self.config.block_size
        limit = min(len(req.pages), (len(req.prompt) + len(req.output)) // bs)
        return super()._publish(req, min(upto + 1, limit))


class _HidesSameStepReads(Scheduler):  # type: ignore[misc]
    """Shares blocks in the step that writes them but does not say so in the plan."""

    def _plan_chunk(self, req: Any, draft: Any, now: float, reads: Any = ()) -> None:
        super()._plan_chunk(req, draft, now, ())


class _KeepsFailedBlocks(Scheduler):  # type: ignore[misc]
    """Leaves the blocks a failed step registered in the cache (their KV was never written)."""

    def _close_step(self, *, failed: bool = False) -> None:
        super()._close_step(failed=False)


def _factory(cls: type[Scheduler]) -> Callable[..., Scheduler]:
    def make(config: SchedulerConfig, cache: PrefixCache, coord: FlightCoordinator) -> Scheduler:
        return cls(config, cache=cache, coordinator=coord)

    make.__name__ = cls.__name__.strip("_")
    return make


@pytest.mark.parametrize(
    "broken", [_LeaksPages, _PublishesEarly, _HidesSameStepReads, _KeepsFailedBlocks]
)
def test_machine_catches_broken_schedulers(broken: type[Scheduler]) -> None:
    machine = SchedulerMachine.for_factory(_factory(broken))
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(machine, settings=MUTANT_SETTINGS)
    assert type(caught.value) is AssertionError, f"not a caught bug: {caught.value!r}"


def test_fake_backend_imports_without_hypothesis() -> None:
    """`FakeBackend` is a development backend: it must not need the ``specs`` extra."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from prefixflight.specs import FakeBackend, ReferenceLRU\n"
        "from prefixflight.core import Scheduler, SchedulerConfig\n"
        "s = Scheduler(SchedulerConfig(num_pages=4, block_size=2))\n"
        "b = FakeBackend(4, 2, lambda rid, pos: 9)\n"
        "s.add_request('r', [1, 2, 3], max_new_tokens=2, now=0.0)\n"
        "b.sequences['r'] = [1, 2, 3]\n"
        "out = s.complete_step(b.run(s.schedule(0.0)), 1.0)\n"
        "assert out.tokens == (('r', 9),), out\n"
        "assert 'hypothesis' not in sys.modules, 'hypothesis was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
