"""Hypothesis strategies for the foundation's inputs."""

from __future__ import annotations

from hypothesis import strategies as st

from prefixflight.core import TraceRecord

__all__ = ["policy_configs", "s3fifo_configs", "small_ratios", "trace_records", "traces"]

small_ratios = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 0.3333])
"""Ratios that exercise rounding: 0.5 and 0.25 hit exact halves (banker's rounding)."""


@st.composite
def s3fifo_configs(draw: st.DrawFn, max_capacity: int = 8) -> dict[str, int | float]:
    """S3FIFO keyword arguments with tiny and odd capacities (0 included)."""
    capacity = draw(st.integers(0, max_capacity))
    max_freq = draw(st.integers(0, 3))
    return {
        "capacity": capacity,
        "small_ratio": draw(small_ratios),
        "max_freq": max_freq,
        "ghost_admit_freq": draw(st.integers(0, max_freq)),
    }


def policy_configs(max_capacity: int = 8) -> st.SearchStrategy[dict[str, int | float]]:
    return s3fifo_configs(max_capacity)


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
