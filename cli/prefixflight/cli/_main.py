"""``prefixflight`` command line: one sub-command per module, registered below.

Exit status: 0 ok, 1 bad input data (or an output that cannot be written), 2 usage error
(argparse's own, and any invalid flag value), 130 interrupted. Every error is one line on
stderr, never a traceback. Commands import what only they need inside their ``run``, so
start-up pays for the core and argparse, not for torch, asyncio or process pools; and when
the first argument names a command, only that command's module is imported and registered
(its parsing, help and errors are the same as with every command registered).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import cast

from prefixflight.core import PrefixflightError

from ._args import Parser, VersionAction
from ._io import OutputError, write_stdout

__all__ = ["main"]

# command name -> the module whose ``register(subparsers)`` adds it, in the order of --help
COMMANDS = {
    "replay": "_replay_cmd",
    "simulate": "_simulate_cmd",
    "sweep": "_sweep_cmd",
    "bench": "_bench_cmd",
    "demo": "_demo_cmd",
    "serve": "_serve_cmd",
    "route": "_route_cmd",
    "conform": "_conform_cmd",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``only``, just that command (the others are not imported)."""
    parser = Parser(
        prog="prefixflight",
        description="Prefix caching done exactly: replay traces, simulate, benchmark, serve a "
        "model, route requests across engines, check an engine against the spec.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", required=True),
    )
    for name, module in COMMANDS.items():
        if only is None or name == only:
            import_module(f"{__package__}.{module}").register(sub)
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
    args_list = sys.argv[1:] if argv is None else list(argv)
    first = args_list[0] if args_list else None
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(args_list)
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
