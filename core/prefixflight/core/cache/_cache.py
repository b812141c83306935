"""The prefix cache: longest resident prefix over block hashes, on top of an eviction policy.

One object serves trace replay (`PrefixCache.access`, the semantics of the S3-FIFO prefix-cache
replay task) and an engine (`publish`, `pin`/`unpin`, `evict`, pages). Pinning and events never
change a replay's numbers: they only add bookkeeping around the policy's decisions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, TypeAlias, final

import attrs

from .._errors import CapacityError, UsageError
from ..validate import CheckedInt, check_int
from ._policies import EvictionPolicy

if TYPE_CHECKING:
    from ._hashing import BlockHash

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "EventSink",
    "KVEvent",
    "PrefixCache",
]


@final
@attrs.frozen(kw_only=True)
class BlockStored:
    """Blocks entered the cache (shaped like vLLM's ``BlockStored`` KV event).

    ``token_ids`` is empty when the cache does not know the tokens (trace replay).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...] = ()
    block_size: int


@final
@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks left the cache (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[BlockHash, ...]


@final
@attrs.frozen
class AllBlocksCleared:
    """Every block left the cache (vLLM's ``AllBlocksCleared``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
EventSink: TypeAlias = Callable[[KVEvent], None]


@final
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
        "_access_into",
        "_block_size",
        "_blocks",
        "_evict_many",
        "_evictions",
        "_hit_blocks",
        "_hit_tokens",
        "_pages",
        "_policy",
        "_prompt_tokens",
        "_requests",
        "_resident",
        "_sink",
    )

    def __init__(
        self,
        policy: EvictionPolicy,
        block_size: CheckedInt,
        *,
        event_sink: EventSink | None = None,
    ) -> None:
        check_int("block_size", block_size, minimum=1)
        self._policy = policy
        # optional batch hook of the built-in policies (see S3FIFO.access_into)
        self._access_into: Callable[[Sequence[BlockHash], list[BlockHash]], int] | None = getattr(
            policy, "access_into", None
        )
        evict_many = getattr(policy, "evict_many", None)
        self._evict_many: Callable[[int], list[BlockHash]] | None = evict_many
        view = getattr(policy, "resident_view", None)
        self._resident: Container[BlockHash] = policy if view is None else view()
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
    def access(self, blocks: Sequence[BlockHash], num_tokens: CheckedInt) -> int:
        """A replayed request: scan the resident prefix, then access every block in order.

        Returns the request's hit tokens and counts it in `stats`. If a block cannot be
        admitted because everything is pinned, `CapacityError` is raised, the request is not
        counted, and the blocks before it (``error.applied`` of them) stay accessed.
        """
        if type(num_tokens) is not int or num_tokens < 0:  # the fast accept, else the check
            check_int("num_tokens", num_tokens, minimum=0, error=UsageError)
        tokens: int = num_tokens
        policy = self._policy
        k = policy.resident_prefix(blocks)
        hit = min(k * self._block_size, tokens)
        if self._sink is not None:
            self._access_with_events(blocks, None)
        elif self._access_into is not None:
            evicted: list[BlockHash] = []
            try:
                self._access_into(blocks, evicted)
            finally:  # blocks evicted before a CapacityError are forgotten too
                if evicted:
                    if self._pages:
                        self._forget(evicted)
                    else:  # no page to detach (a replay): only the count
                        self._evictions += len(evicted)
        else:
            evicted = policy.access(blocks)
            if evicted:
                self._forget(evicted)
        self._requests += 1  # counted only once every block was accessed
        self._prompt_tokens += tokens
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
        if pages is not None:
            return self.publish_pages(blocks, pages, parent=parent, token_ids=token_ids)[0]
        if self._sink is None and self._access_into is not None:
            return self._publish_batch(blocks, None)[0]
        return self._access_with_events(blocks, None, parent=parent, token_ids=token_ids)

    def publish_pages(
        self,
        blocks: Sequence[BlockHash],
        pages: Sequence[int],
        *,
        parent: BlockHash | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> tuple[list[tuple[BlockHash, int | None]], list[int]]:
        """`publish`, also returning the pages the cache did not keep.

        Returns ``(evicted, unused)``: ``evicted`` as `publish` returns it, and ``unused``,
        the caller's pages (in block order) that were never attached to a block, because
        the block was already resident (another request published it first) or the policy
        did not admit it. The caller owns both lists' pages again. One call per request:
        the engine path's batch-shaped publish.
        """
        if len(pages) != len(blocks):
            raise UsageError(f"got {len(pages)} pages for {len(blocks)} blocks")
        if token_ids is not None and len(token_ids) != len(blocks) * self._block_size:
            raise UsageError(
                f"got {len(token_ids)} token ids for {len(blocks)} blocks of {self._block_size}"
            )
        if self._sink is None and self._access_into is not None:
            return self._publish_batch(blocks, pages)
        taken_before = {b: self._pages.get(b) for b in blocks}
        error: CapacityError | None = None
        try:
            evicted = self._access_with_events(blocks, pages, parent=parent, token_ids=token_ids)
        except CapacityError as exc:
            error, evicted = exc, exc.evicted
        used = {p for _, p in evicted if p is not None}
        used.update(p for b in blocks if (p := self._pages.get(b)) is not None)
        used.difference_update(p for p in taken_before.values() if p is not None)
        unused = [p for p in pages if p not in used]
        if error is not None:
            raise CapacityError(
                str(error), applied=error.applied, evicted=evicted, unused_pages=unused
            ) from None
        return evicted, unused

    def evict_many(self, count: CheckedInt) -> list[tuple[BlockHash, int | None]]:
        """Evict up to ``count`` unpinned blocks in the policy's order (fewer if the rest
        are pinned); return their ``(block, page)`` pairs. One call for a request's
        pages instead of one `evict` per page; with an event sink, one `BlockRemoved`
        lists them all."""
        check_int("count", count, minimum=0)
        pop = self._pages.pop
        if self._evict_many is not None:
            victims = self._evict_many(count)
        else:
            victims = []
            evict = self._policy.evict
            for _ in range(count):
                victim = evict()
                if victim is None:
                    break
                victims.append(victim)
        out = list(zip(victims, map(pop, victims, repeat(None)), strict=True))
        if out:
            self._evictions += len(out)
            if self._sink is not None:
                self._sink(BlockRemoved(block_hashes=tuple(b for b, _ in out)))
        return out

    def pin(self, blocks: Sequence[BlockHash]) -> None:
        """Pin every block (all or nothing): pinned blocks are never evicted."""
        policy = self._policy
        if not all(map(self._resident.__contains__, blocks)):
            missing = [b for b in blocks if b not in policy]
            raise UsageError(f"cannot pin blocks that are not resident: {missing[:3]!r}")
        pin = policy.pin
        for b in blocks:
            pin(b)

    def unpin(self, blocks: Sequence[BlockHash]) -> None:
        """Undo one `pin` of every block (all or nothing)."""
        policy = self._policy
        need = Counter(blocks)
        pin_count = policy.pin_count
        bad = [b for b, n in need.items() if pin_count(b) < n]
        if bad:
            raise UsageError(f"cannot unpin blocks that are not pinned: {bad[:3]!r}")
        unpin = policy.unpin
        for b in blocks:
            unpin(b)

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

    def _publish_batch(
        self, blocks: Sequence[BlockHash], pages: Sequence[int] | None
    ) -> tuple[list[tuple[BlockHash, int | None]], list[int]]:
        """`publish` without events in one policy call: the same outcome as block by block.

        Which of the caller's pages were attached is reconstructed from residency before
        and after the batch and from the evicted list. For distinct blocks, a block may
        leave the cache at most once before its own access (if it was resident) and once
        after it (if it was admitted), so each eviction's page is determined. Repeated
        blocks take the block-by-block path.
        """
        n = len(blocks)
        if len(set(blocks)) != n:
            return self._publish_repeated(blocks, pages)
        access_into = self._access_into
        assert access_into is not None
        contains = self._resident.__contains__
        all_new = not any(map(contains, blocks))
        before = [False] * n if all_new else list(map(contains, blocks))
        evicted: list[BlockHash] = []
        error: CapacityError | None = None
        try:
            access_into(blocks, evicted)
            applied = n
        except CapacityError as exc:
            error = exc
            applied = exc.applied
        if error is None and all_new and all(map(contains, blocks)):
            # the common case: every block was new, was admitted and is still resident, so
            # no eviction touched the batch and every page was attached
            pmap = self._pages
            if pages is not None:
                pmap.update(zip(blocks, pages, strict=True))
            if evicted:
                self._evictions += len(evicted)
            return list(zip(evicted, map(pmap.pop, evicted, repeat(None)), strict=True)), []
        accessed = blocks[:applied]
        out, given_back, readmitted = self._pages_of_evicted(accessed, before, pages, evicted)
        unused = self._attach_pages(blocks, pages, applied, before, given_back, readmitted)
        if error is not None:
            raise CapacityError(
                str(error), applied=applied, evicted=out, unused_pages=unused
            ) from None
        return out, unused

    def _publish_repeated(
        self, blocks: Sequence[BlockHash], pages: Sequence[int] | None
    ) -> tuple[list[tuple[BlockHash, int | None]], list[int]]:
        """`_publish_batch` for blocks that repeat: block by block, then the pages neither
        evicted nor attached are the unused ones."""
        slow = self._access_with_events(blocks, pages)
        if pages is None:
            return slow, []
        kept = {p for _, p in slow}
        kept.update(self._pages.get(b) for b in blocks)
        return slow, [p for p in pages if p not in kept]

    def _pages_of_evicted(
        self,
        applied: Sequence[BlockHash],
        before: list[bool],
        pages: Sequence[int] | None,
        evicted: list[BlockHash],
    ) -> tuple[list[tuple[BlockHash, int | None]], set[int], set[int]]:
        """The page of each evicted block of a batch whose ``applied`` blocks were accessed
        (``before[i]``: block ``i`` was resident before the batch): a block outside the
        batch, or a batch block's first eviction if it was resident before, gives back the
        page it had; any other eviction of a batch block gives back the caller's page.
        Returns the ``(block, page)`` pairs, the indices whose caller's page left that way,
        and the indices that were resident, evicted, then admitted again."""
        out: list[tuple[BlockHash, int | None]] = []
        given_back: set[int] = set()  # indices whose page leaves through ``out``
        readmitted: set[int] = set()  # resident before, evicted, admitted again
        if not evicted:
            return out, given_back, readmitted
        pop = self._pages.pop
        index = {b: i for i, b in enumerate(applied)}
        times: dict[BlockHash, int] = {}
        for e in evicted:
            i = index.get(e)
            if i is None:
                out.append((e, pop(e, None)))
                continue
            c = times.get(e, 0)
            times[e] = c + 1
            if before[i] and c == 0:
                out.append((e, pop(e, None)))  # its old page, before its own access
                readmitted.add(i)
            else:
                out.append((e, pages[i] if pages is not None else None))
                given_back.add(i)
                readmitted.discard(i)
        self._evictions += len(evicted)
        return out, given_back, readmitted

    def _attach_pages(
        self,
        blocks: Sequence[BlockHash],
        pages: Sequence[int] | None,
        applied: int,
        before: list[bool],
        given_back: set[int],
        readmitted: set[int],
    ) -> list[int]:
        """Attach the caller's page of every accessed block that this batch admitted and
        that is still resident; return the other pages (not given back through an
        eviction), in block order: those of blocks past ``applied``, already resident, or
        not admitted."""
        contains = self._resident.__contains__
        pmap = self._pages
        unused: list[int] = []
        for i in range(len(blocks)):
            page = pages[i] if pages is not None else None
            if i >= applied:
                if page is not None:
                    unused.append(page)
                continue
            if i in given_back:
                continue
            if (not before[i] or i in readmitted) and contains(blocks[i]):
                if page is not None:
                    pmap[blocks[i]] = page
            elif page is not None:
                unused.append(page)
        return unused

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
            except CapacityError as exc:
                raise CapacityError(str(exc), applied=i, evicted=out) from None
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
