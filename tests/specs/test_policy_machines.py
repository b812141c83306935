"""Our policies against the reference models, step by step; and proof the machines bite."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import prefixflight.core.cache._policies as policies_module
from prefixflight.core import LRU, S3FIFO, BlockHash, EvictionPolicy, UsageError
from prefixflight.core.cache import compiled
from prefixflight.specs import (
    CacheConformance,
    LRUConformance,
    PolicyConformance,
    PolicySemantics,
    S3FIFOConformance,
    Unsupported,
)
from prefixflight.specs._machines import s3fifo_reference

TestS3FIFO = S3FIFOConformance.TestCase
TestLRU = LRUConformance.TestCase


def _source_s3fifo() -> type[S3FIFO]:
    """S3FIFO as its source file defines it. Interpreted code cannot subclass the compiled
    build's classes, and the seeded mistake below needs a subclass; the source is the reference
    both builds share."""
    if not compiled:
        return S3FIFO
    path = Path(policies_module.__file__).with_name("_policies.py")
    spec = importlib.util.spec_from_file_location("prefixflight.core.cache._policies_source", path)
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


# -- declarations, configs and any callable ----------------------------------------------------
_QUICK = settings(
    max_examples=60,
    stateful_step_count=20,
    deadline=None,
    database=None,
    derandomize=True,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)


class _Quiet:
    """Our LRU behind an interface that reports nothing (no pins, evictions not returned)."""

    semantics = PolicySemantics(ops={"remove", "evict"}, evictions="observed")

    def __init__(self, capacity: int, *, stale: bool = False) -> None:
        self.inner = LRU(capacity)
        self.stale = stale

    def access(self, blocks: Iterable[BlockHash]) -> None:
        for b in blocks:
            if not (self.stale and b in self.inner):  # stale: a hit does not refresh recency
                self.inner.access([b])

    def evict(self) -> None:
        self.inner.evict()

    def remove(self, block: BlockHash) -> None:
        self.inner.remove(block)

    def resident(self) -> frozenset[BlockHash]:
        return self.inner.resident()

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, block: object) -> bool:
        return block in self.inner


def test_observed_evictions_and_declared_ops_pass_and_still_bite() -> None:
    run_state_machine_as_test(LRUConformance.for_factory(_Quiet), settings=_QUICK)
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(
            LRUConformance.for_factory(functools.partial(_Quiet, stale=True)), settings=_QUICK
        )
    assert "left the implementation" in str(caught.value) or "resident" in str(caught.value)


def test_for_factory_takes_partials_and_lambdas_and_narrowed_configs() -> None:
    seen: list[dict[str, object]] = []

    def make(**config: object) -> S3FIFO:
        seen.append(config)
        return S3FIFO(**config)  # type: ignore[arg-type]

    machine = S3FIFOConformance.for_factory(
        lambda **c: make(**c), configs=st.just({"capacity": 4, "small_ratio": 0.5})
    )
    run_state_machine_as_test(machine, settings=_QUICK)
    assert seen and all(c == {"capacity": 4, "small_ratio": 0.5} for c in seen)
    run_state_machine_as_test(
        S3FIFOConformance.for_factory(functools.partial(S3FIFO, max_freq=3), configs=st.just(
            {"capacity": 3, "small_ratio": 0.25}
        )),
        settings=_QUICK,
    )  # fmt: skip
    cache = CacheConformance.for_factory(functools.partial(S3FIFO, max_freq=2), configs=st.just(
        {"capacity": 3, "small_ratio": 0.5, "ghost_admit_freq": 0}))  # fmt: skip
    run_state_machine_as_test(cache, settings=_QUICK)
    with pytest.raises(UsageError, match="reports evictions"):
        CacheConformance.for_factory(_Quiet)


def test_an_unsupported_config_is_discarded_not_failed() -> None:
    made: list[int] = []

    def only_even(capacity: int) -> LRU:
        if capacity % 2:
            raise Unsupported(f"odd capacity {capacity}")
        made.append(capacity)
        return LRU(capacity)

    run_state_machine_as_test(LRUConformance.for_factory(only_even), settings=_QUICK)
    assert made and all(c % 2 == 0 for c in made)


def test_the_when_full_variant_reads_like_s3fifo_c() -> None:
    """libCacheSim's flow: nothing is evicted before the cache is full (a full small queue
    overflows into main); a small queue of one block admits nothing; promotion at 2."""
    sem = PolicySemantics(
        ops={"remove", "evict"}, sizing="floor", promote_at=2, small_queue="when-full",
        min_small_blocks=2, main_evictions="drop", on_promote="reset",
    )  # fmt: skip
    ref = s3fifo_reference({"capacity": 8, "small_ratio": 0.25}, sem)
    assert ref.access([0, 1, 2]) == [] and ref.resident() == {0, 1, 2}
    assert [h for h, _ in ref.small_queue()] == [0, 1] and ref.main_queue() == ((2, 0),)
    tiny = s3fifo_reference({"capacity": 2, "small_ratio": 0.5}, sem)
    assert tiny.access([0]) == [] and tiny.resident() == frozenset()
    warm = s3fifo_reference({"capacity": 3, "small_ratio": 0.75}, sem)
    warm.access([0, 0])
    assert warm.evict() == 0  # freq 1 < 2: ghosted, not promoted
    assert warm.ghost_queue() == (0,)


def test_declarations_name_the_bad_value() -> None:
    with pytest.raises(UsageError, match="small_queue must be one of"):
        PolicySemantics(small_queue="lazy")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="without pins"):
        PolicySemantics(small_queue="when-full")
    with pytest.raises(UsageError, match="min_small_blocks > 1"):
        PolicySemantics(ops={"remove"}, min_small_blocks=2)
