"""``prefixflight`` command line: one sub-command per module, registered below."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from prefixflight.core import PrefixflightError

from . import _bench_cmd, _demo_cmd, _replay_cmd, _serve_ray_cmd, _simulate_cmd, _sweep_cmd

__all__ = ["main"]

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

COMMANDS: tuple[Register, ...] = (
    _replay_cmd.register,
    _simulate_cmd.register,
    _sweep_cmd.register,
    _bench_cmd.register,
    _demo_cmd.register,
    _serve_ray_cmd.register,  # temporary: `serve --replicas/--router` once `serve` exists
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixflight",
        description="Prefix caching done exactly: replay traces, simulate, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status (0 ok, 1 bad input, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except PrefixflightError as exc:
        leaf = getattr(args, "parser", None)  # the sub-command's own parser, if it set one
        name = leaf.prog if isinstance(leaf, argparse.ArgumentParser) else parser.prog
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head
        return 0
    except KeyboardInterrupt:
        print("prefixflight: interrupted", file=sys.stderr)
        return 130
    return status
