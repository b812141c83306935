"""``prefixflight replay TRACE``: the report of the S3-FIFO prefix-cache replay task, as JSON."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from prefixflight.core import ConfigError, ReplayConfig, replay

from ._args import (
    POLICY_CHOICES,
    Option,
    add_options,
    at_least,
    eviction_policy,
    output_file,
    ratio,
    usage_errors,
)
from ._io import read_trace, write_atomic, write_stdout
from ._progress import progress

__all__ = ["load_config", "register", "replay_options", "run"]

_MISSING_CAPACITY = "--capacity-blocks is required (or cache_capacity_blocks in --config)"


def _default(name: str) -> str:
    """The `ReplayConfig` default of a field, for the help (flags default to None so that a
    --config file can fill in what they leave out)."""
    return f" (default: {getattr(attrs.fields(ReplayConfig), name).default})"


# (flag, type, metavar, help, the ReplayConfig field)
_REPLAY_SETTINGS = (
    ("--block-size", at_least(1), "B", "tokens per block", "block_size"),
    ("--small-ratio", ratio, "F", "S3FIFO: the small queue's share of the capacity, in [0, 1]",
     "small_ratio"),
    ("--max-freq", at_least(0), "N", "S3FIFO: the cap of a block's access frequency", "max_freq"),
    ("--ghost-admit-freq", at_least(0), "N",
     "S3FIFO: the frequency a ghost hit enters the main queue with, <= --max-freq",
     "ghost_admit_freq"),
)  # fmt: skip


def replay_options(*, defaults_in_help: bool) -> list[Option]:
    """The flags of `ReplayConfig`'s block size and S3FIFO settings (replay and sweep), with
    its defaults as the flags' defaults, or only in the help (``replay``, whose --config fills
    in what the flags leave out)."""
    fields = attrs.fields(ReplayConfig)
    if defaults_in_help:
        return [(f, t, None, m, h + _default(n)) for f, t, m, h, n in _REPLAY_SETTINGS]
    return [(f, t, getattr(fields, n).default, m, h) for f, t, m, h, n in _REPLAY_SETTINGS]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a Mooncake trace through S3FIFO or LRU and print the report",
        description=(
            "Replay a Mooncake FAST'25 trace (a path, a .gz file, '-' for stdin, or "
            "bundled:conversation / bundled:synthetic) and print one JSON report. Flags "
            "override --config. Exit status: 0 ok, 1 bad input data, 2 usage error."
        ),
    )
    p.add_argument("trace", metavar="TRACE", help="a path, a .gz file, '-' (stdin) or bundled:NAME")
    p.add_argument(
        "--policy", type=eviction_policy, default=None, help=POLICY_CHOICES + _default("policy")
    )
    add_options(
        p,
        [
            ("--capacity-blocks", at_least(0), None, "N",
             "cache capacity in blocks (required, here or in --config)"),
            *replay_options(defaults_in_help=True),
        ],
    )  # fmt: skip
    p.add_argument(
        "--config",
        metavar="FILE",
        help="JSON object with any of policy, cache_capacity_blocks, block_size, "
        "small_ratio, max_freq, ghost_admit_freq (UTF-8, a byte order mark is allowed)",
    )
    p.add_argument("--per-request", action="store_true", help="add the per-request list")
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip bad lines (bad JSON, bad UTF-8, bad fields) and report skipped_lines",
    )
    p.add_argument(
        "-o",
        "--output",
        type=output_file,
        metavar="FILE",
        help="write the JSON here, atomically (default: stdout)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run, parser=p)


def load_config(path: str) -> dict[str, Any]:
    """A JSON object from a UTF-8 file (a byte order mark is allowed); `ConfigError` naming
    the file (and the line, for bad UTF-8) otherwise."""
    import json

    from ._io import InputError

    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise InputError(f"cannot read config {path!r}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = raw[exc.start : exc.start + 1].hex()
        raise ConfigError(
            f"config {path!r} is not valid UTF-8 (line {line}, column {column}: byte 0x{bad})"
        ) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"config {path!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config {path!r} is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path!r} must be a JSON object, got {type(data).__name__}")
    return data


def run(args: argparse.Namespace) -> int:
    flags = dict(
        policy=args.policy,
        cache_capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        small_ratio=args.small_ratio,
        max_freq=args.max_freq,
        ghost_admit_freq=args.ghost_admit_freq,
    )
    if args.config:
        data = load_config(args.config)
        if args.capacity_blocks is None and "cache_capacity_blocks" not in data:
            args.parser.error(_MISSING_CAPACITY)
        try:
            config = ReplayConfig.from_mapping(data, **flags)
            config.make_policy()
        except ConfigError as exc:
            raise ConfigError(f"config {args.config!r} with the flags given: {exc}") from None
    else:
        if args.capacity_blocks is None:
            args.parser.error(_MISSING_CAPACITY)
        with usage_errors(args.parser):  # e.g. --ghost-admit-freq above --max-freq
            config = ReplayConfig.from_mapping({}, **flags)
            config.make_policy()
    with read_trace(args.trace, skip_invalid=args.skip_invalid) as reader:
        records = progress(reader, desc="replay", unit="req", quiet=args.quiet)
        report = replay(records, config, per_request=args.per_request)
        if args.skip_invalid:
            report = attrs.evolve(report, skipped_lines=reader.skipped_lines)
    text = report.to_json() + "\n"
    if args.output:
        write_atomic(args.output, text)
    else:
        write_stdout(text)
    return 0
