"""Adapters the bug benchmark's cases run through ``prefixflight conform --adapter``.

Each is a shipped adapter with one declaration set back to prefixflight's default, one guard
removed, or one call added, so that a documented bug becomes reachable; or an adapter for a
package the kit ships none for (the ``s3fifo`` package on PyPI). They import their engine only
when one is made; ``benchmarks/bugs/run.py`` runs them inside the release venv of their case
with this directory as the working directory (``--adapter adapters:NAME``).
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import import_module
from typing import Any

import attrs
from hypothesis import strategies as st

from prefixflight.specs import PolicySemantics, Unsupported, isolated
from prefixflight.specs.adapters import (
    LibCacheSimLRU,
    LibCacheSimS3FIFO,
    VLLMAdapter,
    VLLMSchedulerAdapter,
)


class VLLMInvalidateReusedFirst(VLLMAdapter):
    """vLLM's `KVCacheManager` with ``invalidated`` back at the default: a block that
    ``evict_blocks`` invalidated holds nothing, so it is the next page reused."""

    semantics = attrs.evolve(VLLMAdapter.semantics, invalidated="reused-first")


class VLLMPriorityScheduler(VLLMSchedulerAdapter):
    """vLLM's `Scheduler` under the priority policy with ``long_prefill_token_threshold=4``
    (a long prompt is scheduled 4 tokens a step), at block size 4 (the documented example's)."""

    semantics = attrs.evolve(VLLMSchedulerAdapter.semantics, policies={"priority"}, chunking="any")
    configs = st.just(4)

    def __init__(self, limits: Any) -> None:
        super().__init__(limits, long_prefill_token_threshold=4)


class _S3FIFOUnguarded(LibCacheSimS3FIFO):
    """libCacheSim's S3FIFO at every config the machine draws (ratio 0.1 included), without
    the shipped adapter's `Unsupported` guard for a small queue of no object."""

    semantics = attrs.evolve(LibCacheSimS3FIFO.semantics, policy="s3fifo")

    def __init__(
        self, capacity: int, small_ratio: float = 0.1, max_freq: int = 3, ghost_admit_freq: int = 0
    ) -> None:
        if max_freq != 3 or ghost_admit_freq != 0:
            raise Unsupported("libCacheSim fixes max_freq=3 and ghost_admit_freq=0")
        cache = import_module("libcachesim").S3FIFO(
            capacity, hashpower=8, small_size_ratio=small_ratio
        )
        super(LibCacheSimS3FIFO, self).__init__(capacity, cache)


class _LRUUnguarded(LibCacheSimLRU):
    """libCacheSim's LRU with ``evict()`` called on an empty cache too (the shipped adapter
    skips it there)."""

    semantics = attrs.evolve(LibCacheSimLRU.semantics, policy="lru")

    def evict(self) -> None:
        self._cache.evict(self._request(0))


class _S3FIFOPrinted(LibCacheSimS3FIFO):
    """libCacheSim's S3FIFO whose invariant check also prints the cache (``print_cache()``,
    a call of its Python API that the shipped adapter never makes)."""

    semantics = attrs.evolve(LibCacheSimS3FIFO.semantics, policy="s3fifo")

    def check_invariants(self) -> None:
        super().check_invariants()
        self._cache.print_cache()


# libCacheSim's C core can abort or segfault the process: each runs in a worker process, where
# a crash is a finding (the worker imports the classes by their module-level names)
LibCacheSimS3FIFOUnguarded = isolated(_S3FIFOUnguarded)
LibCacheSimLRUUnguarded = isolated(_LRUUnguarded)
LibCacheSimS3FIFOPrinted = isolated(_S3FIFOPrinted)


class PyPIS3FIFO:
    """``S3FIFOCache`` of the ``s3fifo`` package on PyPI as an S3-FIFO policy.

    Its small queue is ``max(1, floor(capacity * ratio))`` blocks; nothing is evicted until the
    whole cache is full (then main if main is over its size, else small, as libCacheSim);
    a small-queue block is promoted at frequency 2 and keeps it; main's victims are not
    ghosted; frequencies are capped at 3 when a block is passed over. The ghost is sized to
    main. A cache of one block, where the package gives main everything, is `Unsupported`.
    """

    semantics = PolicySemantics(
        policy="s3fifo",
        ops=frozenset(),
        evictions="observed",
        sizing="floor-min-1",
        max_freq=3,
        main_evictions="drop",
        promote_at=2,
        small_queue="when-full",
    )

    def __init__(self, capacity: int, small_ratio: float, ghost_admit_freq: int) -> None:
        small = max(1, int(capacity * small_ratio))
        if capacity < 2 or small >= capacity:
            raise Unsupported(f"{capacity} blocks at {small_ratio} leave main no block")
        if ghost_admit_freq != 0:
            raise Unsupported("a block readmitted from the ghost starts at frequency 0")
        main = capacity - small
        self._cache = import_module("s3fifo").S3FIFOCache(
            capacity,
            small_size_ratio=small_ratio,
            ghost_size_ratio=(main + 0.5) / capacity,  # a ghost of exactly `main` blocks
        )

    def resident(self) -> frozenset[int]:
        return frozenset(k for k in (*self._cache._small, *self._cache._main))

    def __len__(self) -> int:
        return len(self._cache)

    def access(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b in self._cache:
                self._cache.get(b)  # a hit: counts its frequency
            else:
                self._cache.put(b, None)
