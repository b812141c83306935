"""prefixflight's own engine path under `PrefixEngineConformance`: the page pool the
`Scheduler` runs on (an LRU `PrefixCache`, pins, page tables, chain-aware reclamation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from prefixflight.core import LRU, BlockHash, BlockHasher, PrefixCache
from prefixflight.core._validate import assert_never
from prefixflight.core.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixflight.core.flight._pages import PagePool, pages_for

from .._adapter import KVChange, PoolView
from .._declare import EngineSemantics
from .._engine_ref import Key

__all__ = ["PagePoolAdapter"]


@attrs.define
class _Req:
    hashes: tuple[BlockHash, ...]
    tokens: list[int]
    pages: tuple[int, ...]
    hit: int
    pinned: list[BlockHash]
    private: set[int]


class PagePoolAdapter:
    """prefixflight's `PagePool` over an LRU `PrefixCache`, as the `Scheduler` drives it:
    hits capped at ``num_tokens - 1``, blocks published when the request ends.

    ``pool_cls`` is the class built as ``pool_cls(pages, cache)`` (a drop-in replacement for
    `PagePool`: how ``prefixflight conform prefixflight --impl`` checks a fork).
    """

    semantics = EngineSemantics(
        hit_cap="n-1",
        touch="tail-first",
        capacity="shared-pool",
        orphans="removed",
        evictions="reported",
    )
    block_size = 16

    def __init__(self, pages: int, *, pool_cls: type[Any] = PagePool) -> None:
        self._pages = pages
        self._events: list[KVEvent] = []
        self._cache = PrefixCache(LRU(pages), self.block_size, event_sink=self._events.append)
        self._pool = pool_cls(pages, self._cache)
        self._hasher = BlockHasher(self.block_size)
        self._keys: dict[BlockHash, Key] = {}
        self._reqs: dict[str, _Req] = {}

    def admit(self, rid: str, tokens: Sequence[int]) -> int | None:
        bs = self.block_size
        n = len(tokens)
        hashes = self._hasher.hash_tokens(tokens)
        for i, h in enumerate(hashes):
            self._keys[h] = tuple(tokens[: (i + 1) * bs])
        got = self._pool.allocate(hashes, (n - 1) // bs, pages_for(n, 1, bs))
        if got is None:
            return None
        pages, k = got
        self._reqs[rid] = _Req(hashes, list(tokens), pages, k, list(hashes[:k]), set(pages[k:]))
        return int(k * bs)

    def finish(self, rid: str) -> None:
        req = self._reqs.pop(rid)
        kept = self._pool.publish(
            req.hashes, req.pages, req.hit, len(req.hashes), lambda a, b: req.tokens[a:b]
        )
        req.pinned.extend(req.hashes[req.hit : req.hit + len(kept)])
        req.private.difference_update(p for p in kept if p is not None)
        self._pool.release(req.pinned, req.private)

    def pool(self) -> PoolView:
        cache = self._cache
        cached: dict[int, Key] = {}
        for h in cache.policy.resident():
            page = cache.page(h)
            assert page is not None, "a cached block without a page"
            cached[page] = self._keys[h]
        held = {rid: frozenset(req.pages) for rid, req in self._reqs.items()}
        used = set(cached).union(*held.values())
        free = frozenset(range(self._pages)) - used
        counted = self._pool.free_pages
        assert len(free) <= counted, (
            f"{len(free) - counted} pages leaked: neither cached, held nor in the pool's free "
            f"list (it has {counted}, {len(free)} pages are unused)"
        )
        assert len(free) == counted, f"the pool's free list has {counted} pages, {len(free)} exist"
        return PoolView(free, cached, held)

    def events(self) -> list[KVChange]:
        out: list[KVChange] = []
        for event in self._events:
            match event:
                case BlockStored(block_hashes=hs):
                    out += [("stored", self._keys[h]) for h in hs]
                case BlockRemoved(block_hashes=hs):
                    out += [("removed", self._keys[h]) for h in hs]
                case AllBlocksCleared():
                    out.append(("cleared", None))
                case _:
                    assert_never(event)
        self._events.clear()
        return out

    def check_invariants(self) -> None:
        self._pool.check_invariants(
            (rid, req.pinned, req.private) for rid, req in self._reqs.items()
        )
