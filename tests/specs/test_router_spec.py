"""BurstRouter against its reference model: the window machine and random batches."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import Phase, given, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import (
    Assignment,
    BurstConfig,
    BurstRouter,
    ReplicaLoad,
    RequestId,
    RouteRequest,
    assign_batch,
)
from prefixflight.specs import (
    BurstRouterConformance,
    burst_configs,
    reference_assign,
    replica_loads,
    route_batches,
)


def test_burst_router_conforms_to_the_window_model() -> None:
    run_state_machine_as_test(BurstRouterConformance.for_factory(BurstRouter))


@given(batch=route_batches(), replicas=replica_loads(), config=burst_configs())
def test_assignment_matches_the_reference(
    batch: list[RouteRequest], replicas: list[ReplicaLoad], config: BurstConfig
) -> None:
    assert assign_batch(batch, replicas, config) == reference_assign(batch, replicas, config)


def test_the_machine_catches_a_wrong_router() -> None:
    """A router that never seals full batches early must fail the conformance machine."""

    class NoEarlySeal:
        def __init__(self, config: BurstConfig, replicas: Sequence[ReplicaLoad]) -> None:
            self.inner = BurstRouter(attrs.evolve(config, max_batch_size=-1), replicas)

        @property
        def pending(self) -> tuple[RequestId, ...]:
            return self.inner.pending

        @property
        def deadline(self) -> float | None:
            return self.inner.deadline

        def arrive(self, request: RouteRequest, now: float) -> tuple[Assignment, ...]:
            return self.inner.arrive(request, now)

        def tick(self, now: float) -> tuple[Assignment, ...]:
            return self.inner.tick(now)

        def cancel(self, request_id: RequestId) -> None:
            self.inner.cancel(request_id)

        def update_replicas(self, replicas: Sequence[ReplicaLoad]) -> None:
            self.inner.update_replicas(replicas)

    try:
        run_state_machine_as_test(
            BurstRouterConformance.for_factory(NoEarlySeal),
            settings=settings(
                stateful_step_count=25,
                database=None,
                report_multiple_bugs=False,
                phases=[Phase.generate],  # finding it is enough; no shrinking
            ),
        )
    except AssertionError:
        return
    raise AssertionError("the conformance machine accepted a router that ignores max_batch_size")
