"""``prefixflight simulate router``: baseline vs burst router, side by side, on one workload.

`register_router` adds the ``router`` sub-command to the ``simulate`` command's
sub-parsers (see ``_simulate_cmd.SIMULATIONS``).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ._args import (
    Option,
    add_options,
    at_least,
    non_negative_float,
    output_file,
    positive_float,
    usage_errors,
)
from ._io import read_trace, write_atomic, write_stdout
from ._progress import progress

if TYPE_CHECKING:  # the routers and the simulator are imported by the functions that run them
    from prefixflight.core import BurstConfig, Router
    from prefixflight.core.routing import ApproxPrefixConfig
    from prefixflight.sim import ClusterConfig, RouterReport, Workload

__all__ = ["build_routers", "describe", "format_table", "register_router", "run_router"]


def _span(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    try:
        pair = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {value!r}") from None
    if not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH, got {value!r}")
    return pair


# fmt: off
_WORKLOAD: tuple[Option, ...] = (  # (flag, type, default, metavar, help)
    ("--steps", at_least(1), 40, "N", "RL steps"),
    ("--prompts", at_least(1), 32, "P", "prompts per step"),
    ("--samples", at_least(1), 8, "G", "samples per prompt (a group of G identical prompts)"),
    ("--prompt-tokens", _span, "64:128", "LOW:HIGH", "prompt length in tokens, uniform"),
    ("--output-tokens", _span, "64:512", "LOW:HIGH", "output length in tokens, uniform"),
    ("--shared-prefix-tokens", at_least(0), 0, "N",
     "a system prompt of N tokens shared by every prompt"),
    ("--burst-ms", non_negative_float, 50.0, "MS", "a step's rollouts arrive within this many ms"),
    ("--trace", None, None, "TRACE",
     "replay a Mooncake trace instead (a path, a .gz file, '-', bundled:NAME)"),
    ("--clones", at_least(1), 1, "N", "trace burst overlay: copies of each record"),
    ("--jitter-ms", non_negative_float, 0.0, "MS",
     "trace burst overlay: a record's clones arrive within this many ms"),
    ("--time-scale", positive_float, 1.0, "F", "trace: stretch (>1) or compress (<1) time"),
    ("--limit", at_least(1), None, "N", "trace: replay only the first N records"),
)
_CLUSTER: tuple[Option, ...] = (
    ("--replicas", at_least(1), 4, "N", "replicas"),
    ("--cache-blocks", at_least(0), 65536, "N", "prefix cache per replica, in engine blocks"),
    ("--engine-block-size", at_least(1), None, "B",
     "engine KV block size in tokens (default: 16; 512 for a trace)"),
    ("--prefill-us-per-token", non_negative_float, 100.0, "US",
     "prefill time per uncached prompt token, in microseconds"),
    ("--decode-ms-per-step", non_negative_float, 25.0, "MS",
     "time of one continuous-batching iteration, in ms"),
)
_ROUTERS: tuple[Option, ...] = (
    ("--index-lag-ms", non_negative_float, 10.0, "MS",
     "approx: a routing decision reaches the prefix index this late"),
    ("--window-ms", at_least(1), 100, "MS", "burst: the batch window T, 1..10000 ms"),
    ("--k", int, -1, "K",
     "burst: the most members of one group per replica; -1 keeps a group together"),
    ("--block-size", at_least(1), None, "B",
     "burst: the router's block size in tokens (default: 64; 512 for a trace)"),
    ("--max-prefix-tokens", at_least(0), 0, "N",
     "burst: the most prompt tokens in a prefix key; 0 means 2048 blocks"),
    ("--min-colocate-blocks", at_least(0), 0, "N",
     "burst: different prompts sharing at least N leading blocks are co-located (and a lone "
     "request gets an affinity); 0 co-locates identical prompts only"),
    ("--max-batch-size", int, 1000, "N",
     "burst: the most requests one window's batch takes (-1: no cap; see docs/router.md for "
     "what happens to the next one)"),
)
# fmt: on


def register_router(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "router",
        help="baseline vs burst prefix-affinity routing on a simulated cluster",
        description=(
            "Simulate N replicas (each with a prefix cache and a continuous-batching cost "
            "model) under a GRPO rollout workload or a replayed Mooncake trace, once with the "
            "baseline router and once with the burst router in front of it, and print the "
            "workload, the settings and both results side by side."
        ),
    )
    add_options(p.add_argument_group("workload (GRPO rollouts unless --trace)"), _WORKLOAD)
    add_options(p.add_argument_group("cluster"), _CLUSTER)
    b = p.add_argument_group("routers")
    b.add_argument(
        "--baseline",
        choices=("approx", "least-loaded"),
        default="approx",
        help="the baseline router; also the burst router's fallback",
    )
    add_options(b, _ROUTERS)
    b.add_argument(
        "--full-batch",
        choices=("no_affinity", "seal_early"),
        default="no_affinity",
        help="burst: an arrival at a full batch gets no affinity and is routed by the baseline "
        "while the batch seals on its timer (no_affinity, as llm-d), or seals the batch and "
        "opens the next one (seal_early, our deviation)",
    )
    b.add_argument(
        "--balance-by",
        choices=("requests", "tokens"),
        default="requests",
        help="burst: spread groups over replicas by their running requests, or by their "
        "uncached prefix tokens",
    )
    add_options(p, [("--seed", int, 0, "N", "workload and tie-break seed")])
    add_options(p, [("--json", output_file, None, "FILE", "also write the results as JSON here")])
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_router, parser=p)


def _workload(args: argparse.Namespace) -> Workload:
    import random

    from prefixflight.sim import grpo_workload, trace_workload

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
    import random

    from prefixflight.core import BurstRouter, ReplicaLoad
    from prefixflight.core.routing import (
        ApproxPrefixRouter,
        BurstAffinityRouter,
        LeastLoadedRouter,
    )

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
    """The side-by-side table, as llm-d's burst prefix-affinity PR prints it."""
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


def describe(args: argparse.Namespace, workload: Workload, cluster: ClusterConfig,
             burst: BurstConfig) -> str:  # fmt: skip
    """The workload and the settings a run used, as the lines printed above its table."""
    d = workload.description
    if d.get("kind") == "grpo":
        what = (
            f"workload: GRPO rollouts, {d['steps']} steps x {d['prompts_per_step']} prompts x "
            f"{d['samples']} samples = {d['requests']} requests, seed {args.seed};\n"
            f"  prompts {d['prompt_tokens'][0]}-{d['prompt_tokens'][1]} tokens (shared prefix "
            f"{d['shared_prefix_tokens']}), outputs {d['output_tokens'][0]}-"
            f"{d['output_tokens'][1]}, each step within {d['burst_s'] * 1e3:g} ms"
        )
    else:
        what = (
            f"workload: trace {args.trace}, {d['records']} records x {d['clones']} clones = "
            f"{d['requests']} requests, seed {args.seed};\n  clones within "
            f"{d['jitter_s'] * 1e3:g} ms, time x {d['time_scale']:g}"
        )
    lines = [
        what,
        f"cluster: {cluster.replicas} replicas, {cluster.cache_capacity_blocks} cache blocks "
        f"of {cluster.engine_block_size} tokens each,\n  prefill "
        f"{cluster.prefill_s_per_token * 1e6:g} us/token, decode step "
        f"{cluster.decode_s_per_step * 1e3:g} ms",
        f"baseline router: {args.baseline}"
        + (f" (index lag {args.index_lag_ms:g} ms)" if args.baseline == "approx" else ""),
        f"burst router: window {burst.window_ms} ms, k {burst.max_per_replica}, blocks of "
        f"{burst.block_size} tokens, max prefix tokens "
        f"{burst.max_prefix_tokens_to_match},\n  min colocate blocks "
        f"{burst.min_colocate_blocks}, max batch size {burst.max_batch_size} "
        f"({burst.full_batch} when full), balance by {burst.balance_by}",
    ]
    return "\n".join(lines)


def run_router(args: argparse.Namespace) -> int:
    from prefixflight.core import BurstConfig
    from prefixflight.core.routing import ApproxPrefixConfig
    from prefixflight.sim import ClusterConfig, simulate_cluster

    route_block = args.block_size if args.block_size is not None else (
        512 if args.trace else 64
    )  # fmt: skip
    if args.engine_block_size is None:  # a trace's hash ids are per 512-token block
        args.engine_block_size = route_block if args.trace else 16
    with usage_errors(args.parser):  # flag values the configurations reject
        cluster = ClusterConfig(
            replicas=args.replicas,
            cache_capacity_blocks=args.cache_blocks,
            engine_block_size=args.engine_block_size,
            prefill_s_per_token=args.prefill_us_per_token / 1e6,
            decode_s_per_step=args.decode_ms_per_step / 1000.0,
        )
        burst_config = BurstConfig(
            window_ms=args.window_ms,
            max_per_replica=args.k,
            block_size=route_block,
            max_prefix_tokens_to_match=args.max_prefix_tokens,
            min_colocate_blocks=args.min_colocate_blocks,
            max_batch_size=args.max_batch_size,
            full_batch=args.full_batch,
            balance_by=args.balance_by,
        )
        approx = ApproxPrefixConfig(index_lag=args.index_lag_ms / 1000.0)
        if not args.trace:
            workload = _workload(args)
    if args.trace:  # the trace is input data: its errors exit 1
        workload = _workload(args)
    base_router, burst_router = build_routers(
        args.baseline, cluster, burst_config, approx, args.seed
    )
    base = simulate_cluster(workload, base_router, cluster, name=args.baseline)
    burst = simulate_cluster(workload, burst_router, cluster, name=f"burst+{args.baseline}")
    text = describe(args, workload, cluster, burst_config) + "\n\n"
    if workload.description.get("kind") == "grpo":
        text += format_table(base, burst, "G-sample groups", "step time")
    else:  # a trace's "step" is one record and its clones
        text += format_table(base, burst, "clone groups", "group latency")
    write_stdout(text + "\n")
    if args.json:
        import json

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
                    "block_size_tokens": burst_config.block_size,
                    "max_prefix_tokens_to_match": burst_config.max_prefix_tokens_to_match,
                    "min_colocate_blocks": burst_config.min_colocate_blocks,
                    "max_batch_size": burst_config.max_batch_size,
                    "full_batch": burst_config.full_batch,
                    "balance_by": burst_config.balance_by,
                },
            },
        }
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
        if sys.stderr is not None:
            print(f"wrote {args.json}", file=sys.stderr)
    return 0
