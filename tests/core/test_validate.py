"""The one validation layer: its rules, its messages, and that the core has no other."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import prefixflight.core
import prefixflight.sim
from prefixflight.core import ConfigError, UsageError
from prefixflight.core.validate import (
    check_block_hashes,
    check_choice,
    check_instance,
    check_name,
    check_number,
    is_int,
    is_real,
)


def test_an_int_and_a_number_are_never_a_bool() -> None:
    assert [is_int(v) for v in (0, -3, 2**70, True, 1.0, "1", None)] == [
        *(True, True, True),
        *(False, False, False, False),
    ]
    assert [is_real(v) for v in (0, 1.5, math.nan, math.inf, False, "1.0", None)] == [
        *(True, True, True, True),
        *(False, False, False),
    ]


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"minimum": 0}, -1, "x must be a number >= 0, got -1"),
        ({"minimum": 0}, math.nan, "x must be a number >= 0, got nan"),
        ({"minimum": 0}, True, "x must be a number >= 0, got True"),
        ({"above": 0, "finite": True}, 0, "x must be a finite number > 0, got 0"),
        ({"minimum": 0, "finite": True}, math.inf, "x must be a finite number >= 0, got inf"),
        ({}, "3", "x must be a number, got '3'"),
    ],
)
def test_check_number_names_the_rule_and_the_value(
    kwargs: dict[str, object], value: object, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_number("x", value, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_check_number_returns_a_float_and_takes_the_error_type() -> None:
    assert check_number("x", 3, minimum=0) == 3.0
    assert type(check_number("x", 3, minimum=0)) is float
    with pytest.raises(UsageError) as info:
        check_number("x", -1, minimum=0, error=UsageError)
    assert type(info.value) is UsageError


def test_check_choice_lists_every_choice() -> None:
    assert check_choice("mode", "b", ("a", "b")) == "b"
    with pytest.raises(ConfigError, match=r"^mode must be 'a' or 'b', got 'c'$"):
        check_choice("mode", "c", ("a", "b"))
    with pytest.raises(ConfigError, match=r"^mode must be 'a', 'b' or 'c', got \['a'\]$"):
        check_choice("mode", ["a"], ("a", "b", "c"))


def test_check_name_check_instance_and_block_hashes() -> None:
    assert check_name("replica name", "r0") == "r0"
    for bad in ("", 3, None):
        with pytest.raises(UsageError, match="replica name must be a non-empty str"):
            check_name("replica name", bad)
    check_instance("namespace", b"x", (str, bytes))
    with pytest.raises(ConfigError, match=r"^namespace must be a str or bytes, got 1$"):
        check_instance("namespace", 1, (str, bytes))
    assert check_block_hashes(iter([1, (2, 3)])) == (1, (2, 3))  # a one-shot iterator is kept
    with pytest.raises(UsageError, match="blocks must be a sequence of block hashes"):
        check_block_hashes("abc")
    with pytest.raises(UsageError, match="sequence of hashable block hashes"):
        check_block_hashes([[1]])  # type: ignore[list-item]


def _sources() -> list[Path]:
    roots = [Path(prefixflight.core.__file__).parent, Path(prefixflight.sim.__file__).parent]
    return sorted(p for root in roots for p in root.rglob("*.py") if p.name != "validate.py")


def test_no_hand_written_type_rule_outside_the_validation_layer() -> None:
    """``isinstance(v, bool)`` (the "an int is not a bool" rule) appears only in
    core/validate.py: every other module of the core and the simulations asks it."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
                and isinstance(node.args[1], ast.Name)
                and node.args[1].id == "bool"
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert len(_sources()) > 20
    assert found == []
