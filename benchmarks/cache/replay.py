"""Block accesses per second of our S3FIFO and LRU replays against the reference models.

Side by side in one run, interleaved over rounds in rotating order so machine noise hits
every contender alike. Prints a table with the ratios and writes JSON.

    python benchmarks/cache/replay.py [--trace bundled:conversation] [--capacity 4096]
                                [--rounds 5] [--json out/replay.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prefixflight.cli import read_trace
from prefixflight.core import TraceRecord, replay
from prefixflight.specs import reference_replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness


def contenders(records: tuple[TraceRecord, ...], capacity: int) -> dict[str, Callable[[], int]]:
    def ours(policy: str) -> Callable[[], int]:
        return lambda: (
            replay(records, policy=policy, cache_capacity_blocks=capacity).total_hit_tokens
        )

    def ref(policy: str) -> Callable[[], int]:
        return lambda: (
            reference_replay(
                records, policy=policy, cache_capacity_blocks=capacity
            ).total_hit_tokens
        )

    return {
        "ours s3fifo": ours("s3fifo"),
        "reference s3fifo": ref("s3fifo"),
        "ours lru": ours("lru"),
        "reference lru": ref("lru"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="bundled:conversation")
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with read_trace(args.trace) as reader:
        records = tuple(reader)
    blocks = sum(len(r.hash_ids) for r in records)
    runs = contenders(records, args.capacity)
    names = list(runs)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    hits: dict[str, int] = {}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            hits[name] = runs[name]()
            seconds[name].append(time.perf_counter() - t0)
    for policy in ("s3fifo", "lru"):
        assert hits[f"ours {policy}"] == hits[f"reference {policy}"], "different work"
    rate = {n: blocks / statistics.median(s) for n, s in seconds.items()}
    print(
        f"trace {args.trace}: {len(records)} requests, {blocks} block accesses, "
        f"capacity {args.capacity}, median of {args.rounds} interleaved rounds"
    )
    print(f"{'contender':<18} {'M accesses/s':>13} {'ratio vs reference':>19}")
    for name in names:
        ref = rate["reference " + name.split()[1]]
        print(f"{name:<18} {rate[name] / 1e6:>13.2f} {rate[name] / ref:>18.2f}x")
    result = {
        "trace": args.trace,
        "capacity_blocks": args.capacity,
        "requests": len(records),
        "block_accesses": blocks,
        "rounds": args.rounds,
        "accesses_per_second": rate,
        "seconds": seconds,
        "ratio_s3fifo": rate["ours s3fifo"] / rate["reference s3fifo"],
        "ratio_lru": rate["ours lru"] / rate["reference lru"],
    }
    if args.json:
        harness.write_json(args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
