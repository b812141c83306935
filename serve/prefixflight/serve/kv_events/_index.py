"""Per-replica block indexes fed by KV events, and the sequence bookkeeping of one feed. Pure.

`ReplicaBlockIndex` mirrors one replica's resident blocks from its `WireEvent` stream, keyed
by 64-bit folded hashes (`fold_hash`, as llm-d's indexer keys them). Two keyings:

- the publisher's own hashes (no ``hasher``): right when the publisher hashes prompts the way
  the router does, e.g. a prefixflight replica with the router's `BlockHasher`;
- rebuilt from ``token_ids`` (``hasher=BlockHasher(...)``): when the publisher's hash seed
  is unknown (a vLLM replica), each stored block's key is recomputed with our hasher, chained
  from its parent's rebuilt key, and the publisher's hash is only remembered to resolve later
  parents and removals, as llm-d's indexer maps engine keys to request keys.

`ClusterBlockIndex` holds one index per replica and answers `prefix_blocks`, the
`prefixflight.core.PrefixIndex` protocol that `ApproxPrefixRouter(index=...)` reads.
`ReplicaFeed` orders one publisher's numbered batches: it says when a gap needs a replay and
skips what a replay already delivered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Final, final

import attrs

from prefixflight.core import BlockHash, BlockHasher, UsageError
from prefixflight.core.validate import assert_never

from ._wire import (
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    fold_hash,
)

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "ClusterBlockIndex",
    "IndexStats",
    "ReplicaBlockIndex",
    "ReplicaFeed",
]

DEFAULT_MAX_BLOCKS: Final = 1 << 18
"""The resident blocks one replica's index holds at most by default, 262,144 (about 130 MB
when full, rebuilding keys from tokens): more than a GPU's KV cache holds (an 8B model on an
80 GB GPU, about 30,000 blocks of 16 tokens)."""

_DEFAULT_MEDIUM = "GPU"  # vLLM events before the ``medium`` field described the GPU cache


@attrs.frozen(kw_only=True)
class IndexStats:
    """What an index did with its events.

    ``unresolved``: stored blocks it could not key (rebuilding from tokens, with an unknown
    parent, a block size other than the hasher's, no tokens, or extra keys the publisher
    hashed in: a LoRA name, multimodal keys, a cache salt); ``unknown_removed``: removed
    hashes it did not hold; ``evicted``: resident blocks forgotten, oldest first, to stay
    within the index's ``max_blocks``.
    """

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unresolved: int = 0
    unknown_removed: int = 0
    evicted: int = 0


@final
class ReplicaBlockIndex:
    """One replica's resident blocks, as its KV events say (see the module docstring).

    A block is resident while some medium (``"GPU"``, ``"CPU"``) holds a copy of it; a
    removal names its medium and takes one copy (vLLM caches a block twice when two requests
    compute it, and reports each copy's store and removal). ``ghost_capacity`` bounds how
    many removed blocks' rebuilt keys are remembered, so a block stored after its parent was
    evicted can still be keyed.
    ``max_blocks`` bounds the resident blocks held: past it the blocks stored first are
    forgotten (counted as ``evicted``; a forgotten block only costs a routing hint), so a
    publisher that stores without end, or one event of a million blocks, cannot grow the
    index past it.
    """

    __slots__ = (
        "_ghost_capacity",
        "_ghosts",
        "_hasher",
        "_keys",
        "_max_blocks",
        "_name",
        "_stats",
        "_tiers",
    )

    def __init__(
        self,
        name: str,
        *,
        hasher: BlockHasher | None = None,
        ghost_capacity: int = 65536,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"replica name must be a non-empty str, got {name!r}")
        if hasher is not None and not isinstance(hasher, BlockHasher):
            raise UsageError(f"hasher must be a BlockHasher, got {hasher!r}")
        if isinstance(ghost_capacity, bool) or not isinstance(ghost_capacity, int):
            raise UsageError(f"ghost_capacity must be an int >= 0, got {ghost_capacity!r}")
        if ghost_capacity < 0:
            raise UsageError(f"ghost_capacity must be an int >= 0, got {ghost_capacity!r}")
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise UsageError(f"max_blocks must be an int >= 1, got {max_blocks!r}")
        self._max_blocks = max_blocks
        self._name = name
        self._hasher = hasher
        self._ghost_capacity = ghost_capacity
        self._tiers: dict[int, dict[str, int]] = {}  # folded key -> medium -> copies
        self._keys: dict[int, BlockHash] = {}  # folded engine hash -> rebuilt key (resident)
        self._ghosts: OrderedDict[int, BlockHash] = OrderedDict()  # same, for removed blocks
        self._stats = IndexStats()

    @property
    def name(self) -> str:
        return self._name

    @property
    def hasher(self) -> BlockHasher | None:
        return self._hasher

    @property
    def stats(self) -> IndexStats:
        return self._stats

    @property
    def max_blocks(self) -> int:
        return self._max_blocks

    def __len__(self) -> int:
        return len(self._tiers)

    def __contains__(self, block: object) -> bool:
        """Whether ``block`` (a `BlockHash` as the router keys it) is resident."""
        try:
            return fold_hash(block) in self._tiers
        except UsageError:
            return False

    def keys(self) -> frozenset[int]:
        """The resident blocks' folded keys."""
        return frozenset(self._tiers)

    def media(self, block: BlockHash) -> frozenset[str]:
        """The media holding ``block`` (empty when it is not resident)."""
        return frozenset(self._tiers.get(fold_hash(block), ()))

    def prefix_blocks(self, blocks: Sequence[BlockHash]) -> int:
        """How many leading ``blocks`` are resident."""
        tiers = self._tiers
        n = 0
        for b in blocks:
            if fold_hash(b) not in tiers:
                break
            n += 1
        return n

    # -- events -------------------------------------------------------------------------------
    def apply_batch(self, batch: WireBatch) -> None:
        for event in batch.events:
            self.apply(event)

    def apply(self, event: WireEvent) -> None:
        match event:
            case WireBlockStored():
                self._store(event)
            case WireBlockRemoved():
                self._remove(event)
            case WireAllBlocksCleared():
                self.clear()
            case _:
                assert_never(event)

    def clear(self) -> None:
        """Forget every resident block (as on ``AllBlocksCleared``)."""
        for engine, ours in self._keys.items():
            self._ghost(engine, ours)
        self._keys.clear()
        self._tiers.clear()
        self._stats = attrs.evolve(self._stats, cleared=self._stats.cleared + 1)

    def _store(self, event: WireBlockStored) -> None:
        medium = event.medium or _DEFAULT_MEDIUM
        engine = [fold_hash(h) for h in event.block_hashes]
        hasher = self._hasher
        if hasher is None:
            for key in engine:
                copies = self._tiers.setdefault(key, {})
                copies[medium] = copies.get(medium, 0) + 1
            self._count(stored=len(engine))
            self._bound()
            return
        ours = self._rebuild(event, hasher)
        if ours is None:
            self._count(unresolved=len(engine))
            return
        for e, o in zip(engine, ours, strict=True):
            self._ghosts.pop(e, None)
            self._keys[e] = o
            copies = self._tiers.setdefault(fold_hash(o), {})
            copies[medium] = copies.get(medium, 0) + 1
        self._count(stored=len(engine))
        self._bound()

    def _bound(self) -> None:
        """Forget the blocks stored first until at most ``max_blocks`` are held."""
        over = len(self._tiers) - self._max_blocks
        if over <= 0:
            return
        evicted = 0
        keys, tiers = self._keys, self._tiers
        while len(tiers) > self._max_blocks:
            if keys:  # rebuilt keys: forget the engine's oldest block and its key
                engine = next(iter(keys))
                ours = keys.pop(engine)
                if tiers.pop(fold_hash(ours), None) is not None:
                    evicted += 1
                    self._ghost(engine, ours)
            else:
                del tiers[next(iter(tiers))]
                evicted += 1
        self._stats = attrs.evolve(self._stats, evicted=self._stats.evicted + evicted)

    def _rebuild(self, event: WireBlockStored, hasher: BlockHasher) -> tuple[BlockHash, ...] | None:
        n = len(event.block_hashes)
        if event.block_size != hasher.block_size or len(event.token_ids) != n * hasher.block_size:
            return None
        if event.extra_keys is not None and any(k is not None for k in event.extra_keys):
            return None  # vLLM hashed a LoRA name, multimodal keys or a cache salt in too
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            parent = self._resolve(fold_hash(event.parent_block_hash))
            if parent is None:
                return None
        return hasher.hash_tokens(event.token_ids, parent=parent)[:n]

    def _resolve(self, engine: int) -> BlockHash | None:
        ours = self._keys.get(engine)
        return self._ghosts.get(engine) if ours is None else ours

    def _remove(self, event: WireBlockRemoved) -> None:
        medium = event.medium or _DEFAULT_MEDIUM
        removed = unknown = 0
        for h in event.block_hashes:
            engine = fold_hash(h)
            if self._hasher is None:
                key: int | None = engine
            else:
                ours = self._keys.get(engine)
                key = None if ours is None else fold_hash(ours)
            tiers = None if key is None else self._tiers.get(key)
            if key is None or tiers is None or medium not in tiers:
                unknown += 1
                continue
            removed += 1
            if tiers[medium] > 1:  # another copy of the block stays cached there
                tiers[medium] -= 1
                continue
            del tiers[medium]
            if not tiers:
                del self._tiers[key]
                if self._hasher is not None:
                    self._ghost(engine, self._keys.pop(engine))
        self._count(removed=removed, unknown_removed=unknown)

    def _ghost(self, engine: int, ours: BlockHash) -> None:
        if self._ghost_capacity == 0:
            return
        ghosts = self._ghosts
        ghosts[engine] = ours
        ghosts.move_to_end(engine)
        while len(ghosts) > self._ghost_capacity:
            ghosts.popitem(last=False)

    def _count(
        self, *, stored: int = 0, removed: int = 0, unresolved: int = 0, unknown_removed: int = 0
    ) -> None:
        s = self._stats
        self._stats = IndexStats(
            stored=s.stored + stored,
            removed=s.removed + removed,
            cleared=s.cleared,
            unresolved=s.unresolved + unresolved,
            unknown_removed=s.unknown_removed + unknown_removed,
            evicted=s.evicted,
        )


@final
class ClusterBlockIndex:
    """One `ReplicaBlockIndex` per replica, created on first use with the shared ``hasher``.

    Implements `prefixflight.core.PrefixIndex`, so ``ApproxPrefixRouter(index=cluster)``
    scores replicas by what their KV events say they hold.
    """

    __slots__ = ("_ghost_capacity", "_hasher", "_max_blocks", "_replicas")

    def __init__(
        self,
        *,
        hasher: BlockHasher | None = None,
        ghost_capacity: int = 65536,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        self._hasher = hasher
        self._ghost_capacity = ghost_capacity
        self._max_blocks = max_blocks
        self._replicas: dict[str, ReplicaBlockIndex] = {}
        ReplicaBlockIndex(  # validate
            "probe", hasher=hasher, ghost_capacity=ghost_capacity, max_blocks=max_blocks
        )

    def replica(self, name: str) -> ReplicaBlockIndex:
        """``name``'s index (an empty one the first time)."""
        index = self._replicas.get(name)
        if index is None:
            index = ReplicaBlockIndex(
                name,
                hasher=self._hasher,
                ghost_capacity=self._ghost_capacity,
                max_blocks=self._max_blocks,
            )
            self._replicas[name] = index
        return index

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._replicas))

    def __len__(self) -> int:
        return len(self._replicas)

    def apply_batch(self, name: str, batch: WireBatch) -> None:
        self.replica(name).apply_batch(batch)

    def drop(self, name: str) -> None:
        """Forget ``name``'s index (a replica that left); unknown names are ignored."""
        self._replicas.pop(name, None)

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        index = self._replicas.get(replica)
        return 0 if index is None else index.prefix_blocks(blocks)


@final
class ReplicaFeed:
    """One publisher's numbered batches applied in order to one `ReplicaBlockIndex`.

    The live stream (PUB/SUB) numbers batches 0, 1, 2, ... per publisher. `observe_live`
    says, for each live batch, where a replay must start when batches were missed (``None``
    when none were); `accept` applies a live or replayed batch unless it was applied already.
    A live number that does not increase means the publisher restarted: the index is cleared
    (a restarted engine's cache is empty) and numbering starts over.
    """

    __slots__ = ("_index", "_last_live", "_lost", "_next", "_restarts")

    def __init__(self, index: ReplicaBlockIndex) -> None:
        self._index = index
        self._next = 0
        self._last_live: int | None = None
        self._lost = 0
        self._restarts = 0

    @property
    def index(self) -> ReplicaBlockIndex:
        return self._index

    @property
    def next_seq(self) -> int:
        """The number of the next batch to apply (batches before it are applied or lost)."""
        return self._next

    @property
    def lost(self) -> int:
        """Batches skipped because neither the live stream nor a replay delivered them."""
        return self._lost

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def last_live(self) -> int | None:
        """The number of the last live batch seen (``None`` before the first)."""
        return self._last_live

    def observe_live(self, seq: int) -> int | None:
        """Note live batch ``seq``; return the first missing number if there is a gap."""
        _check_seq(seq)
        if self._last_live is not None and seq <= self._last_live:
            self._index.clear()
            self._next = 0
            self._restarts += 1
        self._last_live = seq
        return self._next if seq > self._next else None

    def accept(self, seq: int, batch: WireBatch) -> bool:
        """Apply batch ``seq`` if it is new (counting any batches skipped before it)."""
        _check_seq(seq)
        if seq < self._next:
            return False
        self._lost += seq - self._next
        self._index.apply_batch(batch)
        self._next = seq + 1
        return True


def _check_seq(seq: object) -> None:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise UsageError(f"seq must be an int >= 0, got {seq!r}")
