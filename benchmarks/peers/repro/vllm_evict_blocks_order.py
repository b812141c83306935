"""vLLM: ``BlockPool.evict_blocks`` leaves an invalidated block in place in the free queue,
so the next allocation evicts a *valid* cached block first.

Reproduces on vLLM alone (checked with vllm 0.33.0, CPU, no model):

    python vllm_evict_blocks_order.py    # exit 1: reproduced; exit 0: fixed

A pool of 2 blocks. A 32-token prompt caches blocks B1 (tokens 0-15) and B2 (0-31) and ends:
both are free and cached, B2 first in line for eviction (freed tail first). Then
``evict_blocks({B1})`` (what a KV connector calls for a block it failed to load): B1 loses
its hash, so it holds nothing any request can hit -- but it keeps its place at the *end* of
the free queue. A 1-token prompt then needs one block: the pool pops the head, B2, and evicts
its still-valid prefix-cache entry, although B1 is free and holds nothing.

``BlockPool.free_blocks`` handles the same situation the other way: a block without a hash
is *prepended* ("LIFO reuse of non-cached blocks"), so it is reused before any cached block
is evicted. ``evict_blocks`` (via ``_maybe_evict_cached_block``) resets the hash without
moving the block. Expected: the 1-token prompt reuses B1 and B2 stays cached.
"""

from __future__ import annotations

import logging
import sys

logging.disable(logging.WARNING)

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

BLOCK = 16
hash_fn = get_hash_fn_by_name("sha256")
init_none_hash(hash_fn)
hasher = get_request_block_hasher(BLOCK, hash_fn)
spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
config = KVCacheConfig(
    num_blocks=3,  # 2 blocks + the null block
    kv_cache_tensors=[],
    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
)
manager = KVCacheManager(
    config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK
)
pool = manager.block_pool


def run(rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    blocks, computed = manager.get_computed_blocks(req)[:2]
    assert manager.allocate_slots(req, req.num_tokens - computed, computed, blocks) is not None
    return req


def cached(req: Request) -> list[bool]:
    """Whether each of ``req``'s full blocks is still in the prefix cache."""
    return [pool.get_cached_block(h, [0]) is not None for h in req.block_hashes]


first = run("first", list(range(2 * BLOCK)))
b1, b2 = (b.block_id for b in manager.get_blocks("first").blocks[0])
manager.free(first)
print(f"after the 32-token prompt: B1={b1}, B2={b2} cached: {cached(first)}")
print("free queue, head first:", [b.block_id for b in pool.free_block_queue.get_all_free_blocks()])

manager.evict_blocks({b1})
print(f"evict_blocks({{{b1}}}): cached: {cached(first)}")
print("free queue, head first:", [b.block_id for b in pool.free_block_queue.get_all_free_blocks()])

second = run("second", [7])
used = [b.block_id for b in manager.get_blocks("second").blocks[0]]
print(f"a 1-token prompt got block {used}; the 32-token prompt's blocks cached: {cached(first)}")
if cached(first)[1]:
    print("not reproduced: the invalidated block was reused first")
    sys.exit(0)
print(
    f"REPRODUCED: block {b2} (a valid cached block) was evicted while block {b1} "
    "(invalidated, holding nothing) stayed free"
)
sys.exit(1)
