"""What checked mode costs a step: `PoolChecker.check` over vLLM's own pool, by pool size.

Runs in the peers environment (vLLM 0.33.0's `KVCacheManager` and `BlockPool`, no model;
benchmarks/peers/setup.sh builds it). The pool is filled with cached blocks (requests of 15
blocks admitted and freed), a quarter of it held by running requests, then ``check()`` is
timed (median of 20) beside one admission and free of a 15-block request through vLLM's
manager, the scheduler-side work a step does per request.

    .venv-peers/bin/python benchmarks/vllm/vllm_plugin_check_cost.py [--json FILE]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

from prefixflight.specs.adapters import VLLMAdapter
from prefixflight.vllm import EvictionSettings, PoolChecker, install

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness


def measure(blocks: int) -> dict[str, float]:
    adapter = VLLMAdapter(blocks)
    pool = adapter.manager.block_pool
    settings = EvictionSettings.parse("lru")
    queue = install(pool, settings.build(pool.num_gpu_blocks - 1), refresh_on_free=True)
    manager = adapter.manager.coordinator.single_type_managers[0]
    checker = PoolChecker(pool, queue, manager, logging.getLogger("check-cost"))
    for i in range(blocks // 15):  # fill the pool with cached blocks
        adapter.admit(f"fill{i}", list(range(i * 2000, i * 2000 + 15 * 16)))
        adapter.finish(f"fill{i}")
    for i in range(blocks // 4 // 15):  # a quarter of it held
        adapter.admit(f"run{i}", list(range(i * 2000, i * 2000 + 15 * 16)))
    checks, steps = [], []
    for n in range(20):
        queue.computed[:] = [True] * len(queue.computed)  # no model runs here: all written
        t = time.perf_counter()
        checker.check()
        checks.append(time.perf_counter() - t)
        t = time.perf_counter()
        adapter.admit(f"x{n}", list(range(10**7 + n * 2000, 10**7 + n * 2000 + 15 * 16)))
        adapter.finish(f"x{n}")
        steps.append(time.perf_counter() - t)
    assert checker.violations == 0
    return {
        "pool_blocks": blocks,
        "check_ms": round(statistics.median(checks) * 1000, 3),
        "admit_and_free_15_blocks_ms": round(statistics.median(steps) * 1000, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [measure(b) for b in (512, 4096, 32768)]
    for r in rows:
        print(
            f"pool {r['pool_blocks']:>6} blocks: check {r['check_ms']:.2f} ms per step, "
            f"a 15-block admission + free {r['admit_and_free_15_blocks_ms']:.2f} ms"
        )
    if args.json:
        harness.write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
