"""All-capacity LRU curves: a reference (one LRU replay per capacity) and a state machine.

Run against ours, or against your own curve implementation::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import LRUCurveConformance

    run_state_machine_as_test(LRUCurveConformance.for_factory(MyCurve))

The factory is called as ``factory(capacities, block_size)`` and must offer
``access(hash_ids, input_length) -> tuple of hit tokens per capacity`` and ``points()``
(objects with ``capacity``, ``total_requests``, ``total_prompt_tokens``,
``total_hit_tokens`` and ``final_cache_blocks``). After every request the machine compares
the per-capacity hits and the totals with independent replays of `ReferenceLRU`, and, if
the implementation has ``stack_distances``, each block's depth in the recency stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixflight.core import BlockHash
from prefixflight.core.cache import LRUCurve

from ._reference import ReferenceLRU

__all__ = ["LRUCurveConformance", "ReferenceLRUCurve"]


class ReferenceLRUCurve:
    """One `ReferenceLRU` per capacity, each replaying every request (the replay task's hit
    rule)."""

    def __init__(self, capacities: Sequence[int], block_size: int) -> None:
        self.capacities = tuple(capacities)
        self.block_size = block_size
        self.caches = [ReferenceLRU(c) for c in self.capacities]
        self.unbounded = ReferenceLRU(10**12)  # the recency stack itself
        self.hits = [0] * len(self.capacities)
        self.requests = 0
        self.prompt_tokens = 0

    def access(self, blocks: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        out = []
        for i, cache in enumerate(self.caches):
            k = cache.resident_prefix(blocks)
            hit = min(k * self.block_size, num_tokens)
            cache.access(blocks)
            self.hits[i] += hit
            out.append(hit)
        self.unbounded.access(blocks)
        self.requests += 1
        self.prompt_tokens += num_tokens
        return tuple(out)

    def stack_distances(self, blocks: Sequence[BlockHash]) -> list[int | None]:
        order = self.unbounded.order()  # least recently used first
        depth = {b: len(order) - i for i, b in enumerate(order)}
        return [depth.get(b) for b in blocks]

    def totals(self) -> list[tuple[int, int, int, int, int]]:
        return [
            (c, self.requests, self.prompt_tokens, h, len(cache))
            for c, h, cache in zip(self.capacities, self.hits, self.caches, strict=True)
        ]


_BLOCKS = st.lists(st.integers(0, 14), max_size=8)


class LRUCurveConformance(RuleBasedStateMachine):
    """An all-capacity LRU curve against one reference LRU replay per capacity."""

    factory: ClassVar[Callable[[Sequence[int], int], Any]] = LRUCurve

    impl: Any
    ref: ReferenceLRUCurve

    @classmethod
    def for_factory(cls, factory: Callable[[Sequence[int], int], Any]) -> type[LRUCurveConformance]:
        """A machine that checks curves made by ``factory(capacities, block_size)``."""
        name = getattr(factory, "__name__", "custom")
        return type(f"{cls.__name__}_{name}", (cls,), {"factory": staticmethod(factory)})

    @initialize(
        capacities=st.lists(st.integers(0, 16), min_size=1, max_size=5, unique=True),
        block_size=st.sampled_from([1, 4]),
    )
    def start(self, capacities: list[int], block_size: int) -> None:
        note(f"capacities={capacities}, block_size={block_size}")
        self.impl = type(self).factory(capacities, block_size)
        self.ref = ReferenceLRUCurve(capacities, block_size)

    @rule(blocks=_BLOCKS, short=st.integers(0, 3))
    def request(self, blocks: list[int], short: int) -> None:
        num_tokens = max(0, len(blocks) * self.ref.block_size - short)
        want = self.ref.access(blocks, num_tokens)
        got = self.impl.access(blocks, num_tokens)
        assert tuple(got) == want, f"request {blocks}: impl {got!r}, reference {want!r}"

    @rule(prefix=st.integers(0, 5), blocks=_BLOCKS)
    def shared_prefix(self, prefix: int, blocks: list[int]) -> None:
        """A request that starts with a chain seen before, so hits reach every depth."""
        self.request([100 + i for i in range(prefix)] + blocks, 0)

    @invariant()
    def totals_agree(self) -> None:
        points = self.impl.points()
        got = [
            (
                p.capacity,
                p.total_requests,
                p.total_prompt_tokens,
                p.total_hit_tokens,
                p.final_cache_blocks,
            )
            for p in points
        ]
        assert got == self.ref.totals(), f"totals: impl {got}, reference {self.ref.totals()}"

    @invariant()
    def stack_distances_agree(self) -> None:
        distances = getattr(self.impl, "stack_distances", None)
        if distances is None:
            return
        probe = [*range(15), *range(100, 105)]
        assert distances(probe) == self.ref.stack_distances(probe)
