"""``prefixflight simulate router``: baseline vs burst router, side by side, on one workload.

`register_router` adds the ``router`` sub-command to the ``simulate`` command's
sub-parsers (see ``_simulate_cmd.SIMULATIONS``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from prefixflight.core import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
    BurstConfig,
    BurstRouter,
    LeastLoadedRouter,
    ReplicaLoad,
    Router,
    UsageError,
)
from prefixflight.sim import (
    ClusterConfig,
    RouterReport,
    Workload,
    grpo_workload,
    simulate_cluster,
    trace_workload,
)

from ._io import read_trace
from ._progress import progress

__all__ = ["build_routers", "format_table", "register_router", "run_router"]


def _span(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    try:
        pair = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {value!r}") from None
    return pair


def register_router(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "router",
        help="baseline vs burst prefix-affinity routing on a simulated cluster",
        description=(
            "Simulate N replicas (each with a prefix cache and a continuous-batching cost "
            "model) under a GRPO rollout workload or a replayed Mooncake trace, once with the "
            "baseline router and once with the burst router in front of it, and print both "
            "side by side."
        ),
    )
    w = p.add_argument_group("workload (GRPO rollouts unless --trace)")
    w.add_argument("--steps", type=int, default=40, help="RL steps (40)")
    w.add_argument("--prompts", type=int, default=32, help="prompts per step, P (32)")
    w.add_argument("--samples", type=int, default=8, help="samples per prompt, G (8)")
    w.add_argument(
        "--prompt-tokens",
        type=_span,
        default=(64, 128),
        metavar="LOW:HIGH",
        help="prompt length, uniform (64:128, one to two 64-token blocks)",
    )
    w.add_argument(
        "--output-tokens",
        type=_span,
        default=(64, 512),
        metavar="LOW:HIGH",
        help="output length, uniform (64:512)",
    )
    w.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="a system prompt shared by every prompt (0)",
    )
    w.add_argument(
        "--burst-ms",
        type=float,
        default=50.0,
        help="a step's rollouts arrive within this many ms (50)",
    )
    w.add_argument(
        "--trace",
        metavar="TRACE",
        help="replay a Mooncake trace instead (path, .gz, bundled:conversation)",
    )
    w.add_argument("--clones", type=int, default=1, help="burst overlay: copies per record (1)")
    w.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="burst overlay: clones arrive within this many ms (0)",
    )
    w.add_argument(
        "--time-scale", type=float, default=1.0, help="stretch (>1) or compress (<1) trace time (1)"
    )
    w.add_argument("--limit", type=int, default=None, help="replay only the first N records")
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=4, help="replicas (4)")
    c.add_argument(
        "--cache-blocks",
        type=int,
        default=65536,
        help="prefix cache per replica, in engine blocks (65536)",
    )
    c.add_argument(
        "--engine-block-size",
        type=int,
        default=None,
        help="engine KV block size in tokens (16; 512 for a trace)",
    )
    c.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=100.0,
        help="prefill time per uncached prompt token, us (100)",
    )
    c.add_argument(
        "--decode-ms-per-step",
        type=float,
        default=25.0,
        help="time of one continuous-batching iteration, ms (25)",
    )
    b = p.add_argument_group("routers")
    b.add_argument(
        "--baseline",
        choices=("approx", "least-loaded"),
        default="approx",
        help="baseline router; also the burst router's fallback (approx)",
    )
    b.add_argument(
        "--index-lag-ms",
        type=float,
        default=10.0,
        help="approx: a decision reaches the index this late (10)",
    )
    b.add_argument("--window-ms", type=int, default=100, help="burst window (100)")
    b.add_argument("--k", type=int, default=-1, help="max per replica, -1 = whole group (-1)")
    b.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="router block size in tokens (64; 512 for a trace)",
    )
    b.add_argument("--max-prefix-tokens", type=int, default=0, help="match cap, 0 = default")
    b.add_argument("--min-colocate-blocks", type=int, default=0, help="(0)")
    b.add_argument("--max-batch-size", type=int, default=1000, help="(1000)")
    b.add_argument(
        "--full-batch",
        choices=("no_affinity", "seal_early"),
        default="no_affinity",
        help="an arrival at a full batch: no_affinity = routed by the baseline, the batch seals"
        " on its timer (llm-d); seal_early = the filling arrival seals the batch (no_affinity)",
    )
    b.add_argument("--balance-by", choices=("requests", "tokens"), default="requests")
    p.add_argument("--seed", type=int, default=0, help="workload and tie-break seed (0)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_router, parser=p)


def _workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    if args.trace:
        block = 512 if args.block_size is None else args.block_size
        with read_trace(args.trace) as reader:
            records = progress(reader, desc="trace", unit="req", quiet=args.quiet)
            return trace_workload(
                records,
                rng,
                clones=args.clones,
                jitter_s=args.jitter_ms / 1000.0,
                time_scale=args.time_scale,
                block_size=block,
                limit=args.limit,
            )
    return grpo_workload(
        rng,
        steps=args.steps,
        prompts_per_step=args.prompts,
        samples=args.samples,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        shared_prefix_tokens=args.shared_prefix_tokens,
        burst_s=args.burst_ms / 1000.0,
        route_block_size=64 if args.block_size is None else args.block_size,
        engine_block_size=args.engine_block_size,
    )


def build_routers(
    kind: str,
    cluster: ClusterConfig,
    burst: BurstConfig,
    approx: ApproxPrefixConfig,
    seed: int,
) -> tuple[Router, Router]:
    """The baseline router and the burst router in front of an identical baseline."""

    def baseline() -> Router:
        rng = random.Random(seed)
        if kind == "least-loaded":
            return LeastLoadedRouter(rng)
        return ApproxPrefixRouter(approx, rng)

    replicas = [ReplicaLoad(name=n) for n in cluster.replica_names]
    return baseline(), BurstAffinityRouter(BurstRouter(burst, replicas), baseline())


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_table(
    baseline: RouterReport, burst: RouterReport, group: str, step: str = "step time"
) -> str:
    """The side-by-side table, as the seed prints it."""
    rows = [
        (
            f"{group} fully co-located",
            _pct(baseline.groups_fully_colocated),
            _pct(burst.groups_fully_colocated),
        ),
        (
            "mean distinct replicas per group",
            _num(baseline.mean_distinct_replicas, ".2f"),
            _num(burst.mean_distinct_replicas, ".2f"),
        ),
        ("prefix-cache hit rate", _pct(baseline.hit_rate), _pct(burst.hit_rate)),
        (f"mean {step} (s)", f"{baseline.mean_step_time:.2f}", f"{burst.mean_step_time:.2f}"),
        (f"p95 {step} (s)", f"{baseline.p95_step_time:.2f}", f"{burst.p95_step_time:.2f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("baseline"), *(len(r[1]) for r in rows))
    w2 = max(len("burst"), *(len(r[2]) for r in rows))
    lines = [
        f"{'metric':<{w0}}  {'baseline':>{w1}}  {'burst':>{w2}}",
        f"{'-' * w0}  {'-' * w1}  {'-' * w2}",
    ]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}" for a, b, c in rows]
    return "\n".join(lines)


def run_router(args: argparse.Namespace) -> int:
    for flag in ("block_size", "engine_block_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            args.parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.engine_block_size is None:  # a trace's hash ids are per 512-token block
        args.engine_block_size = (
            (512 if args.block_size is None else args.block_size) if args.trace else 16
        )
    cluster = ClusterConfig(
        replicas=args.replicas,
        cache_capacity_blocks=args.cache_blocks,
        engine_block_size=args.engine_block_size,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        decode_s_per_step=args.decode_ms_per_step / 1000.0,
    )
    workload = _workload(args)
    burst_config = BurstConfig(
        window_ms=args.window_ms,
        max_per_replica=args.k,
        block_size_tokens=workload.route_block_size,
        max_prefix_tokens_to_match=args.max_prefix_tokens,
        min_colocate_blocks=args.min_colocate_blocks,
        max_batch_size=args.max_batch_size,
        full_batch=args.full_batch,
        balance_by=args.balance_by,
    )
    approx = ApproxPrefixConfig(index_lag=args.index_lag_ms / 1000.0)
    base_router, burst_router = build_routers(
        args.baseline, cluster, burst_config, approx, args.seed
    )
    base = simulate_cluster(workload, base_router, cluster, name=args.baseline)
    burst = simulate_cluster(workload, burst_router, cluster, name=f"burst+{args.baseline}")
    if workload.description.get("kind") == "grpo":
        print(format_table(base, burst, "G-sample groups", "step time"))
    else:  # a trace's "step" is one record and its clones
        print(format_table(base, burst, "clone groups", "group latency"))
    if args.json:
        doc: dict[str, Any] = {
            "baseline": base.to_dict(),
            "burst": burst.to_dict(),
            "workload": {
                **workload.description,
                "seed": args.seed,
                "cluster": {
                    "replicas": cluster.replicas,
                    "cache_capacity_blocks": cluster.cache_capacity_blocks,
                    "engine_block_size": cluster.engine_block_size,
                    "prefill_s_per_token": cluster.prefill_s_per_token,
                    "decode_s_per_step": cluster.decode_s_per_step,
                },
                "baseline_router": args.baseline,
                "index_lag_s": approx.index_lag,
                "burst_config": {
                    "window_ms": burst_config.window_ms,
                    "max_per_replica": burst_config.max_per_replica,
                    "block_size_tokens": burst_config.block_size_tokens,
                    "max_prefix_tokens_to_match": burst_config.max_prefix_tokens_to_match,
                    "min_colocate_blocks": burst_config.min_colocate_blocks,
                    "max_batch_size": burst_config.max_batch_size,
                    "full_batch": burst_config.full_batch,
                    "balance_by": burst_config.balance_by,
                },
            },
        }
        try:
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.json!r}: {exc.strerror or exc}") from None
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
