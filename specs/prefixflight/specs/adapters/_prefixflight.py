"""prefixflight's own engine path under `PrefixEngineConformance` (the page pool the
`Scheduler` runs on: an LRU `PrefixCache`, pins, page tables, chain-aware reclamation), and
its `Scheduler` under `SchedulerConformance`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from prefixflight.core import (
    LRU,
    BlockHash,
    BlockHasher,
    FinishReason,
    PrefixCache,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from prefixflight.core.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixflight.core.flight._pages import PagePool, pages_for
from prefixflight.core.validate import assert_never

from .._adapter import KVChange, PoolView
from .._declare import EngineSemantics, SchedulerSemantics, Unsupported
from .._engine_ref import Key
from .._sched_adapter import Delivery, ScheduledRow, SchedulerLimits, SchedulerPages

__all__ = ["PagePoolAdapter", "PrefixflightSchedulerAdapter"]


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


_Reason = Literal["stop", "length"]
_REASONS: dict[FinishReason, _Reason] = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class PrefixflightSchedulerAdapter:
    """prefixflight's `Scheduler` over an LRU `PrefixCache` of every page, with same-step
    sharing (the defaults of `SchedulerSemantics` are its semantics): a plan's prefills and
    decodes are the rows; time advances one unit per call.

    ``scheduler_cls`` is built as ``scheduler_cls(config, cache=cache)`` (a drop-in
    replacement for `Scheduler`: how ``prefixflight conform prefixflight --impl`` checks a
    fork).
    """

    semantics = SchedulerSemantics()

    def __init__(self, limits: SchedulerLimits, *, scheduler_cls: type[Any] = Scheduler) -> None:
        if limits.policy != "fcfs":
            raise Unsupported(f"prefixflight's Scheduler admits in order, not {limits.policy!r}")
        bs = limits.block_size
        config = SchedulerConfig(
            num_pages=limits.pages,
            block_size=bs,
            max_batch_tokens=limits.max_batch_tokens,
            max_running=limits.max_running,
            same_step_sharing=True,
        )
        self._cache = PrefixCache(LRU(limits.pages), bs)
        self.scheduler = scheduler_cls(config, cache=self._cache)
        self._hasher = BlockHasher(bs)
        self._bs = bs
        self._now = 0.0
        self._seqs: dict[str, list[int]] = {}
        self._keys: dict[BlockHash, Key] = {}
        self._plan: StepPlan | None = None

    def _tick(self) -> float:
        self._now += 1.0
        return self._now

    def _learn(self, rid: str) -> None:
        seq = self._seqs[rid]
        for i, h in enumerate(self._hasher.hash_tokens(seq)):
            self._keys.setdefault(h, tuple(seq[: (i + 1) * self._bs]))

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        priority: int,
    ) -> None:
        self.scheduler.add_request(
            request_id,
            prompt,
            max_new_tokens=max_new_tokens,
            now=self._tick(),
            stop_token_ids=stop_token_ids,
        )
        self._seqs[request_id] = list(prompt)
        self._learn(request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id, self._tick())

    def schedule(self) -> list[ScheduledRow]:
        plan = self.scheduler.schedule(self._tick())
        if plan.is_empty:
            return []
        self._plan = plan
        rows = [
            ScheduledRow(
                request_id=str(p.request_id),
                start=p.start,
                token_ids=p.token_ids,
                pages=p.pages,
                sample=p.sample,
                reads_from=tuple(map(str, p.reads_from)),
            )
            for p in plan.prefills
        ]
        rows += [
            ScheduledRow(
                request_id=str(d.request_id),
                start=d.position,
                token_ids=(d.token_id,),
                pages=d.pages,
                sample=True,
            )
            for d in plan.decodes
        ]
        return rows

    def complete(self, sampled: Mapping[str, int]) -> list[Delivery]:
        plan = self._plan
        assert plan is not None, "complete() without a step"
        self._plan = None
        result = StepResult(
            step=plan.step, sampled=tuple((rid, sampled[str(rid)]) for rid in plan.sampling_ids())
        )
        outcome = self.scheduler.complete_step(result, self._tick())
        reasons: dict[str, _Reason | None] = {
            str(r.request_id): _REASONS.get(r.finish_reason) for r in outcome.finished
        }
        out = []
        for rid, tok in outcome.tokens:
            self._seqs[str(rid)].append(tok)
            self._learn(str(rid))
            why = reasons.pop(str(rid), None)
            out.append(Delivery(request_id=str(rid), token_ids=(tok,), finished=why))
        out += [Delivery(request_id=r, token_ids=(), finished=why) for r, why in reasons.items()]
        return out

    def pages(self) -> SchedulerPages:
        cache, pool = self._cache, self.scheduler._pool
        cached: dict[int, Key] = {}
        free = set(pool._free)
        for h in cache.policy.resident():
            page = cache.page(h)
            assert page is not None, "a cached block without a page"
            key = self._keys.get(h)
            assert key is not None, f"page {page} caches a block no request has: {h!r}"
            cached[page] = key
            if h not in pool._pins:
                free.add(page)  # evictable
        held = {}
        for rid, r in self.scheduler._requests.items():
            pinned = (cache.page(h) for h in r.pinned)  # a block it published first, maybe
            extra = tuple(p for p in dict.fromkeys(pinned) if p is not None and p not in r.pages)
            if r.pages or extra:
                held[str(rid)] = (*r.pages, *extra)
        return SchedulerPages(free=frozenset(free), cached=cached, held=held)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished)
