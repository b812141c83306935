"""``prefixflight`` command line: one sub-command per module, registered below.

Exit status: 0 ok, 1 bad input data (or an output that cannot be written), 2 usage error
(argparse's own, and any invalid flag value), 130 interrupted. Every error is one line on
stderr, never a traceback. Commands import what only they need inside their ``run``, so
start-up pays for the core and argparse, not for torch, asyncio or process pools.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import cast

from prefixflight.core import PrefixflightError

from . import _bench_cmd, _demo_cmd, _replay_cmd, _serve_cmd, _simulate_cmd, _sweep_cmd
from ._args import Parser, VersionAction
from ._io import OutputError, write_stdout

__all__ = ["main"]

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

COMMANDS: tuple[Register, ...] = (
    _replay_cmd.register,
    _simulate_cmd.register,
    _sweep_cmd.register,
    _bench_cmd.register,
    _demo_cmd.register,
    _serve_cmd.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="prefixflight",
        description="Prefix caching done exactly: replay traces, simulate, benchmark.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", required=True),
    )
    for register in COMMANDS:
        register(sub)
    return parser


def _silence_stdout() -> None:
    """After stdout failed, point it at /dev/null so the interpreter's final flush of what is
    still buffered cannot fail again (the recipe of Python's signal docs for SIGPIPE)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status (0 ok, 1 bad input, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    leaf = getattr(args, "parser", None)  # the sub-command's own parser, if it set one
    name = leaf.prog if isinstance(leaf, argparse.ArgumentParser) else parser.prog
    try:
        status: int = args.func(args)
        if sys.stdout is not None:
            write_stdout("")  # flush now, while a failure can still be reported
    except PrefixflightError as exc:
        if isinstance(exc, OutputError):
            _silence_stdout()
        _error(name, str(exc))
        return 1
    except BrokenPipeError:  # e.g. piped into head: the reader has what it wanted
        _silence_stdout()
        return 0
    except OSError as exc:  # stdout on a full device, and anything else the OS refuses
        _silence_stdout()
        _error(name, f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else ""))
        return 1
    except RecursionError:
        _error(name, "input nested too deeply")
        return 1
    except KeyboardInterrupt:
        _error("prefixflight", "interrupted")
        return 130
    return status


def _error(name: str, message: str) -> None:
    if sys.stderr is not None:
        with contextlib.suppress(OSError):
            print(f"{name}: error: {message}", file=sys.stderr)
