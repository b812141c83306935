"""The prefix cache: longest resident prefix over block hashes, on top of an eviction policy.

One object serves trace replay (`PrefixCache.access`, seed 002's semantics) and an engine
(`publish`, `pin`/`unpin`, `evict`, pages). Pinning and events never change a replay's
numbers: they only add bookkeeping around the policy's decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, final

import attrs

from ._errors import UsageError
from ._hashing import BlockHash
from ._policies import EvictionPolicy
from ._validate import check_int

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "KVEvent",
    "PrefixCache",
]


@attrs.frozen(kw_only=True)
class BlockStored:
    """Blocks entered the cache (shaped like vLLM's ``BlockStored`` KV event).

    ``token_ids`` is empty when the cache does not know the tokens (trace replay).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...] = ()
    block_size: int


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks left the cache (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[BlockHash, ...]


@attrs.frozen
class AllBlocksCleared:
    """Every block left the cache (vLLM's ``AllBlocksCleared``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
EventSink: TypeAlias = Callable[[KVEvent], None]


@attrs.frozen(kw_only=True)
class CacheStats:
    """Counters since the cache was made. Rates are 0.0 when nothing was counted."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


@final
class PrefixCache:
    """Longest-resident-prefix cache of blocks, ``block_size`` tokens each.

    A request's hit is the largest ``k`` such that its first ``k`` blocks are all resident,
    in tokens ``min(k * block_size, num_tokens)``; never a set intersection. Every block may
    carry a page index (an engine's KV page) that is handed back when the block is evicted.
    """

    __slots__ = (
        "_block_size",
        "_blocks",
        "_evictions",
        "_hit_blocks",
        "_hit_tokens",
        "_pages",
        "_policy",
        "_prompt_tokens",
        "_requests",
        "_sink",
    )

    def __init__(
        self,
        policy: EvictionPolicy,
        block_size: int,
        *,
        event_sink: EventSink | None = None,
    ) -> None:
        check_int("block_size", block_size, minimum=1)
        self._policy = policy
        self._block_size = block_size
        self._sink = event_sink
        self._pages: dict[BlockHash, int] = {}
        self._requests = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._blocks = 0
        self._hit_blocks = 0
        self._evictions = 0

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def capacity(self) -> int:
        return self._policy.capacity

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, block: object) -> bool:
        return block in self._policy

    @property
    def stats(self) -> CacheStats:
        return CacheStats(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            hit_tokens=self._hit_tokens,
            blocks=self._blocks,
            hit_blocks=self._hit_blocks,
            evictions=self._evictions,
        )

    # -- queries -------------------------------------------------------------------------
    def lookup(self, blocks: Sequence[BlockHash]) -> int:
        """How many leading blocks are resident now. Changes nothing."""
        return self._policy.resident_prefix(blocks)

    def hit_tokens(self, hit_blocks: int, num_tokens: int) -> int:
        """Tokens covered by ``hit_blocks`` leading blocks of a ``num_tokens`` prompt."""
        return min(hit_blocks * self._block_size, num_tokens)

    def page(self, block: BlockHash) -> int | None:
        """The page attached to a resident block, if any."""
        return self._pages.get(block)

    # -- replay semantics ----------------------------------------------------------------
    def access(self, blocks: Sequence[BlockHash], num_tokens: int) -> int:
        """Seed 002's request: scan the resident prefix, then access every block in order.

        Returns the request's hit tokens and counts it in `stats`. If a block cannot be
        admitted because everything is pinned, `CapacityError` is raised, the request is not
        counted, and the blocks before it (``error.applied`` of them) stay accessed.
        """
        if num_tokens < 0:
            raise UsageError(f"num_tokens must be >= 0, got {num_tokens!r}")
        policy = self._policy
        k = policy.resident_prefix(blocks)
        hit = min(k * self._block_size, num_tokens)
        if self._sink is None:
            evicted = policy.access(blocks)
            if evicted:
                self._forget(evicted)
        else:
            self._access_with_events(blocks, None)
        self._requests += 1  # counted only once every block was accessed
        self._prompt_tokens += num_tokens
        self._hit_tokens += hit
        self._blocks += len(blocks)
        self._hit_blocks += k
        return hit

    # -- engine operations ---------------------------------------------------------------
    def publish(
        self,
        blocks: Sequence[BlockHash],
        pages: Sequence[int] | None = None,
        *,
        parent: BlockHash | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> list[tuple[BlockHash, int | None]]:
        """Make computed blocks reusable: access each in order, attaching its page.

        ``parent`` is the block before ``blocks[0]`` (for the events' chain); ``token_ids``
        are the blocks' tokens (``len(blocks) * block_size`` of them), for the events.
        Returns the evicted ``(block, page)`` pairs, whose pages the caller may reuse.
        A block that is already resident keeps its page (the caller's copy is a duplicate).
        Not counted as a request in `stats`.
        """
        if pages is not None and len(pages) != len(blocks):
            raise UsageError(f"got {len(pages)} pages for {len(blocks)} blocks")
        if token_ids is not None and len(token_ids) != len(blocks) * self._block_size:
            raise UsageError(
                f"got {len(token_ids)} token ids for {len(blocks)} blocks of {self._block_size}"
            )
        return self._access_with_events(blocks, pages, parent=parent, token_ids=token_ids)

    def pin(self, blocks: Sequence[BlockHash]) -> None:
        """Pin every block (all or nothing): pinned blocks are never evicted."""
        policy = self._policy
        missing = [b for b in blocks if b not in policy]
        if missing:
            raise UsageError(f"cannot pin blocks that are not resident: {missing[:3]!r}")
        for b in blocks:
            policy.pin(b)

    def unpin(self, blocks: Sequence[BlockHash]) -> None:
        """Undo one `pin` of every block (all or nothing)."""
        policy = self._policy
        need: dict[BlockHash, int] = {}
        for b in blocks:
            need[b] = need.get(b, 0) + 1
        bad = [b for b, n in need.items() if policy.pin_count(b) < n]
        if bad:
            raise UsageError(f"cannot unpin blocks that are not pinned: {bad[:3]!r}")
        for b in blocks:
            policy.unpin(b)

    def evict(self) -> tuple[BlockHash, int | None] | None:
        """Evict one unpinned block in the policy's order; ``None`` if all are pinned."""
        victim = self._policy.evict()
        if victim is None:
            return None
        page = self._pages.pop(victim, None)
        self._evictions += 1
        if self._sink is not None:
            self._sink(BlockRemoved(block_hashes=(victim,)))
        return victim, page

    def remove(self, block: BlockHash) -> int | None:
        """Drop a resident, unpinned block (no ghost); return its page."""
        self._policy.remove(block)
        if self._sink is not None:
            self._sink(BlockRemoved(block_hashes=(block,)))
        return self._pages.pop(block, None)

    def clear(self) -> None:
        """Drop every block (fails while any is pinned)."""
        self._policy.clear()
        self._pages.clear()
        if self._sink is not None:
            self._sink(AllBlocksCleared())

    def check_invariants(self) -> None:
        self._policy.check_invariants()
        policy = self._policy
        assert all(b in policy for b in self._pages), "a page is attached to an evicted block"

    # -- internals -----------------------------------------------------------------------
    def _forget(self, evicted: list[BlockHash]) -> list[tuple[BlockHash, int | None]]:
        self._evictions += len(evicted)
        pop = self._pages.pop
        return [(b, pop(b, None)) for b in evicted]

    def _access_with_events(
        self,
        blocks: Sequence[BlockHash],
        pages: Sequence[int] | None,
        *,
        parent: BlockHash | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> list[tuple[BlockHash, int | None]]:
        """Access block by block so each admission and eviction is reported in order."""
        policy = self._policy
        sink = self._sink
        bs = self._block_size
        out: list[tuple[BlockHash, int | None]] = []
        for i, b in enumerate(blocks):
            was_resident = b in policy
            try:
                evicted = policy.access((b,))
            except Exception as exc:
                if hasattr(exc, "applied"):
                    exc.applied = i
                raise
            if evicted:
                out.extend(self._forget(evicted))
                if sink is not None:
                    sink(BlockRemoved(block_hashes=tuple(evicted)))
            if not was_resident and b in policy:
                if pages is not None:
                    self._pages[b] = pages[i]
                if sink is not None:
                    toks = () if token_ids is None else tuple(token_ids[i * bs : (i + 1) * bs])
                    sink(
                        BlockStored(
                            block_hashes=(b,),
                            parent_block_hash=blocks[i - 1] if i else parent,
                            token_ids=toks,
                            block_size=bs,
                        )
                    )
        return out
