"""vLLM's v1 `KVCacheManager` (and its `BlockPool`) under `PrefixEngineConformance`.

Runs in an environment with vLLM (``benchmarks/peers/setup.sh`` builds one; vLLM 0.33.0 was
checked); vLLM is imported when an adapter is made, never when this module is. One
full-attention group, block size 16, prefix caching and KV events on; requests are
``vllm.v1.request.Request`` objects hashed with vLLM's own sha256 block hasher; a request is
admitted with ``get_computed_blocks`` + ``allocate_slots`` (its whole prompt, as the
scheduler schedules a prefill that fits; then ``record_prefix_cache_stats``, as the scheduler
does since vLLM 0.27) and ends with ``free``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import import_module
from typing import Any

import attrs

from .._adapter import KVChange, PoolView
from .._declare import EngineSemantics
from .._engine_ref import Key

__all__ = ["VLLMAdapter", "VLLMPluginAdapter", "VLLMPluginLRU", "VLLMPluginS3FIFO"]


@functools.cache
def _vllm() -> dict[str, Any]:
    """vLLM's pieces, imported once (this is where a missing vLLM surfaces)."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    torch = import_module("torch")
    hashing = import_module("vllm.utils.hashing")
    utils = import_module("vllm.v1.core.kv_cache_utils")
    iface = import_module("vllm.v1.kv_cache_interface")
    hash_fn = hashing.get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    utils.init_none_hash(hash_fn)
    return {
        "torch": torch,
        "KVCacheManager": import_module("vllm.v1.core.kv_cache_manager").KVCacheManager,
        "BlockPool": import_module("vllm.v1.core.block_pool").BlockPool,
        "coordinator": import_module("vllm.v1.core.kv_cache_coordinator"),
        "SamplingParams": import_module("vllm.sampling_params").SamplingParams,
        "Request": import_module("vllm.v1.request").Request,
        "events": import_module("vllm.distributed.kv_events"),
        "iface": iface,
        "hasher": utils.get_request_block_hasher(16, hash_fn),
        "external": utils.maybe_convert_block_hash,
        "block_hash": utils.get_block_hash,
    }


@contextmanager
def _block_pool_class(cls: type[Any] | None) -> Iterator[None]:
    """Build the manager's `BlockPool` from ``cls`` (vLLM's coordinators construct it by the
    name ``BlockPool`` in their module)."""
    if cls is None:
        yield
        return
    module = _vllm()["coordinator"]
    original = module.BlockPool
    module.BlockPool = cls
    try:
        yield
    finally:
        module.BlockPool = original


class VLLMAdapter:
    """vLLM's `KVCacheManager` over ``pages`` blocks (plus vLLM's reserved null block).

    ``impl`` replaces vLLM's class, built with exactly vLLM's arguments: a `KVCacheManager`
    subclass is built in its place; a `BlockPool` subclass is built in place of the pool the
    manager's coordinator makes. Pages are vLLM's block ids minus one.
    """

    semantics = EngineSemantics(
        hit_cap="n-1",
        publish="at-admit",
        touch="tail-first",
        pins="release-is-use",
        capacity="shared-pool",
        duplicates="kept",
        invalidated="in-place",
        evictions="reported",
        ops=frozenset({"invalidate", "reset", "stats"}),
    )
    block_size = 16
    max_model_len = 256

    def __init__(self, pages: int, *, impl: type[Any] | None = None) -> None:
        v = _vllm()
        iface = v["iface"]
        spec = iface.FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=1, head_size=64, dtype=v["torch"].float16
        )
        config = iface.KVCacheConfig(
            num_blocks=pages + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[iface.KVCacheGroupSpec(["layer.0"], spec)],
        )
        manager_cls = v["KVCacheManager"]
        pool_cls = None
        if impl is not None:
            if issubclass(impl, v["BlockPool"]):
                pool_cls = impl
            else:
                manager_cls = impl
        with _block_pool_class(pool_cls):
            self.manager = manager_cls(
                config,
                max_model_len=self.max_model_len,
                scheduler_block_size=self.block_size,
                hash_block_size=self.block_size,
                enable_caching=True,
                enable_kv_cache_events=True,
                log_stats=True,
            )
        self.pages = pages
        self._keys: dict[Any, Key] = {}  # vLLM block hash -> key
        self._external: dict[Any, Key] = {}  # the hash KV events carry -> key
        self._requests: dict[str, Any] = {}
        self._queried = 0
        self._hit = 0

    def _request(self, rid: str, tokens: Sequence[int]) -> Any:
        v = _vllm()
        req = v["Request"](
            rid, list(tokens), v["SamplingParams"](max_tokens=1), None, block_hasher=v["hasher"]
        )
        bs = self.block_size
        for i, h in enumerate(req.block_hashes):
            key = tuple(tokens[: (i + 1) * bs])
            self._keys[h] = key
            self._external[v["external"](h)] = key
        return req

    def admit(self, rid: str, tokens: Sequence[int]) -> int | None:
        req = self._request(rid, tokens)
        blocks, computed = self.manager.get_computed_blocks(req)[:2]
        got = self.manager.allocate_slots(req, req.num_tokens - computed, computed, blocks)
        if got is None:
            return None
        record = getattr(self.manager, "record_prefix_cache_stats", None)
        if record is not None:  # since 0.27 the scheduler records a request once it allocates
            record(req, computed)
        self._requests[rid] = req
        return int(computed)

    def finish(self, rid: str) -> None:
        self.manager.free(self._requests.pop(rid))

    def _key(self, block: Any) -> Key:
        return self._keys[_vllm()["block_hash"](block.block_hash)]

    def pool(self) -> PoolView:
        blocks = self.manager.block_pool.blocks[1:]  # block 0 is vLLM's null block
        cached = {b.block_id - 1: self._key(b) for b in blocks if b.block_hash is not None}
        free = frozenset(b.block_id - 1 for b in blocks if b.block_hash is None and b.ref_cnt == 0)
        held = {
            rid: frozenset(i - 1 for i in self.manager.get_block_ids(rid)[0])
            for rid in self._requests
        }
        return PoolView(free, cached, held)

    def events(self) -> list[KVChange]:
        ev = _vllm()["events"]
        out: list[KVChange] = []
        for event in self.manager.take_events():
            if isinstance(event, ev.BlockStored):
                out += [("stored", self._external[h]) for h in event.block_hashes]
            elif isinstance(event, ev.BlockRemoved):
                out += [("removed", self._external[h]) for h in event.block_hashes]
            elif isinstance(event, ev.AllBlocksCleared):
                out.append(("cleared", None))
        return out

    def hit_stats(self) -> tuple[int, int]:
        """The prompt tokens vLLM's prefix-cache stats counted as queried and as hit (what
        its hit-rate metric reads), summed over ``make_prefix_cache_stats`` calls."""
        stats = self.manager.make_prefix_cache_stats()
        if stats is not None:
            self._queried += stats.queries
            self._hit += stats.hits
        return self._queried, self._hit

    def invalidate(self, key: Key) -> None:
        """`KVCacheManager.evict_blocks` of every block caching ``key``."""
        ids = {
            b.block_id
            for b in self.manager.block_pool.blocks[1:]
            if b.block_hash is not None and self._key(b) == key
        }
        self.manager.evict_blocks(ids)

    def reset(self) -> None:
        assert self.manager.reset_prefix_cache(), "reset_prefix_cache refused with nothing running"


class VLLMPluginAdapter(VLLMAdapter):
    """vLLM's `KVCacheManager` with ``prefixflight.vllm``'s free queue in its pool, ordered
    by prefixflight's ``policy`` (as ``--additional-config '{"prefixflight": {"eviction":
    POLICY}}'`` runs it); checked against the reference engine running that policy's plain
    model. A subclass declares the policy (`VLLMPluginLRU`, `VLLMPluginS3FIFO`)."""

    def __init__(self, pages: int, *, impl: type[Any] | None = None) -> None:
        super().__init__(pages, impl=impl)
        plugin = import_module("prefixflight.vllm")
        settings = plugin.EvictionSettings(policy=self.semantics.policy)
        pool = self.manager.block_pool
        self.queue = plugin.install(
            pool,
            settings.build(pool.num_gpu_blocks - 1),
            refresh_on_free=settings.refresh_on_free,
        )


class VLLMPluginLRU(VLLMPluginAdapter):
    """``prefixflight.vllm`` with ``"eviction": "lru"``: stock vLLM's order, but a block's
    recency is its hash's (its last release, of any copy) and redundant copies go first."""

    semantics = attrs.evolve(
        VLLMAdapter.semantics,
        policy="lru",
        pins="release-is-use",
        orphans="removed",
        invalidated="reused-first",
    )


class VLLMPluginS3FIFO(VLLMPluginAdapter):
    """``prefixflight.vllm`` with ``"eviction": "s3fifo"``: frequency from hits, the ghost
    keyed by block hash; a release is not an access."""

    semantics = attrs.evolve(VLLMPluginLRU.semantics, policy="s3fifo", pins="ours")
