"""Our burst router against Ray Serve's own routers, on real engine replicas, side by side.

One local Ray instance; for each router in turn a fresh deployment of ``--replicas``
`AsyncEngine` replicas (``--model``: SmolLM2-135M, or the torch backend's 2-layer
random-weight Llama), the same workload, then the deployment is deleted. Routers: ``burst``
(prefixflight's `BurstRequestRouter`), ``prefix_cache_affinity`` (Ray's
``PrefixCacheAffinityRouter`` from ``ray.serve.llm``, with routing tasks that keep their
request, as ours: Serve 2.59's own loop drops a few requests of both) and ``pow2`` (Ray's
default power-of-two-choices router).

Workload (same seed, same requests for every router):

- GRPO-shaped: ``--steps`` steps of ``--prompts`` fresh prompts x G=``--samples`` identical
  samples, every sample of a step arriving uniformly within ``--burst-ms``; the next step
  starts when the previous one finishes (as an RL trainer does).
- Mooncake-derived: the first ``--mooncake`` records of the bundled conversation trace
  (Mooncake's), scaled down: each hash id becomes a fixed random 16-token block (records
  sharing hash ids share those token blocks), at most ``--mooncake-blocks`` blocks per
  prompt, arrivals at the trace's timestamps compressed into ``--mooncake-span-s``.

Prompts go as token ids (what our router hashes and the replicas run) and as text, one
character per id (what Ray's prefix router matches; the tiny model's character tokenizer maps
it back to exactly those ids).
Each of ``--rounds`` rounds deploys and runs every router once, the order rotated; the
table shows medians over rounds (the JSON keeps every round). Measured per router: GRPO
groups fully co-located, mean distinct replicas per group, the
prefix-cache hit rate (cached / prompt tokens, from each replica's own engine counters),
TTFT p50/p95 (client side: send to the first streamed token, routing included) and the
makespan (the two phases' wall time). ``simulated`` is our cluster simulator on the same
requests with the burst router, its cost model fitted to the replicas' measured step times.

    python benchmarks/router/ray_router.py --model smollm2 --residency kv_events --json FILE

Model: ``--model smollm2`` runs SmolLM2-135M-Instruct (fp32, one torch thread per replica
when replicas >= cores), where a prefill costs real time (about 0.2 s for 100 tokens at one
quiet thread) and reuse pays; four replicas fit in memory (about 0.6 GB each) and take about
a minute per router and round on two cores. ``--model tiny`` (the default, fast) runs the
2-layer random-weight Llama (vocab 512): the same engine, scheduler and prefix cache, where
a prefill costs milliseconds. Prompt ids stay below 512 for both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import attrs

from prefixflight.cli import read_trace
from prefixflight.core import BlockHasher, BurstConfig, BurstRouter, ReplicaLoad
from prefixflight.core.routing import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
)
from prefixflight.serve.ray import (
    FirstToken,
    GenerateRequest,
    GenerateResult,
    ModelSpec,
    run_local,
    shutdown,
)
from prefixflight.sim import ClusterConfig, RouterReport, SimRequest, Workload, simulate_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

ROUTER_KEYS = {"burst": "burst", "prefix": "prefix_cache_affinity", "pow2": "pow2"}
ENGINE_BLOCK = 16
VOCAB = 512


@attrs.frozen
class Spec:
    """One request of the workload."""

    phase: str  # "grpo" or "mooncake"
    step: int
    group: int
    at: float  # seconds after its step's (grpo) or its phase's (mooncake) start
    ids: tuple[int, ...]
    max_tokens: int

    def request(self) -> GenerateRequest:
        text = "".join(chr(VOCAB - 2 + t) for t in self.ids)  # CharTokenizer(text) == ids
        return GenerateRequest(prompt=text, prompt_ids=self.ids, max_tokens=self.max_tokens)


@attrs.frozen
class Outcome:
    spec: Spec
    sent: float
    first: float | None
    done: float
    result: GenerateResult | None
    error: str | None


def grpo_specs(rng: random.Random, args: argparse.Namespace) -> list[Spec]:
    lo, hi = args.prompt_tokens
    out: list[Spec] = []
    group = 0
    for step in range(args.steps):
        for _ in range(args.prompts):
            ids = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi)))
            for _ in range(args.samples):
                at = rng.uniform(0.0, args.burst_ms / 1000.0)
                out.append(Spec("grpo", step, group, at, ids, rng.randint(*args.max_tokens)))
            group += 1
    return out


def mooncake_specs(rng: random.Random, args: argparse.Namespace, first_group: int) -> list[Spec]:
    blocks: dict[int, tuple[int, ...]] = {}
    records = []
    with read_trace("bundled:conversation") as reader:
        for rec in reader:
            records.append(rec)
            if len(records) >= args.mooncake:
                break
    t0 = records[0].timestamp or 0.0
    span = max(((r.timestamp or 0.0) - t0) for r in records) or 1.0
    scale = args.mooncake_span_s / span
    out = []
    lo, hi = args.max_tokens
    for i, rec in enumerate(records):
        ids: list[int] = []
        for h in rec.hash_ids[: args.mooncake_blocks]:
            if h not in blocks:
                blocks[h] = tuple(rng.randrange(1, VOCAB) for _ in range(ENGINE_BLOCK))
            ids.extend(blocks[h])
        out_tokens = max(lo, min(hi, rec.output_length or hi))
        at = ((rec.timestamp or 0.0) - t0) * scale
        out.append(Spec("mooncake", 0, first_group + i, at, tuple(ids), out_tokens))
    return out


async def run_phase(handle: Any, specs: list[Spec], timeout_s: float) -> list[Outcome]:
    streaming = handle.options(stream=True)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(spec: Spec) -> Outcome:
        delay = start + spec.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the workload's arrival time
        sent = time.perf_counter()
        first: float | None = None
        result: GenerateResult | None = None
        try:
            async with asyncio.timeout(timeout_s):
                async for event in streaming.stream.remote(spec.request()):
                    if isinstance(event, FirstToken):
                        first = time.perf_counter()
                    elif isinstance(event, GenerateResult):
                        result = event
        except Exception as exc:  # counted as failed (a timeout included)
            where = "no first token" if first is None else "after its first token"
            print(f"failed: {spec.phase} group {spec.group}, {where}: {exc!r}", file=sys.stderr)
            return Outcome(spec, sent, first, time.perf_counter(), None, repr(exc))
        return Outcome(spec, sent, first, time.perf_counter(), result, None)

    return list(await asyncio.gather(*(one(s) for s in specs)))


async def run_workload(
    handle: Any, grpo: list[Spec], mooncake: list[Spec], timeout_s: float
) -> dict[str, Any]:
    outcomes: dict[str, list[Outcome]] = {"grpo": [], "mooncake": []}
    walls: dict[str, float] = {}
    t = time.perf_counter()
    for step in sorted({s.step for s in grpo}):  # chained: a step starts when the last ends
        outcomes["grpo"] += await run_phase(handle, [s for s in grpo if s.step == step], timeout_s)
    walls["grpo"] = time.perf_counter() - t
    t = time.perf_counter()
    outcomes["mooncake"] = await run_phase(handle, mooncake, timeout_s)
    walls["mooncake"] = time.perf_counter() - t
    return {"outcomes": outcomes, "walls": walls}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q * (len(s) - 1))))]


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.result is not None]
    groups: dict[int, set[str]] = {}
    sizes: dict[int, int] = {}
    for o in ok:
        assert o.result is not None
        groups.setdefault(o.spec.group, set()).add(o.result.replica)
        sizes[o.spec.group] = sizes.get(o.spec.group, 0) + 1
    multi = [g for g, n in sizes.items() if n >= 2]
    prompt = sum(o.result.prompt_tokens for o in ok if o.result)
    cached = sum(o.result.cached_tokens for o in ok if o.result)
    ttfts = [o.first - o.sent for o in ok if o.first is not None]
    per_replica: dict[str, int] = {}
    for o in ok:
        assert o.result is not None
        per_replica[o.result.replica] = per_replica.get(o.result.replica, 0) + 1
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "groups": len(multi),
        "groups_fully_colocated": (
            sum(len(groups[g]) == 1 for g in multi) / len(multi) if multi else None
        ),
        "mean_distinct_replicas": (
            sum(len(groups[g]) for g in multi) / len(multi) if multi else None
        ),
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50": pct(ttfts, 0.5) if ttfts else None,
        "ttft_p95": pct(ttfts, 0.95) if ttfts else None,
        "makespan": wall,
        "requests_per_replica": dict(sorted(per_replica.items())),
    }


def report_splits(name: str, outcomes: list[Outcome]) -> None:
    """On stderr: each group whose samples landed on several replicas (replica, send time)."""
    start = min((o.sent for o in outcomes), default=0.0)
    groups: dict[int, list[tuple[str, float]]] = {}
    for o in outcomes:
        if o.result is not None:
            groups.setdefault(o.spec.group, []).append((o.result.replica, o.sent - start))
    for g, members in sorted(groups.items()):
        if len({r for r, _ in members}) > 1:
            spread = ", ".join(f"{r}@{t:.3f}s" for r, t in sorted(members, key=lambda m: m[1]))
            print(f"{name}: group {g} split: {spread}", file=sys.stderr)


def median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each metric over rounds (per phase too); the rounds themselves kept."""

    def med(items: list[dict[str, Any]], key: str) -> Any:
        values = [x[key] for x in items if x.get(key) is not None]
        return statistics.median(values) if values else None

    keys = [key for _, key, _ in ROWS] + ["failed"]
    out: dict[str, Any] = {k: med(runs, k) for k in keys}
    out["workloads"] = {
        phase: {k: med([x["workloads"][phase] for x in runs], k) for k in keys}
        for phase in ("grpo", "mooncake")
    }
    out["rounds"] = runs
    return out


def fit_costs(outcomes: list[Outcome]) -> tuple[float, float]:
    """(prefill s/token, decode s/step) from the replicas' own timings: a decode step is the
    median time between first and last token per token; a cold prefill is a leader's engine
    TTFT less one step, per prompt token."""
    steps, per_token = [], []
    for o in outcomes:
        r = o.result
        if r is None or r.first_token_unix is None or len(r.token_ids) < 2:
            continue
        step = (r.finished_unix - r.first_token_unix) / (len(r.token_ids) - 1)
        steps.append(step)
        if r.cached_tokens == 0 and r.ttft is not None and r.prompt_tokens:
            per_token.append(max(0.0, r.ttft - step) / r.prompt_tokens)
    decode = statistics.median(steps) if steps else 0.02
    prefill = statistics.median(per_token) if per_token else 0.0
    return prefill, max(decode, 1e-4)


def sim_workload(specs: list[Spec], route_block: int, chained: bool) -> Workload:
    route = BlockHasher(block_size=route_block, include_partial=True)
    cache = BlockHasher(block_size=ENGINE_BLOCK)
    reqs = [
        SimRequest(
            request_id=i,
            arrival=s.at,
            step=s.step if chained else s.group,
            group=s.group,
            num_tokens=len(s.ids),
            output_tokens=s.max_tokens,
            route_blocks=route.hash_tokens(s.ids),
            cache_blocks=cache.hash_tokens(s.ids),
        )
        for i, s in enumerate(specs)
    ]
    reqs.sort(key=lambda r: (r.step, r.arrival, r.request_id))
    return Workload(
        requests=tuple(reqs),
        chained=chained,
        route_block_size=route_block,
        engine_block_size=ENGINE_BLOCK,
    )


def simulated(
    grpo: list[Spec], mooncake: list[Spec], args: argparse.Namespace, costs: tuple[float, float]
) -> dict[str, Any]:
    cluster = ClusterConfig(
        replicas=args.replicas,
        cache_capacity_blocks=1024,  # EngineConfig's default pool: 1024 pages of 16
        engine_block_size=ENGINE_BLOCK,
        prefill_s_per_token=costs[0],
        decode_s_per_step=costs[1],
    )

    def burst() -> BurstAffinityRouter:
        config = BurstConfig(window_ms=args.window_ms, block_size=args.route_block)
        loads = [ReplicaLoad(name=n) for n in cluster.replica_names]
        approx = ApproxPrefixConfig(max_prefix_blocks_to_match=256)
        return BurstAffinityRouter(
            BurstRouter(config, loads), ApproxPrefixRouter(approx, random.Random(args.seed))
        )

    block = args.route_block
    g: RouterReport = simulate_cluster(sim_workload(grpo, block, True), burst(), cluster)
    m: RouterReport = simulate_cluster(sim_workload(mooncake, block, False), burst(), cluster)
    prompt = g.prompt_tokens + m.prompt_tokens
    return {
        "groups_fully_colocated": g.groups_fully_colocated,
        "mean_distinct_replicas": g.mean_distinct_replicas,
        "hit_rate": (g.hit_tokens + m.hit_tokens) / prompt if prompt else 0.0,
        "ttft_p50": None,  # the cluster simulator reports step times, not per-request TTFT
        "ttft_p95": None,
        "makespan": g.makespan + m.makespan,
        "workloads": {"grpo": g.to_dict(), "mooncake": m.to_dict()},
        "cost_model": {"prefill_s_per_token": costs[0], "decode_s_per_step": costs[1]},
    }


def fmt(v: Any, kind: str) -> str:
    if v is None:
        return "n/a"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "s":
        return f"{v:.3f}"
    return f"{v:.2f}"


ROWS = (
    ("groups fully co-located", "groups_fully_colocated", "pct"),
    ("mean distinct replicas per group", "mean_distinct_replicas", "x"),
    ("prefix-cache hit rate", "hit_rate", "pct"),
    ("TTFT p50 (s)", "ttft_p50", "s"),
    ("TTFT p95 (s)", "ttft_p95", "s"),
    ("makespan (s)", "makespan", "s"),
)


def table(results: dict[str, dict[str, Any]], sim: dict[str, Any] | None) -> str:
    cols = list(results) + (["simulated burst"] if sim else [])
    data = dict(results, **({"simulated burst": sim} if sim else {}))
    w0 = max(len(r[0]) for r in ROWS)
    lines = [f"{'metric':<{w0}}  " + "  ".join(f"{c:>22}" for c in cols)]
    lines.append("-" * len(lines[0]))
    for label, key, kind in ROWS:
        cells = "  ".join(f"{fmt(data[c].get(key), kind):>22}" for c in cols)
        lines.append(f"{label:<{w0}}  {cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="what each replica runs: the 2-layer random-weight Llama or SmolLM2-135M",
    )
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    ap.add_argument("--routers", default="burst,prefix,pow2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per GRPO step")
    ap.add_argument("--samples", type=int, default=8, help="G: identical samples per prompt")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(64, 128))
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 32))
    ap.add_argument("--burst-ms", type=float, default=20.0)
    ap.add_argument("--window-ms", type=int, default=30)
    ap.add_argument("--route-block", type=int, default=16, help="burst router key block")
    ap.add_argument(
        "--residency",
        choices=("stats", "kv_events", "none"),
        default="stats",
        help="burst: route requests its window leaves alone by the replicas' resident blocks, "
        "as reported in record_routing_stats (stats) or followed through their KV events "
        "(kv_events)",
    )
    ap.add_argument("--mooncake", type=int, default=48, help="trace records (0: none)")
    ap.add_argument("--mooncake-blocks", type=int, default=8)
    ap.add_argument("--mooncake-span-s", type=float, default=4.0)
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, router order rotated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    # Serve's routers give a replica 0.1 s to report its queue length before trying others;
    # on a loaded 2-core machine replicas busy computing miss that, for every router alike.
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")
    # With cached queue lengths, a routing task that finds no request to fulfil loops without
    # ever awaiting, and behind PrefixCacheAffinityRouter's blocking ray.get calls that starves
    # the router's event loop here for minutes; probing every time (every router alike) yields.
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S", "0")

    rng = random.Random(args.seed)
    grpo = grpo_specs(rng, args)
    mooncake = mooncake_specs(rng, args, first_group=10**6) if args.mooncake else []
    warm = [Spec("warm", 0, -1 - i, 0.0, (i + 1,) * 40, 4) for i in range(2 * args.replicas)]
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    rounds: dict[str, list[dict[str, Any]]] = {ROUTER_KEYS[n]: [] for n in names}
    pooled: list[Outcome] = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            kwargs: dict[str, Any] = {}
            if name == "burst":
                kwargs = {
                    "window_ms": args.window_ms,
                    "block_size_tokens": args.route_block,
                    "seed": 0,
                    "residency_source": None if args.residency == "none" else args.residency,
                }
            print(f"== round {r + 1}: {name}", file=sys.stderr, flush=True)
            handle = run_local(
                args.replicas,
                name,
                ModelSpec.tiny() if args.model == "tiny" else ModelSpec.smollm2(),
                router_kwargs=kwargs,
                num_cpus=args.num_cpus,
                app_name=f"bench-{name}-{r}",
            )
            asyncio.run(run_phase(handle, warm, args.timeout_s))  # first calls, off the clock
            run = asyncio.run(run_workload(handle, grpo, mooncake, args.timeout_s))
            outs = run["outcomes"]
            pooled += outs["grpo"] + outs["mooncake"]
            summary = summarize(outs["grpo"] + outs["mooncake"], sum(run["walls"].values()))
            summary["workloads"] = {
                phase: summarize(outs[phase], run["walls"][phase]) for phase in ("grpo", "mooncake")
            }
            rounds[ROUTER_KEYS[name]].append(summary)
            if name == "burst":  # the router whose co-location is the point
                report_splits(name, outs["grpo"])
            from ray import serve

            serve.delete(f"bench-{name}-{r}")
    shutdown()
    results = {key: median_summary(runs) for key, runs in rounds.items()}

    costs = fit_costs(pooled)
    sim = simulated(grpo, mooncake, args, costs) if "burst" in names else None
    print(table(results, sim))
    base = results.get("burst")
    if base is not None:
        for other in ("prefix_cache_affinity", "pow2"):
            o = results.get(other)
            if o and o["ttft_p50"] and base["ttft_p50"]:
                print(
                    f"burst vs {other}: hit rate {100 * (base['hit_rate'] - o['hit_rate']):+.1f} "
                    f"points, TTFT p50 x{base['ttft_p50'] / o['ttft_p50']:.2f}, "
                    f"makespan x{base['makespan'] / o['makespan']:.2f}"
                )
    if sim and base:
        print(
            f"simulator vs measured (burst): co-located {fmt(sim['groups_fully_colocated'], 'pct')}"
            f" vs {fmt(base['groups_fully_colocated'], 'pct')}, hit rate "
            f"{fmt(sim['hit_rate'], 'pct')} vs {fmt(base['hit_rate'], 'pct')}, makespan "
            f"{sim['makespan']:.2f} s vs {base['makespan']:.2f} s"
        )
    if args.json:
        report = {
            "replicas": args.replicas,
            "routers": results,
            "simulated": sim,
            "model": (
                "random-weight tiny Llama (2 layers, hidden 64, vocab 512), fp32 CPU"
                if args.model == "tiny"
                else "SmolLM2-135M-Instruct, fp32 CPU"
            ),
            "workload": {
                "grpo": {
                    "steps": args.steps,
                    "prompts_per_step": args.prompts,
                    "samples": args.samples,
                    "prompt_tokens": list(args.prompt_tokens),
                    "max_tokens": list(args.max_tokens),
                    "burst_ms": args.burst_ms,
                    "requests": len(grpo),
                },
                "mooncake": {
                    "records": args.mooncake,
                    "blocks_per_prompt": args.mooncake_blocks,
                    "span_s": args.mooncake_span_s,
                    "requests": len(mooncake),
                },
                "window_ms": args.window_ms,
                "route_block": args.route_block,
                "residency": args.residency,
                "rounds": args.rounds,
                "seed": args.seed,
            },
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        }
        harness.write_json(args.json, report)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        main()
