"""Run in the peers environment (vLLM 0.33.0): prefixflight.vllm's `PolicyQueue` swapped into
the `BlockPool` of vLLM's own `KVCacheManager`, driven by seeded random request sequences
(admit with ``get_computed_blocks`` + ``allocate_slots``, end with ``free``; up to 4 running,
a pool of 24 blocks of 16 tokens), beside stock vLLM on the same sequence. Prints one JSON
object: per policy, the sequences whose hits differ from stock's, the queue's counters, and
every invariant broken after any step.

    python vllm_plugin_side.py SEEDS
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import attrs

from prefixflight.specs.adapters import VLLMAdapter, VLLMPluginS3FIFO
from prefixflight.vllm import EvictionSettings, PolicyQueue, install


def sequence(seed: int, aligned: bool) -> list[tuple[str, list[int] | None]]:
    """("admit", tokens) and ("finish", None) steps; with ``aligned``, some prompts end on a
    block boundary and repeat, so vLLM caches copies of a block."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(16 * rng.randint(1, 4))] for _ in range(6)]
    tails = [0, 1, 5, 16, 17, 32] if aligned else [1, 5, 17, 40]
    steps: list[tuple[str, list[int] | None]] = []
    running = 0
    for _ in range(300):
        if running and (rng.random() < 0.5 or running > 3):
            steps.append(("finish", None))
            running -= 1
            continue
        vocab = 4 if aligned else 1000
        tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.choice(tails))]
        steps.append(("admit", tokens))
        running += 1
    return steps


def check(adapter: VLLMAdapter, queue: PolicyQueue) -> list[str]:
    pool = adapter.manager.block_pool
    broken = []
    free = [b for b in pool.blocks[1:] if b.ref_cnt == 0]
    if queue.num_free_blocks != len(free) or not all(queue.is_free(b) for b in free):
        broken.append("free blocks differ from unheld blocks")
    if any(b.ref_cnt < 0 for b in pool.blocks):
        broken.append("negative ref_cnt")
    keys = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    if keys != set(queue.cached_keys()) or keys != set(queue.policy.resident()):
        broken.append("the policy's residency is not vLLM's set of cached hashes")
    for rid in adapter._requests:
        for b in adapter.manager.coordinator.single_type_managers[0].req_to_blocks[rid]:
            if b.block_hash is not None and b.block_hash not in keys:
                broken.append("a held block lost its hash")
    try:
        queue.policy.check_invariants()
    except AssertionError as exc:
        broken.append(f"policy invariant: {exc}")
    return broken


def run(seed: int, aligned: bool, policy: str | None) -> dict[str, Any]:
    adapter = VLLMAdapter(24)
    queue = None
    if policy is not None:
        pool = adapter.manager.block_pool
        settings = EvictionSettings.parse(policy)
        queue = install(
            pool,
            settings.build(pool.num_gpu_blocks - 1),
            refresh_on_free=settings.refresh_on_free,
        )
    hits: list[int | None] = []
    running: list[str] = []
    broken: list[str] = []
    rng = random.Random(seed + 1)
    for i, (op, tokens) in enumerate(sequence(seed, aligned)):
        if op == "finish":
            adapter.finish(running.pop(rng.randrange(len(running))))
        else:
            assert tokens is not None
            got = adapter.admit(f"r{i}", tokens)
            hits.append(got)
            if got is not None:
                running.append(f"r{i}")
        if queue is not None:
            broken += [f"step {i}: {b}" for b in check(adapter, queue)]
    stats = {} if queue is None else attrs.asdict(queue.stats)
    return {"hits": hits, "broken": broken[:5], "stats": stats}


class _LongPrompts(VLLMPluginS3FIFO):
    max_model_len = 64_000


def deep_chain(blocks: int) -> dict[str, Any]:
    """One request caches a chain of ``blocks`` blocks and ends; its first block is then
    invalidated: every descendant leaves with it (the plugin's queue, S3-FIFO)."""
    adapter = _LongPrompts(blocks + 1)
    tokens = list(range(blocks * 16 + 1))
    adapter.admit("r0", tokens)
    adapter.finish("r0")
    adapter.invalidate(tuple(tokens[:16]))
    broken = check(adapter, adapter.queue)
    return {"orphans_evicted": adapter.queue.stats.orphans_evicted, "broken": broken,
            "cached": len(adapter.queue.cached_keys())}  # fmt: skip


def main(seeds: int) -> None:
    out: dict[str, Any] = {"deep_chain": deep_chain(3000)}
    for policy in ("lru", "s3fifo"):
        for aligned in (False, True):
            differs, broken, copies, evicted, hit_sum, stock_sum = [], [], 0, 0, 0, 0
            for seed in range(seeds):
                stock = run(seed, aligned, None)["hits"]
                ours = run(seed, aligned, policy)
                if ours["hits"] != stock:
                    differs.append(seed)
                broken += ours["broken"]
                copies += ours["stats"]["copies"]
                evicted += ours["stats"]["evicted"]
                hit_sum += sum(h or 0 for h in ours["hits"])
                stock_sum += sum(h or 0 for h in stock)
            out[f"{policy}/{'aligned' if aligned else 'unaligned'}"] = {
                "differs": differs, "broken": broken[:5], "copies": copies,
                "evicted": evicted, "hit_tokens": hit_sum, "stock_hit_tokens": stock_sum,
            }  # fmt: skip
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]))
