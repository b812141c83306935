"""The pages of a paged KV pool, shared by a `PrefixCache` and running requests.

`PagePool` owns ``num_pages`` page indices (``0 .. num_pages - 1``): a page is free, held by
a cached block, or private to a running request. It hands out page tables at admission,
pins the cached blocks a running request depends on, publishes computed blocks into the
cache, and reclaims pages when blocks are evicted. The `Scheduler` owns one and decides
*when*; this module decides *which pages*.

Page rules:

- A page table is handed out whole: the cached pages of the reused prefix, then private
  pages for every other position the request will write. `allocate` is the only call that
  can run out; it changes nothing when it does.
- Every cached block a running request depends on is pinned, so it is never evicted. Pins
  always cover a whole chain prefix, so an evicted block never has a pinned descendant.
- A private page is shared only once it is published. When the block is already cached
  (another request published it first), the request keeps its own page private (no double
  registration) and it is freed when the request ends.
- Reclamation is chain-aware: when a block leaves the cache, its cached descendants are
  unreachable (a lookup stops at the first miss), so they are removed too and their pages
  freed (``orphans_evicted``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import final

import attrs

from .._errors import CapacityError
from ..cache._cache import PrefixCache
from ..cache._hashing import BlockHash

__all__ = ["PageCounters", "PagePool", "pages_for"]


def pages_for(num_prompt: int, max_new: int, block_size: int) -> int:
    """Pages a request needs for its whole life: every position it computes.

    The last sampled token is never computed, so ``prompt + max_new - 1`` positions.
    """
    positions = num_prompt + max_new - 1
    return -(-positions // block_size)


@final
@attrs.define(eq=False, slots=True)
class PageCounters:
    """The pool's share of `SchedulerStats` (same names)."""

    published_blocks: int = 0
    duplicate_blocks: int = 0
    evicted_blocks: int = 0
    orphans_evicted: int = 0


@final
class PagePool:
    """Free pages, pins and cached-block parent links over one `PrefixCache`.

    The cache must be empty when the pool is made; afterwards only the pool changes it.
    """

    __slots__ = ("_cache", "_children", "_free", "_num_pages", "_parent", "_pins", "counters")

    def __init__(self, num_pages: int, cache: PrefixCache) -> None:
        self._num_pages = num_pages
        self._cache = cache
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._pins: dict[BlockHash, int] = {}  # mirror of the pins held through this pool
        self._parent: dict[BlockHash, BlockHash | None] = {}  # cached block -> parent
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self.counters = PageCounters()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pinned_blocks(self) -> int:
        """Distinct cached blocks pinned by at least one request."""
        return len(self._pins)

    # -- admission -----------------------------------------------------------------------
    def allocate(
        self, blocks: Sequence[BlockHash], max_reuse: int, total: int
    ) -> tuple[tuple[int, ...], int] | None:
        """A page table of ``total`` pages for a request whose full prompt blocks are
        ``blocks``: the cached pages of its longest resident prefix (at most ``max_reuse``
        blocks, now pinned), then private pages, evicting unpinned cached blocks if needed.

        Returns ``(pages, reused_blocks)``, or ``None`` (and nothing changed) if not enough
        pages can be freed.
        """
        cache = self._cache
        k = min(cache.lookup(blocks), max_reuse)
        hit = blocks[:k]
        need = total - k
        self._pin(hit)
        evictable = len(cache) - len(self._pins)
        if len(self._free) + evictable < need:
            self._unpin(hit)
            return None
        while len(self._free) < need:  # one at a time: orphans may free more than one page
            victim = cache.evict()
            assert victim is not None, "an unpinned block must be evictable"
            self._reclaim((victim,))
        # a reuse refreshes the blocks' recency, deepest first (all resident: no eviction)
        cache.publish(hit[::-1])
        free = self._free
        own = [free.pop() for _ in range(need)]
        cached_pages = []
        for h in hit:
            page = cache.page(h)
            assert page is not None
            cached_pages.append(page)
        return (*cached_pages, *own), k

    def release(self, pinned: Sequence[BlockHash], private: Iterable[int]) -> None:
        """A request ended: unpin its blocks and free its private pages."""
        self._unpin(pinned)
        self._free.extend(sorted(private, reverse=True))

    # -- publication ---------------------------------------------------------------------
    def publish(
        self,
        hashes: Sequence[BlockHash],
        pages: Sequence[int],
        start: int,
        upto: int,
        tokens: Callable[[int, int], Sequence[int]],
    ) -> list[int | None]:
        """Publish blocks ``start .. upto - 1`` of a request's chain and pin them.

        ``hashes`` and ``pages`` are the request's chain and page table (blocks before
        ``start`` are already published and pinned); ``tokens(a, b)`` its tokens at
        positions ``[a, b)``. Returns, for the blocks published (a prefix of the range, in
        order), the page handed to the cache, or ``None`` for a duplicate (the block was
        cached already; the request's page stays private).

        Deepest first, so that a parent is always accessed after its children: recency-based
        policies then evict a chain from its tail, never a parent before its descendants.
        If a block cannot be admitted (every victim pinned, or a policy that keeps nothing),
        the deeper blocks of this pass are taken back out (they would be unreachable) and
        the shallower ones are tried again.
        """
        cache = self._cache
        bs = cache.block_size
        while upto > start:
            done: list[tuple[BlockHash, int | None]] = []  # (block, own page or None)
            failed: int | None = None
            for j in range(upto - 1, start - 1, -1):
                h = hashes[j]
                if h in cache:  # another request published it first: keep our page private
                    cache.publish((h,))
                    self._pin((h,))
                    done.append((h, None))
                    continue
                page = pages[j]
                parent = hashes[j - 1] if j else None
                try:
                    evicted = cache.publish(
                        (h,), (page,), parent=parent, token_ids=tokens(j * bs, (j + 1) * bs)
                    )
                except CapacityError as exc:
                    self._reclaim(exc.evicted)
                    admitted = False
                else:
                    self._reclaim(evicted)
                    admitted = cache.page(h) == page
                if not admitted:
                    failed = j
                    break
                self._pin((h,))
                done.append((h, page))
                self._parent[h] = parent
                if parent is not None:
                    self._children.setdefault(parent, set()).add(h)
            if failed is None:
                counters = self.counters
                out = [own for _, own in reversed(done)]
                dups = out.count(None)
                counters.duplicate_blocks += dups
                counters.published_blocks += len(out) - dups
                return out
            self._take_back(done)
            upto = failed
        return []

    def _take_back(self, done: list[tuple[BlockHash, int | None]]) -> None:
        """Undo a partial deepest-first publication: the blocks go back to the request."""
        cache = self._cache
        for h, page in done:
            # never a duplicate: a cached block's parent is cached too, so the block that
            # failed (not cached) has no cached descendant
            assert page is not None
            self._unpin((h,))
            assert h not in self._pins and not self._children.get(h)
            removed = cache.remove(h)
            assert removed == page
            self._unlink(h)

    def withdraw(self, blocks: Iterable[BlockHash]) -> None:
        """Take cached blocks whose KV was never written (a failed step registered them) out
        of the cache with their cached descendants, deepest first, and free their pages.

        None of them may be pinned; a block already gone (taken with an ancestor) is skipped.
        """
        cache = self._cache
        children = self._children
        for block in blocks:
            if block not in cache:
                continue
            order = [block]  # the block, then its descendants (parents before children)
            for b in order:
                order.extend(children.get(b, ()))
            for b in reversed(order):
                assert b not in self._pins, f"withdrawn block {b!r} is pinned"
                page = cache.remove(b)
                assert page is not None, "every cached block holds a page"
                self._unlink(b)
                self._free.append(page)

    # -- reclamation ---------------------------------------------------------------------
    def _unlink(self, block: BlockHash) -> None:
        parent = self._parent.pop(block, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(block)
            if not siblings:
                del self._children[parent]

    def _reclaim(self, evicted: Iterable[tuple[BlockHash, int | None]]) -> None:
        """Free the pages of evicted blocks and remove their (now unreachable) descendants."""
        cache = self._cache
        free = self._free
        counters = self.counters
        for block, page in evicted:
            assert page is not None, "every cached block holds a page"
            counters.evicted_blocks += 1
            free.append(page)
            self._unlink(block)
            stack = list(self._children.pop(block, ()))
            while stack:
                child = stack.pop()
                del self._parent[child]
                stack.extend(self._children.pop(child, ()))
                if child not in cache:
                    continue  # evicted by the policy in this same batch: freed in its turn
                assert child not in self._pins, "a pinned block lost its parent"
                orphan_page = cache.remove(child)
                assert orphan_page is not None
                free.append(orphan_page)
                counters.orphans_evicted += 1

    # -- pins ----------------------------------------------------------------------------
    def _pin(self, blocks: Sequence[BlockHash]) -> None:
        self._cache.pin(blocks)
        pins = self._pins
        for b in blocks:
            pins[b] = pins.get(b, 0) + 1

    def _unpin(self, blocks: Sequence[BlockHash]) -> None:
        self._cache.unpin(blocks)
        pins = self._pins
        for b in blocks:
            c = pins[b]
            if c == 1:
                del pins[b]
            else:
                pins[b] = c - 1

    # -- checks --------------------------------------------------------------------------
    def check_invariants(
        self, holders: Iterable[tuple[object, Sequence[BlockHash], set[int]]]
    ) -> None:
        """Raise `AssertionError` unless free, cached and private pages add up and the pins
        are exactly those of ``holders`` (``(request id, pinned blocks, private pages)``)."""
        cache = self._cache
        policy = cache.policy
        resident = policy.resident()
        cached_pages: dict[int, BlockHash] = {}
        for b in resident:
            page = cache.page(b)
            assert page is not None, f"cached block {b!r} has no page"
            assert page not in cached_pages, f"page {page} is held by two blocks"
            cached_pages[page] = b
        owners: dict[int, object] = {}
        pins: dict[BlockHash, int] = {}
        for rid, pinned, private in holders:
            for page in private:
                assert page not in owners, f"page {page} is private to two requests"
                assert page not in cached_pages, f"private page {page} is also cached"
                owners[page] = rid
            for h in pinned:
                pins[h] = pins.get(h, 0) + 1
                assert h in resident, f"block {h!r} pinned by {rid!r} was evicted"
        free = self._free
        assert len(set(free)) == len(free), "a page is free twice"
        assert not set(free) & (owners.keys() | cached_pages.keys()), "a used page is free"
        total = len(free) + len(owners) + len(cached_pages)
        assert total == self._num_pages, f"pages do not add up: {total}"
        assert pins == self._pins, "pin mirror out of sync"
        for b, n_pins in pins.items():
            assert policy.pin_count(b) == n_pins, f"block {b!r} pin count differs"
        for b, parent in self._parent.items():
            assert b in resident, f"stale parent link for {b!r}"
            assert parent is None or parent in resident, f"orphan {b!r} left in the cache"
