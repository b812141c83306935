# mypy: disallow-subclassing-any=False
"""Broken subclasses of the real engines' classes, each with one seeded mistake, for
``prefixflight conform ENGINE --impl broken:CLASS``; and broken Dynamo-backed indexes (its
``RadixTree`` cannot be subclassed: they wrap it) and prefixflight.vllm's queue with one
seeded mistake each, for ``prefixflight conform --adapter broken:CLASS``. Run in the peers
environment: this module imports vLLM, SGLang, libCacheSim and Dynamo, so only that
environment can import it."""

from __future__ import annotations

import json
from typing import Any

import libcachesim
from dynamo.llm import RadixTree
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from prefixflight.specs.adapters import (
    DynamoIndexAdapter,
    VLLMPluginLRU,
    VLLMPluginS3FIFO,
    stub_torchvision,
)

stub_torchvision()
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402


# -- vLLM ------------------------------------------------------------------------------------
class UnderReportingKVCacheManager(KVCacheManager):
    """A lookup that reports one cached block fewer than it found."""

    def get_computed_blocks(self, request: Any, max_cache_hit_length: Any = None) -> Any:
        blocks, computed, boundary = super().get_computed_blocks(request, max_cache_hit_length)
        if computed:
            kept = self.create_kv_cache_blocks(tuple(group[:-1] for group in blocks.blocks))
            return kept, computed - self.block_pool.hash_block_size, boundary
        return blocks, computed, boundary


class LeakyKVCacheManager(KVCacheManager):
    """A free that forgets the request's last block (it is never returned to the pool)."""

    def free(self, request: Any) -> None:
        for manager in self.coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id)
            if blocks and len(blocks) > 1:
                blocks.pop()
        super().free(request)


class HeadFirstBlockPool(BlockPool):
    """Frees a request's blocks head first, so a chain's parent is evicted before its tail."""

    def free_blocks(self, ordered_blocks: Any) -> None:
        super().free_blocks(list(ordered_blocks)[::-1])


class FreedPrefixScheduler(Scheduler):
    """Releases the prefix-hit blocks of every request it admits: the request then runs on
    blocks the pool may hand to another request."""

    def schedule(self, throttle_prefills: bool = False) -> Any:
        out = super().schedule(throttle_prefills)
        pool = self.kv_cache_manager.block_pool
        for new in out.scheduled_new_reqs:
            hit = new.num_computed_tokens // self.block_size
            if hit:
                pool.free_blocks(self.kv_cache_manager.get_blocks(new.req_id).blocks[0][:hit])
        return out


class LeakyAbortScheduler(Scheduler):
    """An abort that forgets the request's last block: it is never returned to the pool."""

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        if finished_status == RequestStatus.FINISHED_ABORTED:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            for manager in self.kv_cache_manager.coordinator.single_type_managers:
                for rid in ids:
                    blocks = manager.req_to_blocks.get(rid)
                    if blocks:
                        blocks.pop()
        return super().finish_requests(request_ids, finished_status)


class DroppingScheduler(Scheduler):
    """Drops the output of every request that finishes in a step (its last token and its
    finish reason never reach the client)."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for eco in outputs.values():
            eco.outputs = [o for o in eco.outputs if o.finish_reason is None]
        return outputs


# -- prefixflight.vllm's queue in vLLM's pool -------------------------------------------------
class ReleaseCountingS3FIFOPlugin(VLLMPluginS3FIFO):
    """S3-FIFO whose frequency also counts releases (``refresh_on_free`` on)."""

    def __init__(self, pages: int, **kwargs: Any) -> None:
        super().__init__(pages, **kwargs)
        self.queue._refresh_on_free = True


class EmptyLastPlugin(VLLMPluginLRU):
    """A queue that puts freed blocks without a hash behind the cached ones, so it evicts a
    cached block while an empty one is free."""

    def __init__(self, pages: int, **kwargs: Any) -> None:
        super().__init__(pages, **kwargs)
        self.queue.prepend_n = self.queue.append_n


class OrphanKeepingPlugin(VLLMPluginS3FIFO):
    """A queue that leaves a block's cached descendants behind when it leaves."""

    def __init__(self, pages: int, **kwargs: Any) -> None:
        super().__init__(pages, **kwargs)
        self.queue._forget_chain = lambda key: None


# -- SGLang ----------------------------------------------------------------------------------
class UnderMatchingRadixCache(RadixCache):
    """A match that reports one page fewer than it matched."""

    def match_prefix(self, params: Any) -> Any:
        result = super().match_prefix(params)
        if result.device_prefix_len >= self.page_size:
            return result._replace(device_prefix_len=result.device_prefix_len - self.page_size)
        return result


class PageDroppingRadixCache(RadixCache):
    """An insert that drops the last page of every key of two pages or more."""

    def insert(self, params: Any) -> Any:
        if params.key is not None and len(params.key) >= 2 * self.page_size:
            params.key = params.key[: len(params.key) - self.page_size]
            params.value = params.value[: len(params.value) - self.page_size]
        return super().insert(params)


class ShortEvictingRadixCache(RadixCache):
    """An evict that frees one page less than asked."""

    def evict(self, params: Any) -> Any:
        params.num_tokens = max(0, params.num_tokens - self.page_size)
        return super().evict(params)


# -- libCacheSim -----------------------------------------------------------------------------
class NoRemoveS3FIFO(libcachesim.S3FIFO):
    """A remove that reports success and removes nothing."""

    def remove(self, obj_id: int) -> bool:
        return True


class StaleLRU(libcachesim.LRU):
    """A hit that does not refresh recency (a FIFO)."""

    def get(self, req: Any) -> bool:
        if self.find(req, update_cache=False) is not None:
            return True
        return bool(super().get(req))


# -- Dynamo ----------------------------------------------------------------------------------
class _WrappedRadixTree:
    """Dynamo's ``RadixTree``, each event passed through `_event` first (``None``: dropped)."""

    def __init__(self) -> None:
        self.tree = RadixTree()

    def _event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        return event

    def apply_event(self, worker_id: int, raw: bytes) -> None:
        event = self._event(json.loads(raw))
        if event is not None:
            self.tree.apply_event(worker_id, json.dumps(event).encode())

    def find_matches(self, sequence: list[int], early_exit: bool = False) -> Any:
        return self.tree.find_matches(sequence, early_exit)

    def clear_all_blocks(self, worker_id: int) -> None:
        self.tree.clear_all_blocks(worker_id)


class _RemovalDroppingTree(_WrappedRadixTree):
    def _event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        return None if isinstance(event["data"], dict) and "removed" in event["data"] else event


class _ParentIgnoringTree(_WrappedRadixTree):
    def _event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        if isinstance(event["data"], dict) and "stored" in event["data"]:
            event["data"]["stored"]["parent_hash"] = None
        return event


class RemovalDroppingIndex(DynamoIndexAdapter):
    """Dynamo's tree that never applies a ``removed`` event (evicted blocks stay indexed)."""

    def __init__(self) -> None:
        super().__init__(tree_cls=_RemovalDroppingTree)


class ParentIgnoringIndex(DynamoIndexAdapter):
    """Dynamo's tree fed every ``stored`` block without its parent (each hangs from the
    root, so no chain longer than one block is found)."""

    def __init__(self) -> None:
        super().__init__(tree_cls=_ParentIgnoringTree)
