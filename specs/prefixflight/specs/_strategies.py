"""Hypothesis strategies for the foundation's inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import assume, note
from hypothesis import strategies as st

from prefixflight.core import TraceRecord

from ._declare import Unsupported

__all__ = [
    "capacity_configs",
    "draw_supported",
    "policy_configs",
    "s3fifo_configs",
    "small_ratios",
    "trace_records",
    "traces",
]

T = TypeVar("T")
_TRIES = 25


def draw_supported(
    data: st.DataObject,
    strategy: st.SearchStrategy[T],
    make: Callable[[T], Any],
    *,
    label: str,
) -> tuple[T, Any]:
    """Draw a value and ``make(value)``, drawing again (up to 25 times) while ``make`` raises
    `Unsupported`: a factory that declines most configurations still gets examples, and
    plain Hypothesis runs never fail a health check for it. Each declined value is noted."""
    for _ in range(_TRIES):
        value = data.draw(strategy, label=label)
        try:
            return value, make(value)
        except Unsupported as exc:
            note(f"unsupported {label} {value}: {exc}")
    assume(False)  # declined 25 draws in a row: this example tests nothing
    raise AssertionError("unreachable")  # pragma: no cover


small_ratios = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 0.3333])
"""Ratios that exercise rounding: 0.5 and 0.25 hit exact halves (banker's rounding)."""


@st.composite
def s3fifo_configs(
    draw: st.DrawFn, max_capacity: int = 8, *, max_freq: int | None = None
) -> dict[str, int | float]:
    """S3FIFO keyword arguments with tiny and odd capacities (0 included), and now and then
    one of 10 to 12 blocks (where a ratio of 0.1 floors to one block).

    ``max_freq``: a fixed frequency cap (`PolicySemantics.max_freq`): the configs then have
    no ``max_freq`` key, and ``ghost_admit_freq`` stays within the cap.
    """
    small = st.integers(0, max_capacity)
    capacity = draw(small | st.integers(10, 12) if max_capacity < 10 else small)
    cap = draw(st.integers(0, 3)) if max_freq is None else max_freq
    config: dict[str, int | float] = {"capacity": capacity, "small_ratio": draw(small_ratios)}
    if max_freq is None:
        config["max_freq"] = cap
    config["ghost_admit_freq"] = draw(st.integers(0, cap))
    return config


def policy_configs(max_capacity: int = 8) -> st.SearchStrategy[dict[str, int | float]]:
    return s3fifo_configs(max_capacity)


def capacity_configs(max_capacity: int = 6) -> st.SearchStrategy[dict[str, int]]:
    """``{"capacity": n}``: the configs of the single-queue policies (LRU, FIFO, LFU, SIEVE)."""
    return st.builds(lambda capacity: {"capacity": capacity}, st.integers(0, max_capacity))


@st.composite
def trace_records(
    draw: st.DrawFn, *, block_size: int = 4, families: int = 3, max_blocks: int = 6
) -> TraceRecord:
    """One Mooncake-like request: a family's shared prefix, then a private tail.

    ``input_length`` is usually consistent with ``len(hash_ids)`` (the last block partial),
    sometimes not (users replay traces at other block sizes).
    """
    family = draw(st.integers(0, families - 1))
    shared = draw(st.integers(0, max_blocks))
    tail = draw(st.lists(st.integers(1000, 1040), max_size=max_blocks - shared))
    hash_ids = tuple(family * 100 + i for i in range(shared)) + tuple(tail)
    n = len(hash_ids)
    if n and draw(st.booleans()):
        length = (n - 1) * block_size + draw(st.integers(1, block_size))
    else:
        length = draw(st.integers(0, (n + 1) * block_size))
    return TraceRecord(input_length=length, hash_ids=hash_ids)


def traces(*, block_size: int = 4, max_size: int = 40) -> st.SearchStrategy[list[TraceRecord]]:
    """Traces of families sharing prefixes, with exact repeats mixed in."""
    base = st.lists(trace_records(block_size=block_size), max_size=max_size)
    return base.flatmap(lambda recs: st.permutations(recs + recs[: len(recs) // 2]))
