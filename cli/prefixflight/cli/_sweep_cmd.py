"""``prefixflight sweep TRACE --capacities LIST|auto``: the exact token hit rate at each
capacity of the list (``auto``: log-spaced up to the trace's distinct block count), per policy.

LRU runs all the capacities in one pass over the trace (Mattson's stack distances,
`prefixflight.core.cache.LRUCurve`). S3FIFO has no stack property, so each capacity is its own
replay; they run in parallel worker processes, each streaming the trace itself.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from prefixflight.core import PrefixflightError, ReplayConfig, UsageError, replay
from prefixflight.core._extras import missing_extra
from prefixflight.core.cache import POLICIES, CurvePoint, LRUCurve, auto_capacities

from ._args import (
    POLICY_CHOICES,
    add_options,
    at_least,
    eviction_policy,
    output_file,
    usage_errors,
)
from ._io import atomic_path, read_trace, write_atomic, write_stdout
from ._progress import progress
from ._replay_cmd import replay_options

__all__ = ["format_table", "parse_capacities", "plot", "register", "run", "sweep"]


def parse_capacities(text: str) -> tuple[int, ...] | None:
    """``"auto"`` -> None; ``"256,512,1024"`` -> ascending distinct capacities."""
    if text.strip().lower() == "auto":
        return None
    caps: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid capacity {part!r} in {text!r} (want ints >= 0 or 'auto')"
            ) from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"capacity must be >= 0, got {value}")
        caps.add(value)
    return tuple(sorted(caps))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep",
        help="exact token hit rate at the cache capacities you list, for S3FIFO and LRU",
        description=(
            "Replay a Mooncake trace at each cache capacity of --capacities (a list, or auto: "
            "about 24 log-spaced capacities up to the trace's distinct block count) and print "
            "the exact token hit rate per policy. LRU computes all the capacities in one pass "
            "(stack distances); S3FIFO runs one replay per capacity in parallel processes."
        ),
    )
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="a path, a .gz file, or bundled:conversation / bundled:synthetic",
    )
    p.add_argument(
        "--policy",
        type=eviction_policy,
        action="append",
        dest="policies",
        default=None,
        help=f"{POLICY_CHOICES}; repeat for both (default: both)",
    )
    p.add_argument(
        "--capacities",
        type=parse_capacities,
        required=True,
        metavar="LIST",
        help="comma-separated capacities in blocks, or 'auto': about 24 log-spaced from 16 "
        "blocks up to the trace's distinct block count (where LRU stops evicting)",
    )
    add_options(p, replay_options(defaults_in_help=False))
    p.add_argument(
        "-j",
        "--jobs",
        type=at_least(1),
        default=None,
        metavar="N",
        help="worker processes for S3FIFO (default: the CPU count)",
    )
    p.add_argument("--json", type=output_file, metavar="FILE", help="write the curves as JSON here")
    p.add_argument(
        "--plot",
        type=output_file,
        metavar="FILE.png",
        help="draw hit rate versus capacity, .png, .pdf or .svg (needs the 'plot' extra: "
        "matplotlib)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run, parser=p)


def _count_distinct(trace: str, quiet: bool) -> int:
    seen: set[int] = set()
    with read_trace(trace) as reader:
        for rec in progress(reader, desc="count blocks", unit="req", quiet=quiet):
            seen.update(rec.hash_ids)
    return len(seen)


def _lru_points(
    trace: str, capacities: Sequence[int], block_size: int, quiet: bool
) -> tuple[CurvePoint, ...]:
    curve = LRUCurve(capacities, block_size)
    with read_trace(trace) as reader:
        curve.feed(progress(reader, desc="lru (all capacities)", unit="req", quiet=quiet))
    return curve.points()


def _replay_point(trace: str, config: ReplayConfig) -> CurvePoint:
    """One replay at one capacity (runs in a worker process)."""
    try:
        with read_trace(trace) as reader:
            report = replay(reader, config)
    except PrefixflightError as exc:  # some subclasses do not pickle back to the parent
        raise UsageError(str(exc)) from None
    return CurvePoint(
        capacity=config.cache_capacity_blocks,
        total_requests=report.total_requests,
        total_prompt_tokens=report.total_prompt_tokens,
        total_hit_tokens=report.total_hit_tokens,
        final_cache_blocks=report.final_cache_blocks,
    )


def _replay_points(
    trace: str, configs: Sequence[ReplayConfig], jobs: int, quiet: bool
) -> tuple[CurvePoint, ...]:
    """One replay per capacity (the configs share their policy), in parallel processes."""
    desc = configs[0].policy if configs else ""
    if jobs <= 1 or len(configs) <= 1:
        points = progress(
            (_replay_point(trace, c) for c in configs),
            desc=desc,
            unit="capacity",
            total=len(configs),
            quiet=quiet,
        )
        return tuple(points)
    from concurrent.futures import ProcessPoolExecutor, as_completed

    by_capacity: dict[int, CurvePoint] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, len(configs))) as pool:
        futures = [pool.submit(_replay_point, trace, c) for c in configs]
        for fut in progress(
            as_completed(futures), desc=desc, unit="capacity", total=len(futures), quiet=quiet
        ):
            point = fut.result()
            by_capacity[point.capacity] = point
    return tuple(by_capacity[c.cache_capacity_blocks] for c in configs)


def sweep(
    trace: str,
    policies: Sequence[str],
    capacities: Sequence[int] | None,
    *,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    ghost_admit_freq: int = 0,
    jobs: int | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Compute the curves; return the JSON document
    ``{"trace", "capacities", "curves": {policy: [point, ...]}}``."""
    if trace == "-":
        raise UsageError("sweep reads the trace more than once: give a file, not '-'")
    # validate the configuration before any long pass over the trace
    base = ReplayConfig(
        cache_capacity_blocks=0,
        block_size=block_size,
        small_ratio=small_ratio,
        max_freq=max_freq,
        ghost_admit_freq=ghost_admit_freq,
    )
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {jobs}")
    caps = (
        tuple(capacities)
        if capacities is not None
        else auto_capacities(_count_distinct(trace, quiet))
    )
    curves: dict[str, list[dict[str, Any]]] = {}
    for name in dict.fromkeys(policies):  # distinct, in the order given
        if name not in POLICIES:
            raise UsageError(f"unknown policy {name!r} (choose {POLICY_CHOICES})")
        if name == "lru":  # every capacity in one pass (stack distances)
            points = _lru_points(trace, caps, block_size, quiet)
        else:
            configs = [attrs.evolve(base, policy=name, cache_capacity_blocks=c) for c in caps]
            points = _replay_points(trace, configs, jobs or os.cpu_count() or 1, quiet)
        curves[name] = [p.to_dict() for p in points]
    return {"trace": trace, "capacities": list(caps), "curves": curves}


def format_table(doc: dict[str, Any]) -> str:
    """The curves as an aligned text table, one row per capacity."""
    policies = list(doc["curves"])
    header = ["capacity"]
    for policy in policies:
        header += [f"{policy} hit rate", f"{policy} hit tokens", f"{policy} blocks"]
    rows = [header]
    for i, cap in enumerate(doc["capacities"]):
        row = [str(cap)]
        for policy in policies:
            point = doc["curves"][policy][i]
            row += [
                f"{100 * point['overall_hit_rate']:.3f}%",
                str(point["total_hit_tokens"]),
                str(point["final_cache_blocks"]),
            ]
        rows.append(row)
    widths = [max(len(r[j]) for r in rows) for j in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str, *, block_size: int) -> None:
    """Token hit rate versus capacity, one line per policy, log-scaled capacity axis."""
    try:
        import matplotlib
    except ImportError as exc:
        raise missing_extra("--plot", "plot", exc) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    markers = {"lru": "o", "s3fifo": "s"}
    for policy, points in doc["curves"].items():
        xs = [p["capacity"] for p in points if p["capacity"] > 0]  # log axis: skip 0
        ys = [100 * p["overall_hit_rate"] for p in points if p["capacity"] > 0]
        ax.plot(
            xs,
            ys,
            marker=markers.get(policy, "."),
            markersize=4,
            linewidth=1.6,
            label=policy.upper(),
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"cache capacity (blocks of {block_size} tokens, log scale)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"Prefix-cache token hit rate vs capacity: {Path(doc['trace']).name}")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)
    ax.legend(title="policy")
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=Path(path).suffix.lower().lstrip(".") or None)
    finally:
        plt.close(fig)


_PLOT_FORMATS = (".png", ".pdf", ".svg")


def run(args: argparse.Namespace) -> int:
    if args.plot and Path(args.plot).suffix.lower() not in _PLOT_FORMATS:
        args.parser.error(f"--plot {args.plot!r}: use a {', '.join(_PLOT_FORMATS)} file")
    if args.trace == "-":
        args.parser.error("sweep reads the trace more than once: give a file, not '-'")
    with usage_errors(args.parser):  # e.g. --ghost-admit-freq above --max-freq
        ReplayConfig(
            cache_capacity_blocks=0,
            block_size=args.block_size,
            small_ratio=args.small_ratio,
            max_freq=args.max_freq,
            ghost_admit_freq=args.ghost_admit_freq,
        ).make_policy()
    doc = sweep(
        args.trace,
        args.policies or list(POLICIES),
        args.capacities,
        block_size=args.block_size,
        small_ratio=args.small_ratio,
        max_freq=args.max_freq,
        ghost_admit_freq=args.ghost_admit_freq,
        jobs=args.jobs,
        quiet=args.quiet,
    )
    write_stdout(format_table(doc))
    if args.json:
        import json

        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot(doc, args.plot, block_size=args.block_size)
    return 0
