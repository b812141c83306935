"""Small shared validators: every rejected value is named in the message."""

from __future__ import annotations

from typing import NoReturn

from ._errors import ConfigError

__all__ = ["assert_never", "check_int", "check_ratio"]


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def check_ratio(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a real number within [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ConfigError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def assert_never(value: NoReturn) -> NoReturn:
    """`typing.assert_never` (Python 3.11+), for exhaustive matches on 3.10 too."""
    raise AssertionError(f"unhandled value: {value!r}")
