"""LRUCurve against one reference LRU replay per capacity, after every request; and proof
that the machine catches an off-by-one at the capacity boundary."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import BlockHash
from prefixflight.core.cache import CurvePoint, LRUCurve
from prefixflight.specs import LRUCurveConformance

TestLRUCurve = LRUCurveConformance.TestCase


class _OffByOne:
    """A seeded mistake at the boundary: a block counts as resident under capacity C only
    when its stack distance is *below* C (the rule is: at most C)."""

    def __init__(self, capacities: Sequence[int], block_size: int) -> None:
        self.inner = LRUCurve(capacities, block_size)
        self.capacities = tuple(capacities)
        self.block_size = block_size
        self.hits = [0] * len(self.capacities)

    def access(self, blocks: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        depths = self.inner.stack_distances(blocks)
        self.inner.access(blocks, num_tokens)
        out = []
        for i, cap in enumerate(self.capacities):
            k = 0
            while k < len(depths) and (d := depths[k]) is not None and d < cap:
                k += 1
            out.append(min(k * self.block_size, num_tokens))
            self.hits[i] += out[-1]
        return tuple(out)

    def points(self) -> list[CurvePoint]:
        return [
            attrs.evolve(p, total_hit_tokens=h)
            for p, h in zip(self.inner.points(), self.hits, strict=True)
        ]


def test_machine_catches_an_off_by_one_capacity() -> None:
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(
            LRUCurveConformance.for_factory(_OffByOne),
            settings=settings(
                max_examples=300,
                stateful_step_count=20,
                deadline=None,
                report_multiple_bugs=False,
                phases=[Phase.generate],
            ),
        )
