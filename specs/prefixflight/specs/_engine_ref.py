"""`ReferencePrefixEngine`: an engine's prefix cache as a plain model, page by page.

A block is named by its *key*: the prompt's tokens from the start to the block's end (so a
key names its whole chain). The model follows an `EngineSemantics` declaration: how many
tokens may hit, when computed blocks are registered, what stamps recency, what one eviction
removes, whether the cache shares its pages with running requests. It is written to be read:
slow, no indexes, every rule in one place.

Two stores: the block store (``unit="block"``: pages holding cached blocks, each with a
recency stamp and a reference count: vLLM's `BlockPool`, prefixflight's `PagePool`) and a
radix tree (``unit="node"``: nodes of page-aligned blocks inserted together, evicted leaf by
leaf: SGLang's `RadixCache`). With a declared ``policy`` the block store's evictions are the
decisions of that policy's plain reference model (`ReferenceS3FIFO`, `ReferenceLRU`, ...),
keyed by block: prefixflight's policies inside vLLM's pool.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

import attrs

from prefixflight.core import CapacityError, UsageError

from ._declare import EngineSemantics
from ._registry import MACHINES, load_object

__all__ = ["Key", "ReferencePrefixEngine", "block_keys"]

Key: TypeAlias = tuple[int, ...]
"""A block: the prompt's tokens from its start to the block's end."""


def block_keys(tokens: Sequence[int], block_size: int) -> list[Key]:
    """The keys of a prompt's full blocks, in order."""
    t = tuple(tokens)
    return [t[: (i + 1) * block_size] for i in range(len(t) // block_size)]


@attrs.define(eq=False)
class _Copy:
    """A page holding a cached block (block store)."""

    key: Key
    refs: int = 0
    stamp: int = 0
    cached: bool = True  # False once invalidated while a request still holds it
    redundant_since: int | None = None  # policy: free while its block has a first page


@attrs.define(eq=False)
class _Node:
    """A radix-tree node: a run of blocks inserted together (node store)."""

    blocks: list[Key]
    parent: _Node | None
    children: dict[Key, _Node] = attrs.field(factory=dict)
    stamp: int = 0
    lock: int = 0


@attrs.define(eq=False)
class _Run:
    """A running request."""

    keys: list[Key]  # its full blocks
    tokens: int
    hit: int  # blocks that hit
    held: list[_Copy] = attrs.field(factory=list)  # block store: copies it holds, block order
    own: int = 0  # pages it holds that are not cached
    node: _Node | None = None  # node store: the node it locked


class ReferencePrefixEngine:
    """The reference for `PrefixEngineConformance`: ``pages`` pages of ``block_size`` tokens.

    ``admit`` returns the hit tokens (``None`` when the pool cannot take the request);
    ``finish`` publishes (``publish="at-finish"``) and releases. The views compared after
    every step: `resident`, `copies`, `free_pages` and each request's `held` blocks.
    """

    def __init__(self, semantics: EngineSemantics, pages: int, block_size: int) -> None:
        if pages < 0 or block_size < 1:
            raise UsageError(f"need pages >= 0 and block_size >= 1, got {pages}, {block_size}")
        self.semantics = semantics
        self.pages = pages
        self.block_size = block_size
        self.runs: dict[str, _Run] = {}
        self._clock = itertools.count(1)
        self.free = pages  # free pages holding nothing
        self.store: dict[Key, list[_Copy]] = {}  # block store: registration order
        self.limbo: list[int] = []  # stamps of invalidated free pages kept in place
        self.root = _Node([], None, lock=1)  # node store
        self.policy = self._new_policy()  # a declared policy's reference model, or None

    # -- views ---------------------------------------------------------------------------
    def resident(self) -> frozenset[Key]:
        if self.semantics.unit == "node":
            return frozenset(k for node in self._nodes() for k in node.blocks)
        return frozenset(self.store)

    def copies(self) -> dict[Key, int]:
        """How many pages hold each cached block."""
        if self.semantics.unit == "node":
            return {k: 1 for k in self.resident()}
        return {k: len(c) for k, c in self.store.items()}

    def free_pages(self) -> int:
        return self.free + len(self.limbo)

    def held(self, rid: str) -> frozenset[Key]:
        """The cached blocks request ``rid`` holds (its hits, and what it published)."""
        run = self.runs[rid]
        if self.semantics.unit == "node":
            return frozenset(run.keys[: run.hit])
        return frozenset(c.key for c in run.held if c.cached)

    def cached_pages(self) -> int:
        return sum(self.copies().values())

    # -- requests ------------------------------------------------------------------------
    def admit(self, rid: str, tokens: Sequence[int]) -> int | None:
        if rid in self.runs:
            raise UsageError(f"request {rid!r} is already running")
        sem, bs = self.semantics, self.block_size
        n = len(tokens)
        keys = block_keys(tokens, bs)
        limit = len(keys) if sem.hit_cap == "full" else min(len(keys), max(n - 1, 0) // bs)
        total = -(-n // bs)
        if sem.unit == "node":
            return self._admit_node(rid, keys, n, limit, total)
        k = 0
        while k < limit and keys[k] in self.store:
            k += 1
        hits = [self.store[keys[i]][0] for i in range(k)]
        need = total - k
        run = _Run(keys, n, k)
        if sem.capacity == "shared-pool":
            for c in hits:  # held first: a hit that was evictable no longer is
                c.refs += 1
            if need > self.free_pages() + self._evictable():
                for c in hits:
                    c.refs -= 1
                return None
            if self.policy is not None:
                self._policy_hits(hits)
            self._make_room(need)
            self.free -= need
        else:
            for c in hits:
                c.refs += 1
        run.held = list(hits)
        run.own = need
        if sem.pins == "ours":
            self._stamp(hits)
        self.runs[rid] = run
        if sem.publish == "at-admit":
            self._publish(run)
        return min(k * bs, n)

    def finish(self, rid: str) -> None:
        run = self.runs[rid]
        if self.semantics.unit == "node":
            self._finish_node(run)
        else:
            if self.semantics.publish == "at-finish":
                self._publish(run)
            self._release(run)
        del self.runs[rid]

    # -- operations ----------------------------------------------------------------------
    def evict(self, pages: int) -> None:
        """Free at least ``pages`` pages of unused cached blocks (fewer if there are not)."""
        if self.semantics.unit == "node":
            self._evict_nodes(pages)
            return
        for _ in range(pages):
            if not self._evict_one():
                return

    def invalidate(self, key: Key) -> None:
        """Drop ``key`` from the cache (every copy); held pages stay with their request."""
        if self.policy is not None:
            if key in self.store:
                self._drop_block(key)
            return
        for c in self.store.pop(key, []):
            c.cached = False
            if c.refs == 0:
                if self.semantics.invalidated == "in-place":
                    self.limbo.append(c.stamp)
                else:
                    self.free += 1
        if self.semantics.orphans == "removed":
            self._remove_orphans(key)

    def reset(self) -> None:
        if self.runs:
            raise UsageError("reset while requests run")
        self.store.clear()
        self.limbo.clear()
        self.root = _Node([], None, lock=1)
        self.free = self.pages
        self.policy = self._new_policy()

    # -- block store ---------------------------------------------------------------------
    def _tick(self) -> int:
        return next(self._clock)

    def _stamp(self, copies: Sequence[_Copy]) -> None:
        order = reversed(copies) if self.semantics.touch == "tail-first" else iter(copies)
        for c in order:
            c.stamp = self._tick()

    def _evictable(self) -> int:
        return sum(c.refs == 0 for cs in self.store.values() for c in cs)

    def _evict_one(self) -> bool:
        """Evict the least recent unused copy (pages='ours': stamping the held copies the
        scan passes, as an LRU that finds a pinned block at its end counts it as used)."""
        if self.policy is not None:
            return self._policy_evict_one()
        by_age = sorted((c for cs in self.store.values() for c in cs), key=lambda c: c.stamp)
        victim = next((c for c in by_age if c.refs == 0), None)
        if victim is None:
            return False
        if self.semantics.pins == "ours":
            for c in by_age:
                if c is victim:
                    break
                c.stamp = self._tick()
        self._drop(victim)
        return True

    def _drop(self, victim: _Copy) -> None:
        copies = self.store[victim.key]
        copies.remove(victim)
        self.free += 1
        if not copies:
            del self.store[victim.key]
            if self.semantics.orphans == "removed":
                self._remove_orphans(victim.key)

    def _remove_orphans(self, key: Key) -> None:
        for other in [k for k in self.store if len(k) > len(key) and k[: len(key)] == key]:
            for c in self.store.pop(other):
                assert c.refs == 0, "a held block lost its parent"
                self.free += 1

    def _make_room(self, need: int) -> None:
        """Free pages until ``need`` are free: invalidated pages kept in place and unused
        copies, least recent first."""
        while self.free < need:
            oldest = min(
                (c.stamp for cs in self.store.values() for c in cs if c.refs == 0), default=None
            )
            if self.limbo and (oldest is None or min(self.limbo) < oldest):
                self.limbo.remove(min(self.limbo))
                self.free += 1
                continue
            assert self._evict_one(), "admission checked that enough pages can be freed"

    def _publish(self, run: _Run) -> None:
        """Register ``run``'s computed full blocks (those after its hits)."""
        sem = self.semantics
        if self.policy is not None:
            self._policy_publish(run)
            return
        index = range(run.hit, len(run.keys))
        if sem.touch == "tail-first":
            index = range(len(run.keys) - 1, run.hit - 1, -1)
        published: dict[int, _Copy] = {}
        for i in index:
            key = run.keys[i]
            if key in self.store and sem.duplicates == "freed":
                copy = self.store[key][0]  # another request cached it first: ours stays private
            else:
                if sem.capacity == "fixed":  # the pool counts cache slots only
                    if self.free == 0 and not self._evict_one():
                        continue  # every cached block is held: this one is not cached
                    self.free -= 1
                copy = _Copy(key)
                self.store.setdefault(key, []).append(copy)
                run.own -= 1
            copy.refs += 1
            published[i] = copy
            if sem.pins == "ours":
                copy.stamp = self._tick()
        run.held.extend(published[i] for i in sorted(published))

    def _release(self, run: _Run) -> None:
        sem = self.semantics
        if self.policy is not None:
            self._policy_release(run)
        elif sem.pins == "release-is-use":
            # pages are released in touch order; a copy nobody holds any more is stamped
            held = list(reversed(run.held)) if sem.touch == "tail-first" else run.held
            for c in held:
                c.refs -= 1
                if c.refs == 0:
                    if c.cached:
                        c.stamp = self._tick()
                    else:
                        self.free += 1
        else:
            for c in run.held:
                c.refs -= 1
                if c.refs == 0 and not c.cached:
                    self.free += 1
        if sem.capacity == "shared-pool":
            self.free += run.own

    # -- a declared policy over the block store (prefixflight.vllm) ----------------------
    def _new_policy(self) -> Any:
        name = self.semantics.policy
        if name is None:
            return None
        return load_object(MACHINES[name].machine).reference(self.pages)

    def _access(self, keys: Sequence[Key]) -> None:
        """The policy's accesses; what it evicts on them leaves the cache (every page)."""
        self._drop_blocks(self.policy.access(keys))

    def _drop_blocks(self, evicted: Sequence[Key]) -> None:
        """Blocks the policy evicted leave the cache (every page), in its order."""
        for key in evicted:
            self._drop_block(key)

    def _policy_hits(self, hits: Sequence[_Copy]) -> None:
        """An admitted request's hits (already counted in ``refs``): a page newly in use pins
        its block; then each hit is an access, deepest first."""
        for c in hits:
            if c.refs == 1:
                self.policy.pin(c.key)
        self._access([c.key for c in reversed(hits)])
        self._mark_redundant()

    def _policy_publish(self, run: _Run) -> None:
        """Newly computed blocks, deepest first: each is an access; a block the policy
        cannot admit stays the request's own page."""
        published: dict[int, _Copy] = {}
        for i in range(len(run.keys) - 1, run.hit - 1, -1):
            key = run.keys[i]
            if key not in self.store:
                try:
                    evicted = self.policy.access([key])
                except CapacityError:
                    continue
                if key not in self.policy:
                    self._drop_blocks(evicted)
                    continue
                self.store[key] = []
            else:
                evicted = self.policy.access([key])
            copy = _Copy(key, refs=1)
            self.store[key].append(copy)
            run.own -= 1
            self.policy.pin(key)
            published[i] = copy
            self._drop_blocks(evicted)
            self._mark_redundant()
        run.held.extend(published[i] for i in sorted(published))

    def _policy_release(self, run: _Run) -> None:
        """A page nobody holds any more unpins its block (and, with
        ``pins="release-is-use"``, is an access), in touch order."""
        held = list(reversed(run.held)) if self.semantics.touch == "tail-first" else run.held
        for c in held:
            c.refs -= 1
            if c.refs:
                continue
            if not c.cached:
                self.free += 1
                continue
            self.policy.unpin(c.key)
            if self.semantics.pins == "release-is-use":
                self._access([c.key])
            self._mark_redundant()

    def _mark_redundant(self) -> None:
        """Stamp the free pages that just became redundant: every free page of a block
        whose first page is in use, and every free page but the first of a block."""
        for copies in self.store.values():
            all_free = all(c.refs == 0 for c in copies)
            for i, c in enumerate(copies):
                if c.refs or (all_free and i == 0):
                    c.redundant_since = None
                elif c.redundant_since is None:
                    c.redundant_since = self._tick()

    def _policy_evict_one(self) -> bool:
        """Free one page: the redundant copy redundant longest, else the policy's victim
        (every page of it: all free, as its block was not pinned)."""
        redundant = [c for cs in self.store.values() for c in cs if c.redundant_since is not None]
        if redundant:
            victim = min(redundant, key=lambda c: c.redundant_since or 0)
            self.store[victim.key].remove(victim)
            self.free += 1
            return True
        key = self.policy.evict()
        if key is None:
            return False
        self._drop_block(key)
        return True

    def _drop_block(self, key: Key) -> None:
        """``key`` leaves the cache with its cached descendants (no lookup reaches them):
        free pages are freed, held ones stay with their requests, uncached."""
        gone = [k for k in self.store if k[: len(key)] == key]
        for k in gone:
            for c in self.store.pop(k):
                c.cached = False
                if c.refs:
                    self.policy.unpin(k)
                else:
                    self.free += 1
        for k in gone:
            if k in self.policy:
                self.policy.remove(k)
        self._mark_redundant()

    # -- node store (a radix tree, as SGLang's RadixCache) -------------------------------
    def _nodes(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: _Node, at: int) -> _Node:
        """Split ``node`` after ``at`` blocks: a new node takes the head, ``node`` keeps the
        tail (its identity, so a request that locked it still holds it). A new node is
        stamped when it is made, after the nodes the same call visited (SGLang's
        ``TreeNode()`` reads the clock after the call's access time)."""
        parent = node.parent
        assert parent is not None
        head = _Node(node.blocks[:at], parent, stamp=self._tick(), lock=node.lock)
        parent.children[head.blocks[0]] = head
        node.blocks = node.blocks[at:]
        node.parent = head
        head.children = {node.blocks[0]: node}
        return head

    def _walk(self, keys: list[Key], stamp: int) -> tuple[int, _Node]:
        """Follow ``keys`` down the tree, stamping every node visited and splitting the last
        one if ``keys`` end or diverge inside it: ``(blocks matched, last node)``."""
        node, i = self.root, 0
        while i < len(keys) and keys[i] in node.children:
            child = node.children[keys[i]]
            child.stamp = stamp
            m = 0
            while m < len(child.blocks) and i + m < len(keys) and child.blocks[m] == keys[i + m]:
                m += 1
            i += m
            if m < len(child.blocks):
                return i, self._split(child, m)
            node = child
        return i, node

    def _lock(self, node: _Node | None, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock += delta
            node = node.parent

    def _node_evictable(self) -> int:
        return sum(len(n.blocks) for n in self._nodes() if n.lock == 0)

    def _admit_node(self, rid: str, keys: list[Key], n: int, limit: int, total: int) -> int | None:
        stamp = self._tick()
        k, node = self._walk(keys[:limit], stamp) if limit else (0, self.root)
        self._lock(node, +1)
        need = total - k
        if need > self.free + self._node_evictable():
            self._lock(node, -1)
            return None
        if self.free < need:
            self._evict_nodes(need - self.free)
        self.free -= need
        self.runs[rid] = _Run(keys, n, k, own=need, node=node)
        return min(k * self.block_size, n)

    def _finish_node(self, run: _Run) -> None:
        keys = run.keys
        stamp = self._tick()
        have, node = self._walk(keys, stamp) if keys else (0, self.root)
        if have < len(keys):
            leaf = _Node(keys[have:], node, stamp=self._tick())
            node.children[leaf.blocks[0]] = leaf
        # the pages of blocks another request inserted first, and of the partial tail, are
        # freed; the pages of new blocks join the tree
        self.free += run.own - (len(keys) - have)
        run.own = 0
        self._lock(run.node, -1)

    def _evict_nodes(self, pages: int) -> None:
        heap = [(n.stamp, n) for n in self._nodes() if n.lock == 0 and not n.children]
        assert len({s for s, _ in heap}) == len(heap), "two leaves with one stamp"
        heapq.heapify(heap)
        freed = 0
        while freed < pages and heap:
            _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.blocks[0]]
            freed += len(leaf.blocks)
            self.free += len(leaf.blocks)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.stamp, parent))
