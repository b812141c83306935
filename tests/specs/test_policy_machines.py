"""Our policies against the reference models, step by step; and proof the machines bite."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import prefixflight.core.cache._policies as policies_module
from prefixflight.core import LRU, S3FIFO, BlockHash, EvictionPolicy
from prefixflight.core.cache import compiled
from prefixflight.specs import (
    CacheConformance,
    LRUConformance,
    PolicyConformance,
    S3FIFOConformance,
)

TestS3FIFO = S3FIFOConformance.TestCase
TestLRU = LRUConformance.TestCase


def _source_s3fifo() -> type[S3FIFO]:
    """S3FIFO as its source file defines it. Interpreted code cannot subclass the compiled
    build's classes, and the seeded mistake below needs a subclass; the source is the reference
    both builds share."""
    if not compiled:
        return S3FIFO
    path = Path(policies_module.__file__).with_name("_policies.py")
    spec = importlib.util.spec_from_file_location(
        "prefixflight.core.cache._policies_source", path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: type[S3FIFO] = module.S3FIFO
    return cls


if TYPE_CHECKING:
    _S3FIFOSource = S3FIFO
else:
    _S3FIFOSource = _source_s3fifo()


class _MutantS3FIFO(_S3FIFOSource):  # type: ignore[misc]
    """S3FIFO with one seeded mistake: freq is reset on entry to M."""

    __slots__ = ()

    def _admit_main(self, b: BlockHash, f: int, evicted: list[BlockHash]) -> BlockHash | None:
        return super()._admit_main(b, 0, evicted)


class _MutantLRU:
    """LRU that forgets to refresh recency on a hit (FIFO)."""

    def __init__(self, capacity: int) -> None:
        self.inner = LRU(capacity)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, b: object) -> bool:
        return b in self.inner

    def access(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        out: list[BlockHash] = []
        for b in blocks:
            if b not in self.inner:
                out += self.inner.access([b])
        return out


@pytest.mark.parametrize(
    ("machine", "factory"),
    [(S3FIFOConformance, _MutantS3FIFO), (LRUConformance, _MutantLRU)],
    ids=["s3fifo-freq-reset", "lru-without-recency"],
)
def test_machine_catches_a_seeded_mistake(
    machine: type[PolicyConformance], factory: Callable[..., EvictionPolicy]
) -> None:
    """Caught deterministically: a plain AssertionError (a `Flaky`, a failure that does not
    replay, is a broken machine, not a caught mutant), under fixed examples."""
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(
            machine.for_factory(factory),
            settings=settings(
                max_examples=300,
                stateful_step_count=30,
                deadline=None,
                database=None,
                derandomize=True,
                report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.generate, Phase.shrink),
            ),
        )
    assert type(caught.value) is AssertionError, f"not a deterministic catch: {caught.value!r}"


TestCache = CacheConformance.TestCase
