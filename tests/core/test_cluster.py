"""The cluster simulator, the baselines and the burst adapter."""

from __future__ import annotations

import random

import attrs
import pytest

from prefixflight.core import (
    BurstConfig,
    BurstRouter,
    ConfigError,
    ReplicaLoad,
    Routed,
    Router,
    RouteRequest,
    TraceRecord,
    UsageError,
)
from prefixflight.core.routing import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
    LeastLoadedRouter,
    Placed,
    assign_batch,
)
from prefixflight.sim import (
    ClusterConfig,
    Workload,
    grpo_workload,
    simulate_cluster,
    trace_workload,
)

CLUSTER = ClusterConfig(replicas=4)


def names(n: int = 4) -> list[ReplicaLoad]:
    return [ReplicaLoad(name=x) for x in CLUSTER.replica_names[:n]]


def baseline(seed: int = 1, lag: float = 0.01) -> Router:
    return ApproxPrefixRouter(ApproxPrefixConfig(index_lag=lag), random.Random(seed))


def burst(seed: int = 1, **config: object) -> Router:
    return BurstAffinityRouter(
        BurstRouter(BurstConfig(**config), names()),  # type: ignore[arg-type]
        baseline(seed),
    )


def small_grpo(seed: int = 3, **kw: object) -> Workload:
    args: dict[str, object] = {
        "steps": 3,
        "prompts_per_step": 6,
        "samples": 8,
        "prompt_tokens": (64, 128),
        "output_tokens": (4, 40),
    }
    args.update(kw)
    return grpo_workload(random.Random(seed), **args)  # type: ignore[arg-type]


# -- the seed's claim -------------------------------------------------------------------------


def test_burst_router_colocates_every_group_and_raises_the_hit_rate() -> None:
    wl = small_grpo()
    base = simulate_cluster(wl, baseline(), CLUSTER)
    ours = simulate_cluster(wl, burst(), CLUSTER)
    assert ours.groups == base.groups == 18
    assert ours.groups_fully_colocated == 1.0
    assert ours.mean_distinct_replicas == 1.0
    assert base.mean_distinct_replicas is not None and base.mean_distinct_replicas > 1.0
    assert ours.hit_rate > base.hit_rate


def test_simulation_is_deterministic_for_a_seed() -> None:
    a = simulate_cluster(small_grpo(), burst(), CLUSTER)
    b = simulate_cluster(small_grpo(), burst(), CLUSTER)
    assert a == b
    c = simulate_cluster(small_grpo(seed=4), burst(), CLUSTER)
    assert c != a


# -- the replica model ------------------------------------------------------------------------


def test_hits_follow_the_cache_model_on_one_replica() -> None:
    """One replica: the first sample of a prompt misses, the other G-1 hit every full block,
    but never the last prompt token."""
    wl = small_grpo(samples=5)
    one = ClusterConfig(replicas=1)
    report = simulate_cluster(wl, LeastLoadedRouter(), one)
    bs = one.engine_block_size
    expected = 0
    seen: set[int] = set()
    for r in wl.requests:
        if r.group in seen:
            expected += min(len(r.cache_blocks) * bs, r.num_tokens - 1)
        seen.add(r.group)
    assert report.hit_tokens == expected
    assert report.prompt_tokens == sum(r.num_tokens for r in wl.requests)


def test_a_lone_request_takes_one_prefill_iteration_then_one_per_token() -> None:
    wl = grpo_workload(
        random.Random(0),
        steps=1,
        prompts_per_step=1,
        samples=1,
        prompt_tokens=(100, 100),
        output_tokens=(7, 7),
        burst_s=0.0,
    )
    cfg = ClusterConfig(replicas=2, prefill_s_per_token=0.001, decode_s_per_step=0.01)
    report = simulate_cluster(wl, LeastLoadedRouter(), cfg)
    assert report.mean_step_time == pytest.approx((0.01 + 100 * 0.001) + 6 * 0.01)


def test_chained_steps_start_when_the_previous_step_ends() -> None:
    full = simulate_cluster(small_grpo(burst_s=0.0), baseline(), CLUSTER)
    assert full.makespan == pytest.approx(full.mean_step_time * full.steps)


def test_every_request_is_routed_exactly_once() -> None:
    wl = small_grpo()
    report = simulate_cluster(wl, burst(), CLUSTER)
    assert sum(report.requests_per_replica.values()) == report.requests == 144


class _Bad:
    def __init__(self, replica: str, twice: bool = False) -> None:
        self.replica = replica
        self.twice = twice

    def route(self, request: RouteRequest, now: float, replicas: object) -> tuple[Routed, ...]:
        d = Routed(request_id=request.request_id, replica=self.replica)
        return (d, d) if self.twice else (d,)

    def tick(self, now: float, replicas: object) -> tuple[Routed, ...]:
        return ()

    def next_deadline(self) -> float | None:
        return None

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        pass


def test_simulator_rejects_a_misbehaving_router() -> None:
    wl = small_grpo()
    with pytest.raises(UsageError, match="'nowhere'"):
        simulate_cluster(wl, _Bad("nowhere"), CLUSTER)
    with pytest.raises(UsageError, match="twice"):
        simulate_cluster(wl, _Bad(CLUSTER.replica_names[0], twice=True), CLUSTER)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("replicas", 0),
        ("engine_block_size", 0),
        ("decode_s_per_step", 0.0),
        ("prefill_s_per_token", -1.0),
        ("cache_capacity_blocks", -1),
    ],
)
def test_cluster_config_names_bad_values(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ClusterConfig(**{field: value})  # type: ignore[arg-type]


def test_workload_generator_names_bad_values() -> None:
    with pytest.raises(ConfigError, match=r"prompt_tokens.*\(9, 3\)"):
        grpo_workload(random.Random(0), prompt_tokens=(9, 3))
    with pytest.raises(ConfigError, match="samples"):
        grpo_workload(random.Random(0), samples=0)


def test_workload_block_size_must_match_the_cluster() -> None:
    with pytest.raises(ConfigError, match="engine_block_size"):
        simulate_cluster(small_grpo(), baseline(), attrs.evolve(CLUSTER, engine_block_size=32))


# -- trace replay with a burst overlay --------------------------------------------------------


def records(n: int) -> list[TraceRecord]:
    return [
        TraceRecord(
            input_length=1000 + i,
            hash_ids=(0, 10 * i + 1, 10 * i + 2),
            timestamp=1000.0 * i,
            output_length=5,
        )
        for i in range(n)
    ]


def test_trace_overlay_clones_each_record_within_the_jitter() -> None:
    wl = trace_workload(records(5), random.Random(0), clones=4, jitter_s=0.02)
    assert len(wl.requests) == 20
    for r in wl.requests:
        assert r.step * 1.0 <= r.arrival <= r.step * 1.0 + 0.02
    cfg = ClusterConfig(replicas=4, engine_block_size=512)
    ours = simulate_cluster(
        wl,
        BurstAffinityRouter(BurstRouter(BurstConfig(block_size=512), names()), baseline()),
        cfg,
    )
    assert ours.groups == 5 and ours.groups_fully_colocated == 1.0


def test_trace_without_overlay_has_no_groups() -> None:
    wl = trace_workload(records(3), random.Random(0))
    report = simulate_cluster(wl, baseline(), ClusterConfig(engine_block_size=512))
    assert report.groups == 0 and report.groups_fully_colocated is None


# -- baselines --------------------------------------------------------------------------------


def rr(rid: int, blocks: tuple[int, ...] = (1, 2, 3)) -> RouteRequest:
    return RouteRequest(request_id=rid, blocks=blocks, num_tokens=64 * len(blocks))


def test_least_loaded_picks_fewest_running_plus_waiting() -> None:
    loads = [
        ReplicaLoad(name="a", running=2, waiting=1),
        ReplicaLoad(name="b", running=1),
        ReplicaLoad(name="c", running=0, waiting=2),
    ]
    (d,) = LeastLoadedRouter().route(rr(1), 0.0, loads)
    assert d.replica == "b"


def test_approx_router_follows_its_index_without_lag() -> None:
    router = ApproxPrefixRouter()
    (first,) = router.route(rr(1), 0.0, names())
    loads = [attrs.evolve(x, waiting=1) if x.name == first.replica else x for x in names()]
    (second,) = router.route(rr(2), 0.0, loads)
    assert second.replica == first.replica  # prefix 3 outweighs the queue score 2
    assert router.prefix_blocks(first.replica, (1, 2, 3, 4)) == 3


def test_approx_router_does_not_see_decisions_within_the_lag() -> None:
    router = ApproxPrefixRouter(ApproxPrefixConfig(index_lag=0.05))
    (first,) = router.route(rr(1), 0.0, names())
    assert router.scores(rr(2), names()) == dict.fromkeys((x.name for x in names()), 4.0)
    router.tick(0.05, names())
    assert router.prefix_blocks(first.replica, (1, 2, 3)) == 3


def test_approx_scores_combine_prefix_queue_and_kv() -> None:
    router = ApproxPrefixRouter()
    router.record(rr(0, (1, 2)), "a", 0.0)
    loads = [
        ReplicaLoad(name="a", waiting=4, kv_utilization=0.5),
        ReplicaLoad(name="b", waiting=0, kv_utilization=0.0),
    ]
    s = router.scores(rr(1, (1, 2, 3, 4)), loads)
    assert s["a"] == pytest.approx(3.0 * 2 / 4 + 0.0 + 2.0 * 0.5)
    assert s["b"] == pytest.approx(0.0 + 2.0 + 2.0)


def test_approx_config_names_bad_values() -> None:
    with pytest.raises(ConfigError, match="index_lag"):
        ApproxPrefixConfig(index_lag=-1.0)
    with pytest.raises(ConfigError, match="lru_capacity_per_server"):
        ApproxPrefixConfig(lru_capacity_per_server=0)


def test_burst_adapter_routes_no_affinity_requests_through_the_fallback() -> None:
    fallback = ApproxPrefixRouter()
    router = BurstAffinityRouter(BurstRouter(BurstConfig(), names()), fallback)
    assert router.route(rr(1), 0.0, names()) == ()
    assert router.route(rr(2), 0.01, names()) == ()
    assert router.route(rr(3, (7,)), 0.02, names()) == ()
    assert router.next_deadline() == pytest.approx(0.1)
    out = router.tick(0.1, names())
    assert [d.request_id for d in out] == [1, 2, 3]
    assert out[0].replica == out[1].replica
    # The fallback learned the burst's placement, and routed the lone request itself.
    assert fallback.prefix_blocks(out[0].replica, (1, 2, 3)) == 3
    assert fallback.prefix_blocks(out[2].replica, (7,)) == 1
    assert router.next_deadline() is None


@pytest.mark.parametrize("known", [True, False], ids=["known", "llm-d"])
def test_a_burst_split_over_two_windows_stays_together_with_known_prefixes(known: bool) -> None:
    """Five samples seal in one window and three in the next, before any KV event: with the
    fallback's record as ``known`` the three follow the five; without it (llm-d) the second
    window places them afresh, on the replica the first window left idle."""
    fallback = ApproxPrefixRouter()
    window = BurstRouter(BurstConfig(), names(2), known=fallback if known else None)
    router = BurstAffinityRouter(window, fallback)
    for i in range(5):
        assert router.route(rr(i), 0.0, names(2)) == ()
    first = router.tick(0.1, names(2))
    (where,) = {d.replica for d in first}
    loads = [attrs.evolve(x, running=5 if x.name == where else 0) for x in names(2)]
    for i in range(5, 8):
        assert router.route(rr(i), 0.15, loads) == ()
    second = router.tick(0.25, loads)
    assert [d.request_id for d in second] == [5, 6, 7]
    assert {d.replica for d in second} == (
        {where} if known else {x.name for x in names(2)} - {where}
    )


def test_a_known_prefix_pulls_a_unit_only_within_the_fair_share() -> None:
    """Two groups of four known on replica a: the first goes there, the second would push a
    past its fair share (4 of 8 requests on 2 replicas) and goes to b."""
    known = ApproxPrefixRouter()
    known.record(rr(0, (1, 2)), "a", 0.0)
    known.record(rr(0, (5, 6)), "a", 0.0)
    batch = [rr(i, (1, 2)) for i in range(4)] + [rr(i, (5, 6)) for i in range(4, 8)]
    loads = [ReplicaLoad(name="a"), ReplicaLoad(name="b")]
    out = assign_batch(batch, loads, BurstConfig(), known)
    assert [a.replica for a in out if isinstance(a, Placed)] == ["a"] * 4 + ["b"] * 4

    def placed(config: BurstConfig) -> set[str]:
        """Where a group whose first block only is known on a (a busier replica) goes."""
        group = [rr(0, (1, 9)), rr(1, (1, 9))]
        loaded = [ReplicaLoad(name="a", running=3), ReplicaLoad(name="b")]
        return {
            a.replica for a in assign_batch(group, loaded, config, known) if isinstance(a, Placed)
        }

    assert placed(BurstConfig()) == {"b"}  # min_colocate_blocks=0: only a whole key pulls
    assert placed(BurstConfig(min_colocate_blocks=1)) == {"a"}  # one known block matches


def test_burst_router_rejects_a_known_that_is_not_an_index() -> None:
    with pytest.raises(ConfigError, match="known must be a PrefixIndex"):
        BurstRouter(BurstConfig(), names(), known=object())  # type: ignore[arg-type]


def test_burst_adapter_routes_a_batch_full_arrival_through_the_fallback_at_once() -> None:
    fallback = ApproxPrefixRouter()
    router = BurstAffinityRouter(BurstRouter(BurstConfig(max_batch_size=2), names()), fallback)
    assert router.route(rr(1), 0.0, names()) == ()
    assert router.route(rr(2), 0.0, names()) == ()
    (late,) = router.route(rr(3), 0.01, names())  # batch full: no burst affinity, no wait
    assert late.request_id == 3
    assert fallback.prefix_blocks(late.replica, (1, 2, 3)) == 3  # the fallback routed it
    out = router.tick(0.1, names())
    assert [d.request_id for d in out] == [1, 2] and out[0].replica == out[1].replica


def test_burst_adapter_rejects_an_id_that_is_still_waiting() -> None:
    router = BurstAffinityRouter(BurstRouter(BurstConfig(), names()), ApproxPrefixRouter())
    router.route(rr(1), 0.0, names())
    with pytest.raises(UsageError, match="already waiting"):
        router.route(rr(1), 0.5, names())  # even past the deadline: it has not been answered
    assert [d.request_id for d in router.tick(0.5, names())] == [1]
    assert router.route(rr(1), 0.6, names()) == ()  # answered: the id may be reused


def test_rejected_routing_calls_change_nothing() -> None:
    fallback = ApproxPrefixRouter()
    router = BurstAffinityRouter(BurstRouter(BurstConfig(), names(2)), fallback)
    router.route(rr(1), 1.0, names(2))
    burst_router = router.burst
    before = (burst_router.pending, burst_router.deadline, burst_router.replicas, burst_router.now)
    with pytest.raises(UsageError, match="backwards"):
        router.route(rr(2), 0.5, names(4))
    with pytest.raises(UsageError, match="backwards"):
        router.tick(0.5, names(4))
    with pytest.raises(UsageError, match="duplicate replica"):
        router.route(rr(3), 1.5, [*names(2), names(1)[0]])
    assert (
        burst_router.pending,
        burst_router.deadline,
        burst_router.replicas,
        burst_router.now,
    ) == before
    least = LeastLoadedRouter()
    least.route(rr(1), 1.0, names())
    with pytest.raises(UsageError, match="at least one replica"):
        least.route(rr(2), 2.0, [])
    least.route(rr(3), 1.0, names())  # the rejected call did not move its clock
