"""BurstRouter against its reference model: the window machine and random batches."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import (
    BlockHash,
    BurstConfig,
    BurstRouter,
    ReplicaLoad,
    RequestId,
    RouteRequest,
)
from prefixflight.core.routing import Assignment, assign_batch
from prefixflight.specs import (
    BurstRouterConformance,
    burst_configs,
    chained_blocks,
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


@given(
    batch=route_batches(),
    replicas=replica_loads(),
    config=burst_configs(),
    known=st.lists(st.tuples(st.integers(0, 3), chained_blocks()), max_size=6),
)
def test_assignment_with_known_prefixes_matches_the_reference(
    batch: list[RouteRequest],
    replicas: list[ReplicaLoad],
    config: BurstConfig,
    known: list[tuple[int, tuple[BlockHash, ...]]],
) -> None:
    index = Held()
    for i, key in known:
        index.held.setdefault(f"r{i}", set()).update(key)  # chained: a key's blocks, each
    got = assign_batch(batch, replicas, config, index)
    assert got == reference_assign(batch, replicas, config, index)


class Held:
    """Replicas' held blocks as sets (a `PrefixIndex`, as the KV-event block index is)."""

    def __init__(self) -> None:
        self.held: dict[str, set[BlockHash]] = {}

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        n = 0
        for h in blocks:
            if h not in self.held.get(replica, ()):
                break
            n += 1
        return n


def test_the_machine_catches_a_router_that_ignores_known_prefixes() -> None:
    def ignores(config: BurstConfig, replicas: Sequence[ReplicaLoad], known: object) -> BurstRouter:
        return BurstRouter(config, replicas)

    try:
        run_state_machine_as_test(
            BurstRouterConformance.for_factory(ignores, known=True),
            settings=settings(
                derandomize=True,
                stateful_step_count=50,
                max_examples=300,
                database=None,
                report_multiple_bugs=False,
                phases=[Phase.generate],
            ),
        )
    except AssertionError:
        return
    raise AssertionError("the conformance machine accepted a router that ignores known")


@pytest.mark.parametrize(
    "change",
    [
        {"max_batch_size": -1},  # ignores max_batch_size
        {"full_batch": "seal_early"},  # issue 9's defect 13: seals a full batch early
        {"lone_wait_ms": None},  # never releases a lone request early
        {"lone_wait_ms": 1},  # releases lone requests too early
        {"quiet_ms": None},  # never seals a quiet window early
    ],
    ids=["no-cap", "always-seal-early", "no-adaptive-window", "short-lone-wait", "no-quiet-seal"],
)
def test_the_machine_catches_a_wrong_router(change: dict[str, object]) -> None:
    """A router that mishandles full batches or the adaptive window must fail the
    conformance machine."""

    class Wrong:
        def __init__(self, config: BurstConfig, replicas: Sequence[ReplicaLoad]) -> None:
            self.inner = BurstRouter(attrs.evolve(config, **change), replicas)  # type: ignore[arg-type]

        @property
        def pending(self) -> tuple[RequestId, ...]:
            return self.inner.pending

        @property
        def deadline(self) -> float | None:
            return self.inner.deadline

        @property
        def wake_at(self) -> float | None:
            return self.inner.wake_at

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
            BurstRouterConformance.for_factory(Wrong),
            settings=settings(
                derandomize=True,
                stateful_step_count=25,
                database=None,
                report_multiple_bugs=False,
                phases=[Phase.generate],  # finding it is enough; no shrinking
            ),
        )
    except AssertionError:
        return
    raise AssertionError(f"the conformance machine accepted a router with {change}")
