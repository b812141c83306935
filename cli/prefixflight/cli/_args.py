"""Argument parsing shared by every command: help that shows defaults, checked flag values.

An invalid flag value is a usage error: the error and a pointer to the command's ``--help``
on stderr (not the usage, which runs to 20 lines for some commands), exit 2. The value checks
below are argparse ``type=`` functions, so they run before any command starts; a constraint
between flags is checked with `usage_errors`, which turns the `ConfigError` of a
configuration built from flags into the same exit 2.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeAlias

from prefixflight.core import PrefixflightError
from prefixflight.core.cache import POLICIES

__all__ = [
    "POLICY_CHOICES",
    "Formatter",
    "Option",
    "Parser",
    "VersionAction",
    "add_options",
    "at_least",
    "eviction_policy",
    "finite_float",
    "non_negative_float",
    "output_file",
    "positive_float",
    "ratio",
    "usage_errors",
]


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """`argparse.ArgumentDefaultsHelpFormatter`, except that options without a meaningful
    default (``None``, or the ``False`` of a switch) show none, and a help that already
    names its default in its own words (``default 512``, ``auto (default)``) is left as it
    is, so that no default is shown twice."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        if action.help and _NAMES_DEFAULT.search(action.help):  # says it in its own words
            return action.help
        return super()._get_help_string(action)


_NAMES_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose help shows defaults and whose usage errors are short;
    sub-parsers inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """A usage error: ``PROG: error: MESSAGE`` and where the flags are described, exit 2."""
        self.exit(2, f"{self.prog}: error: {message}\nTry '{self.prog} --help' for the usage.\n")


class VersionAction(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("prefixflight")
        except PackageNotFoundError:  # run from a source tree that is not installed
            text = "unknown (not installed)"
        parser._print_message(f"{parser.prog} {text}\n", sys.stdout)  # stdout, as argparse's
        parser.exit()


Option: TypeAlias = tuple[str, Callable[[str], Any] | None, object, str | None, str]
"""A flag as one row of a command's option table: ``(flag, type, default, metavar, help)``;
``None`` leaves that part to argparse (a string, no default, the flag's own name)."""


def add_options(group: argparse._ActionsContainer, rows: Iterable[Option]) -> None:
    """Add every row of an option table to a parser or an argument group."""
    for flag, kind, default, metavar, text in rows:
        group.add_argument(flag, type=kind or str, default=default, metavar=metavar, help=text)


POLICY_CHOICES = " or ".join(POLICIES)
"""The registered eviction policies, for help texts: ``s3fifo or lru``."""


def eviction_policy(value: str) -> str:
    """An argparse type: a registered eviction policy name, any case."""
    name = value.lower()
    if name not in POLICIES:
        raise argparse.ArgumentTypeError(f"invalid policy {value!r} (choose {POLICY_CHOICES})")
    return name


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def port(value: str) -> int:
    """An argparse type: a TCP port, 0 (pick a free one) to 65535."""
    n = at_least(0)(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value!r}")
    return n


def finite_float(text: str) -> float:
    """An argparse type: a finite float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def ratio(text: str) -> float:
    """An argparse type: a float in [0, 1]."""
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def output_file(text: str) -> str:
    """An argparse type: a path to write (not empty, not a directory)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if text.endswith(("/", "\\")):
        raise argparse.ArgumentTypeError(f"expected a file name, got a directory {text!r}")
    return text


@contextmanager
def usage_errors(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Inside: a `PrefixflightError` (a configuration built from flags rejected its values)
    becomes a usage error of ``parser``: its message on stderr, exit 2."""
    try:
        yield
    except PrefixflightError as exc:
        parser.error(str(exc))
