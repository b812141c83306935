"""The one validation layer: every component checks its inputs with these, so one rule has
one place (a time is finite everywhere, a token id is an int64 everywhere). It is public so
that the simulations, specs, backends and servers, and an engine's own adapter, check their
inputs by the same rules and raise the same errors.

Plain checks (``check_*``) return the value or raise with the offending value named; the
``*_field`` factories wrap them as attrs validators for config and event classes. A renamed
parameter keeps its old name working for a while, with a DeprecationWarning: `renamed` for a
function's keyword, `renamed_attribute` for the attribute, `deprecated_alias` for an attrs
class's field.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NoReturn, TypeAlias, TypeGuard, TypeVar, cast

from ._errors import ConfigError, UsageError

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "CheckedFloat",
    "CheckedInt",
    "assert_never",
    "check_block_hashes",
    "check_choice",
    "check_instance",
    "check_int",
    "check_name",
    "check_number",
    "check_ratio",
    "check_request_id",
    "check_time",
    "check_token_ids",
    "choice_field",
    "deprecated_alias",
    "instance_field",
    "int_field",
    "is_int",
    "is_real",
    "number_field",
    "optional_int_field",
    "ratio_field",
    "renamed",
    "renamed_attribute",
    "request_id_field",
    "time_field",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


# Annotate a public parameter with these (not ``int``/``float``) when the function checks it
# with `check_int`/`check_ratio` and is compiled by the optional mypyc build
# (docs/performance.md): mypyc converts an ``int`` argument at the call boundary (True becomes
# 1, 2.0 raises TypeError before the check runs), while a union is passed as the caller's
# object, so both builds reject the same inputs with the same error. To a type checker they
# mean exactly ``int`` and ``float`` (bool is an int, an int is accepted as a float).
CheckedInt: TypeAlias = int | bool
CheckedFloat: TypeAlias = float | int
Validator = Callable[[Any, Any, Any], None]
_T = TypeVar("_T")
_C = TypeVar("_C", bound=type)


def is_int(value: object) -> TypeGuard[int]:
    """An int and not a bool: what every check here means by "an int" (for callers that
    raise an error of their own, such as the trace parser's `TraceFormatError`)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float]:
    """An int or a float and not a bool: what every check here means by "a number"."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[UsageError] = ConfigError,
) -> int:
    """``value`` if it is an int (not a bool) within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum}, got {value!r}")
    return value


def check_ratio(name: str, value: object, *, error: type[UsageError] = ConfigError) -> float:
    """``value`` as a float if it is a real number within [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise error(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    above: float | None = None,
    finite: bool = False,
    error: type[UsageError] = ConfigError,
) -> float:
    """``value`` as a float if it is a real number (finite if ``finite``), at least
    ``minimum`` or greater than ``above``; NaN passes no bound."""
    if not (
        is_real(value)
        and (not finite or math.isfinite(value))
        and (minimum is None or value >= minimum)
        and (above is None or value > above)
    ):
        kind = "a finite number" if finite else "a number"
        bound = "" if minimum is None else f" >= {minimum}"
        bound += "" if above is None else f" > {above}"
        raise error(f"{name} must be {kind}{bound}, got {value!r}")
    return float(value)


def check_choice(
    name: str, value: object, choices: tuple[str, ...], *, error: type[UsageError] = ConfigError
) -> str:
    """``value`` if it is one of ``choices`` (the literal strings of a ``Literal`` type)."""
    if value not in choices:
        listed = [repr(c) for c in choices]
        either = listed[0] if len(listed) == 1 else f"{', '.join(listed[:-1])} or {listed[-1]}"
        raise error(f"{name} must be {either}, got {value!r}")
    return value


def check_name(name: str, value: object, *, error: type[UsageError] = UsageError) -> str:
    """``value`` if it is a non-empty str (a replica's name, a model's name)."""
    if not isinstance(value, str) or not value:
        raise error(f"{name} must be a non-empty str, got {value!r}")
    return value


def check_block_hashes(value: Iterable[Hashable], name: str = "blocks") -> tuple[Hashable, ...]:
    """The block hashes as a tuple of hashable values, block 0 first (a one-shot iterator is
    materialised once). A str or bytes is not a sequence of block hashes here."""
    if isinstance(value, (str, bytes)):
        raise UsageError(f"{name} must be a sequence of block hashes, got {value!r}")
    try:
        out = tuple(value)
        hash(out)  # one C-level pass: every block hash must be hashable
    except TypeError:
        raise UsageError(
            f"{name} must be a sequence of hashable block hashes, got {value!r}"
        ) from None
    return out


def check_time(
    name: str, value: object, *, after: float | None = None, error: type[UsageError] = UsageError
) -> float:
    """``value`` as a float if it is a finite real number (seconds), not before ``after``.

    Every component takes time as a value; NaN or infinity would poison every later
    comparison ("time went backwards" forever, NaN statistics), so they are rejected here.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{name} must be a finite number of seconds, got {value!r}")
    if after is not None and value < after:
        raise error(f"time went backwards: {name}={value!r} is before {after!r}")
    return float(value)


def check_request_id(name: str, value: object) -> None:
    """Request ids are the host's ints or strs (hashable, comparable for reports)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UsageError(f"{name} must be an int or a str, got {value!r}")


def check_token_ids(
    name: str,
    tokens: Iterable[object],
    *,
    vocab_size: int | None = None,
    minimum: int = INT64_MIN,
) -> tuple[int, ...]:
    """The token ids as a tuple of ints in the int64 range (and below ``vocab_size``).

    ``minimum=0`` for ids a model will index (a vocabulary starts at 0). Materialises
    ``tokens`` once, so a one-shot iterator is checked and kept, not consumed.
    """
    if isinstance(tokens, (str, bytes)):
        raise UsageError(f"{name} must be a sequence of token ids, got {tokens!r}")
    try:
        out = tuple(tokens)
    except TypeError:
        raise UsageError(f"{name} must be a sequence of token ids, got {tokens!r}") from None
    hi = INT64_MAX if vocab_size is None else vocab_size - 1
    lo = max(minimum, INT64_MIN if vocab_size is None else 0)
    if not out:
        return ()
    if set(map(type, out)) == {int}:  # the fast path: plain ints, checked in C
        ints = cast("tuple[int, ...]", out)
        if lo <= min(ints) and max(ints) <= hi:
            return ints
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or not lo <= t <= hi:
            where = f"[{lo}, {hi}]" if vocab_size is None else f"vocabulary [0, {vocab_size})"
            raise UsageError(f"{name}[{i}] = {t!r} is not a token id in the {where} range")
    return out  # type: ignore[return-value]  # every item was checked to be an int


def check_instance(
    name: str,
    value: object,
    cls: type[Any] | tuple[type[Any], ...],
    *,
    error: type[UsageError] = ConfigError,
) -> None:
    """``value`` must be an instance of ``cls``, or of one of them (an enum member, a config
    object, a str or bytes)."""
    if not isinstance(value, cls):
        names = [c.__name__ for c in cls] if isinstance(cls, tuple) else [cls.__name__]
        raise error(f"{name} must be a {' or '.join(names)}, got {value!r}")


def int_field(
    minimum: int | None = None, *, maximum: int | None = None, error: type[UsageError] = ConfigError
) -> Validator:
    """An attrs validator: `check_int` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_int(attribute.name, value, minimum=minimum, maximum=maximum, error=error)

    return check


def optional_int_field(
    minimum: int | None = None, *, maximum: int | None = None, error: type[UsageError] = ConfigError
) -> Validator:
    """An attrs validator: ``None`` or `check_int` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        if value is not None:
            check_int(attribute.name, value, minimum=minimum, maximum=maximum, error=error)

    return check


def instance_field(cls: type[Any], *, error: type[UsageError] = ConfigError) -> Validator:
    """An attrs validator: `check_instance` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_instance(attribute.name, value, cls, error=error)

    return check


def number_field(
    *,
    minimum: float | None = None,
    above: float | None = None,
    finite: bool = False,
    error: type[UsageError] = ConfigError,
) -> Validator:
    """An attrs validator: `check_number` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_number(
            attribute.name, value, minimum=minimum, above=above, finite=finite, error=error
        )

    return check


def choice_field(choices: tuple[str, ...], *, error: type[UsageError] = ConfigError) -> Validator:
    """An attrs validator: `check_choice` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_choice(attribute.name, value, choices, error=error)

    return check


def ratio_field(error: type[UsageError] = ConfigError) -> Validator:
    """An attrs validator: `check_ratio` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_ratio(attribute.name, value, error=error)

    return check


def time_field(error: type[UsageError] = UsageError) -> Validator:
    """An attrs validator: `check_time` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_time(attribute.name, value, error=error)

    return check


def request_id_field() -> Validator:
    """An attrs validator: `check_request_id` under the attribute's name."""

    def check(_inst: object, attribute: Any, value: object) -> None:
        check_request_id(attribute.name, value)

    return check


# -- renamed parameters --------------------------------------------------------------------
def _renamed_warning(owner: str, old: str, new: str, stacklevel: int) -> None:
    """Warn at the frame ``stacklevel`` above this function's caller."""
    message = f"{owner}'s {old} is now {new}; {old} will be removed"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def renamed(owner: str, old: str, old_value: _T | None, new: str, new_value: _T, given: bool) -> _T:
    """The value of a parameter that was renamed from ``old`` to ``new``: ``new_value``, or
    ``old_value`` when the caller used the old name (a DeprecationWarning naming both).
    ``given``: the caller passed ``new`` too, which is a `ConfigError` unless the two agree."""
    if old_value is None:
        return new_value
    _renamed_warning(owner, old, new, stacklevel=3)  # the frame that called the caller
    if given and new_value != old_value:
        raise ConfigError(
            f"{owner}: give {new} only, not also {old} (got {new}={new_value!r}, "
            f"{old}={old_value!r})"
        )
    return old_value


def renamed_attribute(owner: str, old: str, new: str) -> property:
    """A read-only property under the old name ``old`` of the attribute ``new``, which warns."""

    def get(self: Any) -> Any:
        _renamed_warning(owner, old, new, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: `{new}`.")


def deprecated_alias(old: str, new: str) -> Callable[[_C], _C]:
    """A class decorator for an attrs class whose field ``new`` was called ``old``: its
    constructor takes ``old`` too, and the attribute ``old`` reads ``new``, each with a
    DeprecationWarning. Type checkers see the class as it is, without the old name."""

    def decorate(cls: _C) -> _C:
        init: Callable[..., None] = cls.__init__  # type: ignore[misc]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if old in kwargs:
                value = kwargs.pop(old)
                given = new in kwargs
                kwargs[new] = renamed(cls.__name__, old, value, new, kwargs.get(new, value), given)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        setattr(cls, old, renamed_attribute(cls.__name__, old, new))
        return cls

    return decorate


def assert_never(value: NoReturn) -> NoReturn:
    """`typing.assert_never` (Python 3.11+), for exhaustive matches on 3.10 too."""
    raise AssertionError(f"unhandled value: {value!r}")
