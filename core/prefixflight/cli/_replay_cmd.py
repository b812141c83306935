"""``prefixflight replay TRACE``: the report of the S3-FIFO prefix-cache replay task, as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefixflight.core import ConfigError, ReplayConfig, UsageError, replay

from ._io import read_trace
from ._progress import progress

__all__ = ["register", "run"]


def _policy(value: str) -> str:
    name = value.lower()
    if name not in ("s3fifo", "lru"):
        raise argparse.ArgumentTypeError(f"invalid policy {value!r} (choose s3fifo or lru)")
    return name


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a Mooncake trace through S3FIFO or LRU and print the report",
        description=(
            "Replay a Mooncake FAST'25 trace (a path, a .gz file, '-' for stdin, or "
            "bundled:conversation / bundled:synthetic) and print one JSON report."
        ),
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--policy", type=_policy, default=None, help="s3fifo (default) or lru")
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        metavar="N",
        help="cache capacity in blocks (required, here or in --config)",
    )
    p.add_argument("--block-size", type=int, default=None, metavar="B", help="default 512")
    p.add_argument("--small-ratio", type=float, default=None, help="S3FIFO small queue (0.1)")
    p.add_argument("--max-freq", type=int, default=None, help="S3FIFO freq cap (3)")
    p.add_argument(
        "--ghost-admit-freq",
        type=int,
        default=None,
        help="freq of a ghost hit admitted to main (0)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="JSON object with policy, cache_capacity_blocks, block_size, "
        "small_ratio, max_freq; flags override it",
    )
    p.add_argument("--per-request", action="store_true", help="add the per-request list")
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip bad lines and report skipped_lines instead of failing",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the JSON here (default stdout)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run, parser=p)


def _load_config(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read config {path!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"config {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path!r} must be a JSON object, got {type(data).__name__}")
    return data


def run(args: argparse.Namespace) -> int:
    data = _load_config(args.config) if args.config else {}
    if args.capacity_blocks is None and "cache_capacity_blocks" not in data:
        args.parser.error("--capacity-blocks is required (or cache_capacity_blocks in --config)")
    config = ReplayConfig.from_mapping(
        data,
        policy=args.policy,
        cache_capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        small_ratio=args.small_ratio,
        max_freq=args.max_freq,
        ghost_admit_freq=args.ghost_admit_freq,
    )
    with read_trace(args.trace, skip_invalid=args.skip_invalid) as reader:
        records = progress(reader, desc="replay", unit="req", quiet=args.quiet)
        report = replay(records, config, per_request=args.per_request)
        if args.skip_invalid:
            report = _with_skipped(report, reader.skipped_lines)
    text = report.to_json() + "\n"
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.output!r}: {exc.strerror or exc}") from None
    else:
        sys.stdout.write(text)
    return 0


def _with_skipped(report: Any, skipped: int) -> Any:
    import attrs

    return attrs.evolve(report, skipped_lines=skipped)
