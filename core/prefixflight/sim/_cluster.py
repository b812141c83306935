"""A pure cluster simulator: N replicas, each with our `PrefixCache`, behind a `Router`.

Time is simulated (seconds); the only randomness is the ``random.Random`` given to the
workload generators (and to the routers, for their tie-breaks). Same inputs, same report.

Replica model (vLLM v1-like continuous batching, one forward pass per iteration):

- A request routed to a replica waits until the replica's current iteration ends; the
  next iteration admits every waiting request (no admission cap).
- Admission looks up the longest cached prefix of the prompt's full blocks
  (``engine_block_size`` tokens each) and publishes the prompt's blocks at once, as vLLM v1
  does when it allocates them (``KVCacheManager.allocate_slots`` caches full blocks then):
  a request admitted after another in the same iteration reuses that request's blocks. The
  last prompt token is always computed (its logits start decoding), so the hit is at most
  ``num_tokens - 1`` tokens.
- An iteration takes ``decode_s_per_step + prefill_s_per_token * uncached prompt tokens of
  the requests it admits``. Every running request emits one token per iteration; an
  admitted request emits its first token in its admission iteration and finishes with the
  iteration that emits its last.
- The prefix cache is an LRU over ``cache_capacity_blocks`` blocks; running requests' blocks
  are not pinned (a simplification: with the default capacity nothing is evicted).

A workload's *steps* are what a step time is measured over: an RL step (every rollout of a
GRPO step; with ``chained`` the next step starts when the previous one finishes), or a
burst group of a replayed trace. Step time = last completion - first arrival of the step.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, final

import attrs

from prefixflight.core import (
    LRU,
    BlockHash,
    BlockHasher,
    ConfigError,
    PrefixCache,
    ReplicaLoad,
    RequestId,
    Routed,
    Router,
    RouteRequest,
    TraceRecord,
    UsageError,
)
from prefixflight.core.routing import Rng
from prefixflight.core.validate import check_int, check_number

__all__ = [
    "ClusterConfig",
    "RouterReport",
    "SimRequest",
    "Workload",
    "grpo_workload",
    "simulate_cluster",
    "trace_workload",
]


def _positive(name: str, value: object, *, zero_ok: bool = False) -> None:
    if zero_ok:
        check_number(name, value, minimum=0, finite=True)
    else:
        check_number(name, value, above=0, finite=True)


def _span(name: str, value: object, minimum: int) -> tuple[int, int]:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise ConfigError(f"{name} must be a (low, high) pair, got {value!r}")
    lo, hi = value
    check_int(f"{name} low", lo, minimum=minimum)
    check_int(f"{name} high", hi, minimum=minimum)
    if lo > hi:
        raise ConfigError(f"{name} low must be <= high, got {value!r}")
    return lo, hi


@final
@attrs.frozen(kw_only=True)
class ClusterConfig:
    """Replicas and their cost model. Defaults: a ~4B model on one GPU, roughly."""

    replicas: int = 4
    cache_capacity_blocks: int = 65536
    engine_block_size: int = 16
    prefill_s_per_token: float = 1e-4
    decode_s_per_step: float = 0.025

    def __attrs_post_init__(self) -> None:
        check_int("replicas", self.replicas, minimum=1)
        check_int("cache_capacity_blocks", self.cache_capacity_blocks, minimum=0)
        check_int("engine_block_size", self.engine_block_size, minimum=1)
        _positive("prefill_s_per_token", self.prefill_s_per_token, zero_ok=True)
        _positive("decode_s_per_step", self.decode_s_per_step)

    @property
    def replica_names(self) -> tuple[str, ...]:
        width = len(str(self.replicas - 1))
        return tuple(f"replica-{i:0{width}d}" for i in range(self.replicas))


@final
@attrs.frozen(kw_only=True)
class SimRequest:
    """One request of a workload.

    ``arrival`` is absolute, or relative to its step's start when the workload is chained.
    ``group``: requests of one prompt (G samples, or the clones of one trace record).
    ``route_blocks``: the hashes routers see; ``cache_blocks``: the engine's full blocks.
    """

    request_id: int
    arrival: float
    step: int
    group: int
    num_tokens: int
    output_tokens: int
    route_blocks: tuple[BlockHash, ...]
    cache_blocks: tuple[BlockHash, ...]


@final
@attrs.frozen(kw_only=True)
class Workload:
    """Requests sorted by (step, arrival); ``chained`` steps start when the previous ends."""

    requests: tuple[SimRequest, ...]
    chained: bool
    route_block_size: int
    engine_block_size: int
    description: dict[str, Any] = attrs.field(factory=dict, eq=False)


def _tokens(rng: Rng, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def grpo_workload(
    rng: Rng,
    *,
    steps: int = 40,
    prompts_per_step: int = 32,
    samples: int = 8,
    prompt_tokens: tuple[int, int] = (64, 128),
    output_tokens: tuple[int, int] = (64, 512),
    shared_prefix_tokens: int = 0,
    burst_s: float = 0.05,
    route_block_size: int = 64,
    engine_block_size: int = 16,
    vocab: int = 32000,
) -> Workload:
    """GRPO rollouts: per step, ``prompts_per_step`` fresh prompts, each sampled ``samples``
    times (identical prompts); lengths uniform in the given inclusive ranges; every rollout
    of a step arrives uniformly at random within ``burst_s`` of the step's start.

    ``shared_prefix_tokens`` prepends one system prompt to every prompt of the run.
    """
    check_int("steps", steps, minimum=1)
    check_int("prompts_per_step", prompts_per_step, minimum=1)
    check_int("samples", samples, minimum=1)
    p_lo, p_hi = _span("prompt_tokens", prompt_tokens, 1)
    o_lo, o_hi = _span("output_tokens", output_tokens, 1)
    check_int("shared_prefix_tokens", shared_prefix_tokens, minimum=0)
    _positive("burst_s", burst_s, zero_ok=True)
    check_int("route_block_size", route_block_size, minimum=1)
    check_int("engine_block_size", engine_block_size, minimum=1)
    check_int("vocab", vocab, minimum=2)
    route_hasher = BlockHasher(block_size=route_block_size, include_partial=True)
    cache_hasher = BlockHasher(block_size=engine_block_size)
    system = _tokens(rng, shared_prefix_tokens, vocab)
    out: list[SimRequest] = []
    group = 0
    for step in range(steps):
        batch: list[SimRequest] = []
        for _ in range(prompts_per_step):
            prompt = system + _tokens(rng, rng.randint(p_lo, p_hi), vocab)
            route = route_hasher.hash_tokens(prompt)
            cache = cache_hasher.hash_tokens(prompt)
            for _ in range(samples):
                batch.append(
                    SimRequest(
                        request_id=len(out) + len(batch),
                        arrival=rng.uniform(0.0, burst_s),
                        step=step,
                        group=group,
                        num_tokens=len(prompt),
                        output_tokens=rng.randint(o_lo, o_hi),
                        route_blocks=route,
                        cache_blocks=cache,
                    )
                )
            group += 1
        batch.sort(key=lambda r: (r.arrival, r.request_id))
        out.extend(batch)
    return Workload(
        requests=tuple(out),
        chained=True,
        route_block_size=route_block_size,
        engine_block_size=engine_block_size,
        description={
            "kind": "grpo",
            "steps": steps,
            "prompts_per_step": prompts_per_step,
            "samples": samples,
            "prompt_tokens": list(prompt_tokens),
            "output_tokens": list(output_tokens),
            "shared_prefix_tokens": shared_prefix_tokens,
            "burst_s": burst_s,
            "route_block_size": route_block_size,
            "engine_block_size": engine_block_size,
            "requests": len(out),
        },
    )


def trace_workload(
    records: Iterable[TraceRecord],
    rng: Rng,
    *,
    clones: int = 1,
    jitter_s: float = 0.0,
    time_scale: float = 1.0,
    default_output_tokens: int = 256,
    block_size: int = 512,
    limit: int | None = None,
) -> Workload:
    """Replay a Mooncake trace (timestamps in ms), with an optional burst overlay: each record
    is cloned ``clones`` times, every clone arriving uniformly within ``jitter_s`` after the
    record's time. ``time_scale`` stretches (> 1) or compresses (< 1) the arrival times.

    The trace's ``hash_ids`` are block-level already (``block_size`` tokens, 512 for the
    Mooncake traces); routers and caches both use them. Each record (with its clones) is
    one group and one step.
    """
    check_int("clones", clones, minimum=1)
    _positive("jitter_s", jitter_s, zero_ok=True)
    _positive("time_scale", time_scale)
    check_int("default_output_tokens", default_output_tokens, minimum=1)
    check_int("block_size", block_size, minimum=1)
    if limit is not None:
        check_int("limit", limit, minimum=1)
    out: list[SimRequest] = []
    t0: float | None = None
    for index, rec in enumerate(records):
        if limit is not None and index >= limit:
            break
        ts = (rec.timestamp or 0.0) / 1000.0
        t0 = ts if t0 is None else t0
        base = (ts - t0) * time_scale
        blocks = tuple(rec.hash_ids)
        output = rec.output_length or default_output_tokens
        for _ in range(clones):
            out.append(
                SimRequest(
                    request_id=len(out),
                    arrival=base + (rng.uniform(0.0, jitter_s) if jitter_s else 0.0),
                    step=index,
                    group=index,
                    num_tokens=rec.input_length,
                    output_tokens=max(1, output),
                    route_blocks=blocks,
                    cache_blocks=blocks,
                )
            )
    if not out:
        raise UsageError("the trace has no records to replay")
    out.sort(key=lambda r: (r.arrival, r.request_id))
    return Workload(
        requests=tuple(out),
        chained=False,
        route_block_size=block_size,
        engine_block_size=block_size,
        description={
            "kind": "trace",
            "records": out[-1].step + 1 if out else 0,
            "clones": clones,
            "jitter_s": jitter_s,
            "time_scale": time_scale,
            "block_size": block_size,
            "requests": len(out),
        },
    )


@final
@attrs.frozen(kw_only=True)
class RouterReport:
    """What one router did on one workload."""

    router: str
    requests: int
    groups: int
    """Groups of two or more requests (the ones co-location is measured on)."""
    groups_fully_colocated: float | None
    mean_distinct_replicas: float | None
    hit_rate: float
    prompt_tokens: int
    hit_tokens: int
    steps: int
    mean_step_time: float
    p95_step_time: float
    makespan: float
    requests_per_replica: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


# -- the simulation --------------------------------------------------------------------------


@final
class _Running:
    __slots__ = ("finish_it", "req")

    def __init__(self, req: SimRequest, finish_it: int) -> None:
        self.req = req
        self.finish_it = finish_it


@final
class _Replica:
    """One engine: waiting queue, running batch, prefix cache, iteration clock."""

    __slots__ = (
        "busy",
        "cache",
        "hit_tokens",
        "it",
        "kv_tokens",
        "name",
        "prompt_tokens",
        "running",
        "sum_admit_it",
        "sum_prompt",
        "waiting",
    )

    def __init__(self, name: str, config: ClusterConfig, block_size: int) -> None:
        self.name = name
        self.cache = PrefixCache(LRU(config.cache_capacity_blocks), block_size)
        self.kv_tokens = max(1, config.cache_capacity_blocks * block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[tuple[int, int, _Running]] = []  # heap by finish iteration
        self.busy = False
        self.it = 0  # iterations completed
        self.sum_prompt = 0
        self.sum_admit_it = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def load(self) -> ReplicaLoad:
        n = len(self.running)
        used = self.sum_prompt + n * self.it - self.sum_admit_it
        return ReplicaLoad(
            name=self.name,
            running=n,
            waiting=len(self.waiting),
            kv_utilization=min(1.0, used / self.kv_tokens),
        )

    def start_iteration(self, config: ClusterConfig) -> float:
        """Admit the waiting requests; return the iteration's duration."""
        cache = self.cache
        bs = cache.block_size
        uncached = 0
        admit_it = self.it  # the iteration being run now emits their first token
        while self.waiting:
            req = self.waiting.popleft()
            k = cache.lookup(req.cache_blocks)
            hit = min(k * bs, max(0, req.num_tokens - 1))
            cache.publish(req.cache_blocks)
            self.prompt_tokens += req.num_tokens
            self.hit_tokens += hit
            uncached += req.num_tokens - hit
            finish_it = admit_it + req.output_tokens - 1
            heapq.heappush(self.running, (finish_it, req.request_id, _Running(req, finish_it)))
            self.sum_prompt += req.num_tokens
            self.sum_admit_it += admit_it
        self.busy = True
        return config.decode_s_per_step + config.prefill_s_per_token * uncached

    def end_iteration(self) -> list[SimRequest]:
        """The iteration finished: return the requests that emitted their last token."""
        done: list[SimRequest] = []
        running = self.running
        while running and running[0][0] <= self.it:
            _, _, r = heapq.heappop(running)
            done.append(r.req)
            self.sum_prompt -= r.req.num_tokens
            self.sum_admit_it -= r.finish_it - r.req.output_tokens + 1
        self.it += 1
        self.busy = False
        return done


_FINISH, _TICK, _ARRIVE = 0, 1, 2  # order of simultaneous events


def simulate_cluster(
    workload: Workload, router: Router, config: ClusterConfig, *, name: str = "router"
) -> RouterReport:
    """Run ``workload`` through ``router`` on the cluster and measure it."""
    if workload.engine_block_size != config.engine_block_size:
        raise ConfigError(
            f"the workload's engine blocks are {workload.engine_block_size} tokens but the "
            f"cluster's engine_block_size is {config.engine_block_size}"
        )
    replicas = {n: _Replica(n, config, config.engine_block_size) for n in config.replica_names}
    order = list(replicas.values())
    by_id = {r.request_id: r for r in workload.requests}
    if len(by_id) != len(workload.requests):
        raise UsageError("workload request ids must be unique")
    steps: dict[int, list[SimRequest]] = {}
    for r in workload.requests:
        steps.setdefault(r.step, []).append(r)
    step_ids = sorted(steps)
    left = {s: len(steps[s]) for s in step_ids}
    first_arrival: dict[int, float] = {}
    last_finish: dict[int, float] = {}
    placed_on: dict[RequestId, str] = {}
    events: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, payload))
        seq += 1

    def release(step_index: int, start: float) -> None:
        for r in steps[step_ids[step_index]]:
            push(start + r.arrival, _ARRIVE, r)

    if workload.chained:
        release(0, 0.0)
    else:
        for i in range(len(step_ids)):
            release(i, 0.0)

    def loads() -> list[ReplicaLoad]:
        return [rep.load() for rep in order]

    def dispatch(decisions: tuple[Routed, ...], t: float) -> None:
        for d in decisions:
            rep = replicas.get(d.replica)
            if rep is None:
                raise UsageError(f"router chose unknown replica {d.replica!r}")
            if d.request_id in placed_on:
                raise UsageError(f"router answered request {d.request_id!r} twice")
            placed_on[d.request_id] = d.replica
            rep.waiting.append(by_id[int(d.request_id)])
            if not rep.busy:
                push(t + rep.start_iteration(config), _FINISH, rep)

    scheduled_tick: float | None = None

    def arm_tick() -> None:
        nonlocal scheduled_tick
        deadline = router.next_deadline()
        if deadline is not None and deadline != scheduled_tick:
            scheduled_tick = deadline
            push(deadline, _TICK, None)

    now = 0.0
    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == _ARRIVE:
            req: SimRequest = payload
            first_arrival.setdefault(req.step, now)
            rr = RouteRequest(
                request_id=req.request_id, blocks=req.route_blocks, num_tokens=req.num_tokens
            )
            dispatch(router.route(rr, now, loads()), now)
            arm_tick()
        elif kind == _TICK:
            dispatch(router.tick(now, loads()), now)
            arm_tick()
        else:
            rep = payload
            for done in rep.end_iteration():
                s = done.step
                last_finish[s] = now
                left[s] -= 1
                if left[s] == 0 and workload.chained:
                    i = step_ids.index(s) + 1
                    if i < len(step_ids):
                        release(i, now)
            if rep.waiting or rep.running:
                push(now + rep.start_iteration(config), _FINISH, rep)

    missing = [r.request_id for r in workload.requests if r.request_id not in placed_on]
    if missing:
        raise UsageError(f"router never routed {len(missing)} requests, e.g. {missing[:3]!r}")

    group_replicas: dict[int, set[str]] = {}
    group_sizes: dict[int, int] = {}
    for r in workload.requests:
        group_replicas.setdefault(r.group, set()).add(placed_on[r.request_id])
        group_sizes[r.group] = group_sizes.get(r.group, 0) + 1
    multi = [g for g, n in group_sizes.items() if n >= 2]
    distinct = [len(group_replicas[g]) for g in multi]
    durations = sorted(last_finish[s] - first_arrival[s] for s in step_ids)
    prompt = sum(rep.prompt_tokens for rep in order)
    hit = sum(rep.hit_tokens for rep in order)
    per_replica = dict.fromkeys(replicas, 0)
    for rname in placed_on.values():
        per_replica[rname] += 1
    return RouterReport(
        router=name,
        requests=len(workload.requests),
        groups=len(multi),
        groups_fully_colocated=(sum(d == 1 for d in distinct) / len(distinct)) if multi else None,
        mean_distinct_replicas=(sum(distinct) / len(distinct)) if multi else None,
        hit_rate=hit / prompt if prompt else 0.0,
        prompt_tokens=prompt,
        hit_tokens=hit,
        steps=len(step_ids),
        mean_step_time=sum(durations) / len(durations),
        p95_step_time=_percentile(durations, 0.95),
        makespan=now,
        requests_per_replica=per_replica,
    )


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]
