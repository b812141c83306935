"""libCacheSim's S3FIFO and LRU (its Python bindings) under `S3FIFOConformance` and
`LRUConformance`.

Runs in an environment with libcachesim (``benchmarks/peers/setup.sh`` builds one;
libcachesim 0.3.5 was checked), imported when a policy is made; libCacheSim is GPL-licensed
and never enters prefixflight's own environment. Sizes count objects (every request has
``obj_size = 1``). libCacheSim reports no evictions (its ``get`` returns hit or miss), so both
declare ``evictions="observed"``: the resident set is read back with ``find(req,
update_cache=False)`` over every id the policy has seen. Its C core can abort the process:
run these under `prefixflight.specs.isolated`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from importlib import import_module
from typing import Any

from prefixflight.core import UsageError

from .._declare import PolicySemantics, Unsupported

__all__ = ["LibCacheSimLRU", "LibCacheSimS3FIFO", "libcachesim_s3fifo_configs"]


@functools.cache
def _lcs() -> Any:
    return import_module("libcachesim")


class _LibCacheSimPolicy:
    """An `EvictionPolicy`-shaped view of one libCacheSim cache (no pins)."""

    def __init__(self, capacity: int, cache: Any) -> None:
        self._capacity = capacity
        self._cache = cache
        self._seen: set[int] = set()

    def _request(self, block: int) -> Any:
        req = _lcs().Request()
        req.obj_id = block
        req.obj_size = 1
        return req

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return int(self._cache.get_n_obj())

    def __contains__(self, block: object) -> bool:
        if not isinstance(block, int):
            return False
        return self._cache.find(self._request(block), update_cache=False) is not None

    def resident(self) -> frozenset[int]:
        return frozenset(b for b in self._seen if b in self)

    def access(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self._seen.add(b)
            self._cache.get(self._request(b))

    def evict(self) -> None:
        self._cache.evict(self._request(0))

    def remove(self, block: int) -> None:
        if block not in self:  # libCacheSim would also drop a ghost entry and report True
            raise UsageError(f"{block!r} is not resident")
        self._cache.remove(block)

    def pin_count(self, block: int) -> int:
        return 0

    def check_invariants(self) -> None:
        n, resident = len(self), len(self.resident())
        assert n == resident, f"libCacheSim counts {n} objects, {resident} are findable"
        used = self._cache.get_occupied_byte()
        assert used <= self._capacity, f"{used} objects in a cache of {self._capacity}"


class LibCacheSimS3FIFO(_LibCacheSimPolicy):
    """libCacheSim's ``S3FIFO`` for a config of `S3FIFOConformance`.

    The ghost queue is sized to the main queue's size, as the replay task's (only small-queue
    evictions enter it, and a promoted object starts over at frequency 0); ``max_freq``
    must be 3 and ``ghost_admit_freq`` 0 (libCacheSim's fixed values). Configs whose small or
    main queue would hold no block are `Unsupported`: ``S3FIFO.c``'s ``S3FIFO_init`` aborts
    the process for them. ``impl`` replaces ``libcachesim.S3FIFO`` (same arguments).
    """

    semantics = PolicySemantics(
        ops=frozenset({"remove", "evict"}),
        evictions="observed",
        sizing="floor",
        main_evictions="drop",
        on_promote="reset",
        promote_at=2,
        small_queue="when-full",
        min_small_blocks=2,
    )

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        max_freq: int = 3,
        ghost_admit_freq: int = 0,
        *,
        impl: type[Any] | None = None,
    ) -> None:
        if max_freq != 3 or ghost_admit_freq != 0:
            raise Unsupported(
                f"libCacheSim fixes max_freq=3 and ghost_admit_freq=0, got {max_freq}, "
                f"{ghost_admit_freq}"
            )
        small = int(capacity * small_ratio)
        main = capacity - small
        if small <= 0 or main <= 0:
            raise Unsupported(
                f"S3FIFO_init aborts the process for a small queue of {small} and a main "
                f"queue of {main} objects (capacity {capacity}, small_ratio {small_ratio})"
            )
        cls = impl or _lcs().S3FIFO
        cache = cls(
            capacity,
            hashpower=8,
            small_size_ratio=small_ratio,
            ghost_size_ratio=(main + 0.5) / capacity,  # a ghost of exactly `main` objects
            move_to_main_threshold=2,  # libCacheSim's default
        )
        super().__init__(capacity, cache)


class LibCacheSimLRU(_LibCacheSimPolicy):
    """libCacheSim's ``LRU`` for a config of `LRUConformance` (``impl`` replaces it)."""

    semantics = PolicySemantics(ops=frozenset({"remove", "evict"}), evictions="observed")

    def __init__(self, capacity: int, *, impl: type[Any] | None = None) -> None:
        super().__init__(capacity, (impl or _lcs().LRU)(capacity, hashpower=8))

    def evict(self) -> None:
        # LRU_evict dereferences an empty queue's tail and segfaults; the reference returns
        # None there, and so does this adapter, without calling it
        if len(self):
            super().evict()


def libcachesim_s3fifo_configs() -> Any:
    """`S3FIFOConformance` configs libCacheSim takes: capacities 2 to 12 (small queues of
    one block included: they cache nothing new), max_freq 3, ghost_admit_freq 0."""
    from hypothesis import strategies as st

    from .._strategies import small_ratios

    def config(capacity: int, ratio: float) -> dict[str, Any]:
        return {"capacity": capacity, "small_ratio": ratio, "max_freq": 3, "ghost_admit_freq": 0}

    return st.builds(config, st.integers(2, 12), small_ratios).filter(
        lambda c: 0 < int(c["capacity"] * c["small_ratio"]) < c["capacity"]
    )
