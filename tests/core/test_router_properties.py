"""Properties of the burst assignment, over random batches (Hypothesis)."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import attrs
from hypothesis import given
from hypothesis import strategies as st

from prefixflight.core import (
    BlockHash,
    BurstConfig,
    ReplicaLoad,
    RequestId,
    RouteRequest,
)
from prefixflight.core.routing import NoAffinity, Placed, assign_batch
from prefixflight.specs import burst_configs, replica_loads, route_batches


def identical_groups(batch: list[RouteRequest], cap: int) -> list[list[RequestId]]:
    by_key: dict[tuple[BlockHash, ...], list[RequestId]] = defaultdict(list)
    for r in batch:
        if r.blocks[:cap]:
            by_key[r.blocks[:cap]].append(r.request_id)
    return [ids for ids in by_key.values() if len(ids) >= 2]


@given(batch=route_batches(), replicas=replica_loads(), config=burst_configs())
def test_every_request_gets_exactly_one_outcome(
    batch: list[RouteRequest], replicas: list[ReplicaLoad], config: BurstConfig
) -> None:
    out = assign_batch(batch, replicas, config)
    assert [a.request_id for a in out] == [r.request_id for r in batch]
    names = {r.name for r in replicas}
    for a, r in zip(out, batch, strict=True):
        assert isinstance(a, (Placed, NoAffinity))
        if isinstance(a, Placed):
            assert a.replica in names
            assert a.matched_blocks == len(r.blocks[: config.max_prefix_blocks]) > 0
        else:
            assert a.request_id == r.request_id


@given(batch=route_batches(), replicas=replica_loads(), config=burst_configs())
def test_identical_groups_are_placed_and_never_split_when_unlimited(
    batch: list[RouteRequest], replicas: list[ReplicaLoad], config: BurstConfig
) -> None:
    config = attrs.evolve(config, max_per_replica=-1)
    out = {a.request_id: a for a in assign_batch(batch, replicas, config)}
    for ids in identical_groups(batch, config.max_prefix_blocks):
        placed = [a for i in ids if isinstance(a := out[i], Placed)]
        assert len(placed) == len(ids)
        assert len({a.replica for a in placed}) == 1


@given(
    batch=route_batches(),
    replicas=replica_loads(),
    config=burst_configs(),
    k=st.integers(1, 3),
)
def test_at_most_k_members_of_a_unit_per_replica_unless_all_are_at_k(
    batch: list[RouteRequest], replicas: list[ReplicaLoad], config: BurstConfig, k: int
) -> None:
    config = attrs.evolve(config, max_per_replica=k)
    out = {a.request_id: a for a in assign_batch(batch, replicas, config)}
    for ids in identical_groups(batch, config.max_prefix_blocks):
        per = Counter(a.replica for i in ids if isinstance(a := out[i], Placed))
        if max(per.values()) > k:  # the overflow guard: every replica already holds k
            assert all(per[r.name] >= k for r in replicas)
        else:  # within the cap the group fills replicas to k before spilling
            assert sum(1 for n in per.values() if n < k) <= 1


@given(batch=route_batches(), replicas=replica_loads(), config=burst_configs())
def test_a_replica_takes_a_run_only_below_its_fair_share(
    batch: list[RouteRequest], replicas: list[ReplicaLoad], config: BurstConfig
) -> None:
    """Balancing by requests, with k = -1: every unit lands (whole) on a replica that was
    below the batch's fair share, so no replica ends above fair share + largest unit - 1.
    (With a finite k the overflow guard may place beyond it; that case is tested above.)"""
    config = attrs.evolve(config, max_per_replica=-1, balance_by="requests")
    out = assign_batch(batch, replicas, config)
    placed = [a for a in out if isinstance(a, Placed)]
    if not placed:
        return
    fair = -(-len(placed) // len(replicas))
    groups = identical_groups(batch, config.max_prefix_blocks)
    largest = max([len(g) for g in groups] + [1])
    load = Counter(a.replica for a in placed)
    assert max(load.values()) <= fair + largest - 1


@given(
    batch=route_batches(),
    replicas=replica_loads(),
    config=burst_configs(),
    seed=st.integers(0, 2**32 - 1),
)
def test_assignment_is_deterministic_and_independent_of_replica_order(
    batch: list[RouteRequest], replicas: list[ReplicaLoad], config: BurstConfig, seed: int
) -> None:
    first = assign_batch(batch, replicas, config)
    assert assign_batch(batch, replicas, config) == first
    shuffled = list(replicas)
    random.Random(seed).shuffle(shuffled)
    assert assign_batch(batch, shuffled, config) == first


@given(
    size=st.integers(2, 40),
    replicas=replica_loads(),
    k=st.integers(1, 4),
)
def test_a_lone_group_beyond_k_per_replica_spreads_evenly(
    size: int, replicas: list[ReplicaLoad], k: int
) -> None:
    batch = [RouteRequest(request_id=i, blocks=("p",), num_tokens=4) for i in range(size)]
    out = assign_batch(batch, replicas, BurstConfig(max_per_replica=k))
    per = Counter(a.replica for a in out if isinstance(a, Placed))
    assert sum(per.values()) == size
    if size >= k * len(replicas):  # every replica reaches k, then the guard keeps it even
        spread = [per[r.name] for r in replicas]
        assert min(spread) >= k and max(spread) - min(spread) <= 1
    else:  # fill to k before spilling: at most one replica is partly filled
        assert sum(1 for n in per.values() if n < k) <= 1
