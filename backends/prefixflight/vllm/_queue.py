"""vLLM's free-block queue, ordered by a prefixflight eviction policy.

vLLM's `BlockPool` keeps every block with ``ref_cnt == 0`` in one ``FreeKVCacheBlockQueue``
(a doubly linked list): blocks without a hash at the head, reused first, and cached blocks
behind them in the order they were freed, so that allocation evicts the cached block
released longest ago (LRU). `PolicyQueue` has the same duck-typed surface (``popleft``,
``popleft_n``, ``remove``, ``append``, ``append_n``, ``prepend_n``, ``get_all_free_blocks``,
``iter_blocks_after``, ``num_free_blocks``) and hands out free blocks in this order:

1. blocks without a hash (stock order: freed ones first, last freed first);
2. redundant copies: vLLM keeps a second block with a hash it already caches when two
   requests compute the same block; a free copy whose hash stays cached through another
   block is reused before any real eviction;
3. the policy's victim (`EvictionPolicy.evict`) among cached blocks no running request holds;
4. blocks released with ``BlockPool.unpin_blocks`` (last resort, as in stock vLLM).

The policy's residency is exactly vLLM's set of cached hashes. It is keyed by the block hash
(so S3-FIFO's ghost remembers content, not block ids), a hash is pinned while any block
carrying it is in use, and its accesses are the hits vLLM gives (``BlockPool.touch``, also on
blocks in use) and the admissions of newly cached blocks (``cache_full_blocks``, deepest
first). A policy may evict on admission (S3-FIFO's small queue): those blocks lose their hash
at once. Eviction is chain safe: when a hash leaves the cache, its cached descendants, which
no lookup can reach any more, leave with it (``orphans_evicted``), in use or not (a block in
use loses its parent only when vLLM invalidates the parent, whose KV it was computed on).

`install` swaps the queue into a live pool and wraps the pool's methods that move hashes.
No vLLM import here: the queue reads only the blocks' and the pool's attributes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Final, final

import attrs

from prefixflight.core import CapacityError, EvictionPolicy

__all__ = ["PolicyQueue", "QueueStats", "install"]

Block = Any  # vLLM's KVCacheBlock (block_id, ref_cnt, block_hash, is_null)
Key = Hashable  # vLLM's BlockHashWithGroupId

_METHODS: Final = (
    "touch",
    "cache_full_blocks",
    "_insert_block_hash",
    "_remove_cached_block_hashes",
    "reset_prefix_cache",
)
"""The `BlockPool` methods `install` wraps (each must exist, or vLLM has changed)."""


@final
@attrs.define(kw_only=True)
class QueueStats:
    """Counters since the queue was installed."""

    hits: int = 0
    """Blocks vLLM touched with a hash (prefix-cache hits, in blocks)."""
    admitted: int = 0
    """Hashes that entered the cache."""
    copies: int = 0
    """Blocks cached under a hash another block already carries."""
    evicted: int = 0
    """Hashes the policy evicted (on allocation or on admission)."""
    orphans_evicted: int = 0
    """Cached descendants removed with an evicted ancestor."""
    redundant_reused: int = 0
    """Redundant copies handed out before any eviction."""
    refused: int = 0
    """Blocks not cached because every candidate victim was in use."""
    uncomputed_uncached: int = 0
    """Blocks of a request preempted in the step that scheduled it, uncached because no
    step computed them (the scheduler's fix of vLLM's priority-preemption finding)."""


@final
class PolicyQueue:
    """The free blocks of one vLLM `BlockPool`, in a prefixflight policy's order."""

    def __init__(
        self,
        pool: Any,
        policy: EvictionPolicy,
        *,
        refresh_on_free: bool,
        free_blocks: Sequence[Block],
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._refresh_on_free = refresh_on_free
        n = len(pool.blocks)
        self._free = [False] * n
        self.computed = [False] * n
        """Per block id: its KV was written by a step that ran (kept by the checked mode)."""
        self._fresh: deque[Block] = deque()  # free, no hash: reused first
        self._last: deque[Block] = deque()  # free, no hash, released by unpin_blocks
        self._redundant: dict[int, Block] = {}  # free copies of a hash cached elsewhere
        self._primary: dict[Key, Block] = {}  # hash -> its one free block (no copy in use)
        self._copies: dict[Key, list[Block]] = {}  # hash -> every block carrying it
        self._parent: dict[Key, Key | None] = {}
        self._children: dict[Key, set[Key]] = {}
        self._pending: list[tuple[Key, Block]] | None = None
        self._gone: list[Key] = []  # hashes whose descendants are still to evict
        self._unwinding = False
        self._taking: Block | None = None  # the block being handed out (neither free nor held)
        self.stats = QueueStats()
        for b in free_blocks:
            if b.block_hash is not None:
                raise ValueError(
                    f"block {b.block_id} is cached before the queue was installed: install "
                    "the queue before the first allocation"
                )
            self._free[b.block_id] = True
            self._fresh.append(b)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    # -- the FreeKVCacheBlockQueue surface ------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh) + len(self._redundant) + len(self._primary) + len(self._last)

    def popleft(self) -> Block:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: {self.num_free_blocks} are free")
        out: list[Block] = []
        while len(out) < n:
            b = self._take_one()
            self._free[b.block_id] = False
            self.computed[b.block_id] = False
            out.append(b)
        return out

    def remove(self, block: Block) -> None:
        """A free block is taken by a request (vLLM's ``touch`` on a hit)."""
        bid = block.block_id
        if not self._free[bid]:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        self._free[bid] = False
        key = block.block_hash
        if key is None or key not in self._copies:
            self._discard_unhashed(block)
            return
        self._redundant.pop(bid, None)
        if self._primary.get(key) is block:
            del self._primary[key]
        self._policy.pin(key)
        self._rebalance(key)

    def append(self, block: Block) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[Block]) -> None:
        """Blocks freed in eviction-priority order (the first goes first)."""
        for b in blocks:
            key = b.block_hash
            if key is None or key not in self._copies:
                self._free[b.block_id] = True
                self._last.append(b)
                continue
            self._release(b, key)

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Blocks freed to be reused first (vLLM frees blocks without a hash this way)."""
        cached = [b for b in blocks if b.block_hash is not None and b.block_hash in self._copies]
        for b in reversed(blocks):
            if b.block_hash is None or b.block_hash not in self._copies:
                self._free[b.block_id] = True
                self._fresh.appendleft(b)
        for b in cached:
            self._release(b, b.block_hash)

    def get_all_free_blocks(self) -> list[Block]:
        """Every free block: the ones reused first first; cached ones by hash age."""
        return [*self._fresh, *self._redundant.values(), *self._primary.values(), *self._last]

    def iter_blocks_after(self, cursor: Block | None) -> Iterator[Block]:
        blocks = self.get_all_free_blocks()
        start = 0
        if cursor is not None:
            for i, b in enumerate(blocks):
                if b is cursor:
                    start = i + 1
                    break
        yield from blocks[start:]

    # -- views for checks -----------------------------------------------------------------
    def is_free(self, block: Block) -> bool:
        return self._free[int(block.block_id)]

    def copies(self, key: Key) -> tuple[Block, ...]:
        """The blocks that carry ``key`` now (empty if it is not cached)."""
        return tuple(self._copies.get(key, ()))

    def cached_keys(self) -> frozenset[Key]:
        return frozenset(self._copies)

    # -- hooks (called by the wrapped BlockPool methods) ----------------------------------
    def on_touch(self, blocks: Sequence[Block]) -> None:
        """Prefix-cache hits: each cached block is one access, deepest first."""
        keys = [b.block_hash for b in reversed(blocks) if not b.is_null and b.block_hash]
        keys = [k for k in keys if k in self._copies]
        if keys:
            self.stats.hits += len(keys)
            self._evict_keys(self._policy.access(keys))

    def on_insert(self, key: Key, block: Block) -> None:
        """vLLM gave ``block`` the hash ``key``."""
        if self._pending is not None:
            self._pending.append((key, block))
        else:
            self._admit([(key, block, None)])

    def on_remove(self, block: Block, keys: Sequence[Key]) -> None:
        """vLLM took the hashes ``keys`` off ``block`` (an eviction it made, a reset of one
        block, or a promotion)."""
        for key in keys:
            copies = self._copies.get(key)
            if copies is None or block not in copies:
                continue
            copies.remove(block)
            if block is self._taking:
                pass  # handed out by `popleft_n`: neither free nor held
            elif self._free[block.block_id]:  # it stays free, without a hash: reused first
                self._redundant.pop(block.block_id, None)
                if self._primary.get(key) is block:
                    del self._primary[key]
                self._fresh.appendleft(block)
            else:
                self._policy.unpin(key)
            if copies:
                self._rebalance(key)
                continue
            del self._copies[key]
            if key in self._policy:
                self._policy.remove(key)
            self._forget_chain(key)

    def begin_caching(self) -> None:
        self._pending = []

    def end_caching(self, blocks: Sequence[Block], first: int, last: int) -> None:
        """The hashes ``cache_full_blocks`` gave (blocks ``first ..`` of a request's
        ``blocks``, up to ``last``) enter the policy, deepest first; each block's parent is
        the one before it in the request."""
        pending, self._pending = self._pending or [], None
        if not pending:
            return
        index = {blocks[i].block_id: i for i in range(first, min(last, len(blocks)))}
        entries: list[tuple[Key, Block, Key | None]] = []
        for key, b in pending:
            i = index.get(b.block_id)
            parent = blocks[i - 1].block_hash if i else None
            entries.append((key, b, parent))
        self._admit(entries[::-1])

    def on_reset(self) -> None:
        """vLLM dropped every hash (``reset_prefix_cache`` succeeded: nothing is in use)."""
        self._policy.clear()
        for b in [*self._redundant.values(), *self._primary.values()]:
            self._fresh.append(b)
        self._redundant.clear()
        self._primary.clear()
        self._copies.clear()
        self._parent.clear()
        self._children.clear()

    # -- internals ------------------------------------------------------------------------
    def _take_one(self) -> Block:
        if self._fresh:
            return self._fresh.popleft()
        if self._redundant:
            bid = next(iter(self._redundant))
            b = self._redundant.pop(bid)
            self.stats.redundant_reused += 1
            self._drop_hash(b)
            return b
        if self._primary:
            victim = self._policy.evict()
            if victim is not None:
                self.stats.evicted += 1
                b = self._primary.pop(victim)
                self._drop_hash(b)  # its orphans become fresh blocks
                return b
        if self._last:
            return self._last.popleft()
        raise RuntimeError("the free queue is out of sync with the policy: nothing to evict")

    def _drop_hash(self, block: Block) -> None:
        """Take a block's hashes out of vLLM's map (the pool emits BlockRemoved); our
        ``on_remove`` hook then forgets them. The block is no longer free here."""
        self._free[block.block_id] = False
        self._taking = block
        try:
            self._pool._maybe_evict_cached_block(block)
        finally:
            self._taking = None

    def _release(self, block: Block, key: Key) -> None:
        self._free[block.block_id] = True
        self._policy.unpin(key)
        if self._refresh_on_free:
            self._evict_keys(self._policy.access((key,)))
        self._rebalance(key)

    def _rebalance(self, key: Key) -> None:
        """A hash's free copies: one primary (the one vLLM's lookup returns first) if no
        copy is in use, the others redundant."""
        copies = self._copies.get(key)
        if not copies:
            return
        free = [b for b in copies if self._free[b.block_id]]
        primary: Block = free[0] if len(free) == len(copies) else None
        for b in free:
            if b is primary:
                self._redundant.pop(b.block_id, None)
                self._primary[key] = b
            else:
                self._redundant[b.block_id] = b
        if primary is None:
            self._primary.pop(key, None)

    def _admit(self, entries: Sequence[tuple[Key, Block, Key | None]]) -> None:
        policy = self._policy
        for key, block, parent in entries:
            copies = self._copies.get(key)
            if copies is not None:  # another block carries this hash: a copy
                copies.append(block)
                self.stats.copies += 1
                self._evict_keys(policy.access((key,)))
                if not self._free[block.block_id]:
                    policy.pin(key)
                self._rebalance(key)
                continue
            try:
                evicted = policy.access((key,))
            except CapacityError:
                self.stats.refused += 1
                self._pool._remove_cached_block_hashes(block)
                continue
            if key not in policy:  # a policy that keeps nothing
                self.stats.refused += 1
                self._pool._remove_cached_block_hashes(block)
                self._evict_keys(evicted)
                continue
            self._copies[key] = [block]
            self.stats.admitted += 1
            self._parent[key] = parent
            if parent is not None:
                self._children.setdefault(parent, set()).add(key)
            if not self._free[block.block_id]:
                policy.pin(key)
            else:
                self._rebalance(key)
            self._evict_keys(evicted)

    def _evict_keys(self, keys: Sequence[Key]) -> None:
        """Hashes the policy evicted on an access: every block carrying one is free (the
        hash was not pinned) and loses it now."""
        for key in keys:
            self.stats.evicted += 1
            for b in list(self._copies.get(key, ())):
                self._redundant.pop(b.block_id, None)
                if self._primary.get(key) is b:
                    del self._primary[key]
                self._pool._maybe_evict_cached_block(b)  # -> on_remove: b becomes fresh

    def _forget_chain(self, key: Key) -> None:
        """``key`` left the cache: unlink it, and evict its cached descendants. Iterative: a
        descendant's removal comes back here (through ``on_remove``) and only queues its own
        children, so a chain of any depth unwinds in one loop."""
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
        self._gone.append(key)
        if self._unwinding:
            return  # an outer call's loop takes it
        self._unwinding = True
        try:
            while self._gone:
                for child in list(self._children.pop(self._gone.pop(), ())):
                    self._parent[child] = None
                    blocks = self._copies.get(child)
                    if not blocks:
                        continue
                    # in use too (its parent was invalidated): the request keeps the page,
                    # uncached
                    self.stats.orphans_evicted += 1
                    for b in list(blocks):
                        self._redundant.pop(b.block_id, None)
                        if self._primary.get(child) is b:
                            del self._primary[child]
                        self._pool._maybe_evict_cached_block(b)  # -> on_remove: queues child
        finally:
            self._unwinding = False

    def _discard_unhashed(self, block: Block) -> None:
        for q in (self._fresh, self._last):
            try:
                q.remove(block)
                return
            except ValueError:
                continue
        raise RuntimeError(f"block {block.block_id} is marked free but is in no free list")


def install(pool: Any, policy: EvictionPolicy, *, refresh_on_free: bool) -> PolicyQueue:
    """Swap a `PolicyQueue` into vLLM's ``pool`` (before its first allocation) and wrap the
    pool's methods that move hashes, so that the policy sees every hit, admission and
    removal. Returns the queue."""
    missing = [m for m in _METHODS if not callable(getattr(pool, m, None))]
    if missing or not hasattr(pool.free_block_queue, "get_all_free_blocks"):
        raise RuntimeError(
            f"this vLLM's BlockPool lacks {', '.join(missing) or 'its free queue'}: "
            "prefixflight.vllm does not support it"
        )
    queue = PolicyQueue(
        pool,
        policy,
        refresh_on_free=refresh_on_free,
        free_blocks=pool.free_block_queue.get_all_free_blocks(),
    )
    touch = pool.touch
    cache_full_blocks = pool.cache_full_blocks
    insert = pool._insert_block_hash
    remove_hashes = pool._remove_cached_block_hashes
    reset = pool.reset_prefix_cache

    def touch_hook(blocks: Sequence[Block]) -> None:
        touch(blocks)
        queue.on_touch(blocks)

    def cache_full_blocks_hook(
        request: Any,
        blocks: list[Block],
        num_cached_blocks: int,
        num_full_blocks: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        queue.begin_caching()
        try:
            cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
        finally:
            queue.end_caching(blocks, num_cached_blocks, num_full_blocks)

    def insert_hook(key: Key, block: Block, *args: Any, **kwargs: Any) -> None:
        before = block.block_hash == key or pool.cached_block_hash_to_block.contain(
            key, block.block_id
        )
        insert(key, block, *args, **kwargs)
        if not before:
            queue.on_insert(key, block)

    def remove_hashes_hook(block: Block) -> list[Key]:
        removed: list[Key] = remove_hashes(block)
        if removed:
            queue.on_remove(block, removed)
        return removed

    def reset_hook(*args: Any, **kwargs: Any) -> bool:
        done: bool = reset(*args, **kwargs)
        if done:
            queue.on_reset()
        return done

    hooks: dict[str, Callable[..., Any]] = {
        "touch": touch_hook,
        "cache_full_blocks": cache_full_blocks_hook,
        "_insert_block_hash": insert_hook,
        "_remove_cached_block_hashes": remove_hashes_hook,
        "reset_prefix_cache": reset_hook,
    }
    for name, hook in hooks.items():
        setattr(pool, name, hook)
    pool.free_block_queue = queue
    return queue
