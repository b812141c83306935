"""A 32-capacity exact LRU curve (one Mattson pass) versus 3 single-capacity LRU replays.

Both sides run over the same trace in one process, interleaved over several rounds in
rotating order; medians are reported. Two views:

* ``from file``: each side reads and parses the trace itself, as a user would (the curve
  once, each replay once);
* ``in memory``: the trace is parsed once up front; only the cache work is timed.

Usage: python benchmarks/cache/sweep.py [--trace PATH] [--rounds 5] [--json out/bench_sweep.json]
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
from prefixflight.core.cache import LRUCurve

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

DEFAULT_TRACE = "bundled:conversation"
REPLAY_CAPACITIES = (1024, 4096, 16384)


def curve_capacities(n: int = 32) -> list[int]:
    """32 capacities, log-spaced over 16 .. 2**20 blocks."""
    return sorted({round(16 * 2 ** (16 * i / (n - 1))) for i in range(n)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="out/bench_sweep.json")
    args = ap.parse_args()
    caps = curve_capacities()
    assert len(caps) == 32, caps

    with read_trace(args.trace) as reader:
        records: list[TraceRecord] = list(reader)
    blocks = sum(len(r.hash_ids) for r in records)

    def curve_file() -> object:
        curve = LRUCurve(caps, 512)
        with read_trace(args.trace) as reader:
            curve.feed(reader)
        return curve.points()

    def replays_file() -> object:
        out = []
        for cap in REPLAY_CAPACITIES:
            with read_trace(args.trace) as reader:
                out.append(replay(reader, policy="lru", cache_capacity_blocks=cap))
        return out

    def curve_mem() -> object:
        curve = LRUCurve(caps, 512)
        curve.feed(records)
        return curve.points()

    def replays_mem() -> object:
        return [replay(records, policy="lru", cache_capacity_blocks=c) for c in REPLAY_CAPACITIES]

    # same work: the curve's points at the replayed capacities equal the replays
    curve = LRUCurve([*caps, *REPLAY_CAPACITIES], 512)
    curve.feed(records)
    for point, cap in zip(curve.points()[len(caps) :], REPLAY_CAPACITIES, strict=True):
        rep = replay(records, policy="lru", cache_capacity_blocks=cap)
        assert (point.total_hit_tokens, point.final_cache_blocks) == (
            rep.total_hit_tokens,
            rep.final_cache_blocks,
        ), cap

    cases: dict[str, Callable[[], object]] = {
        "from file: LRU curve, 32 capacities": curve_file,
        "from file: 3 LRU replays": replays_file,
        "in memory: LRU curve, 32 capacities": curve_mem,
        "in memory: 3 LRU replays": replays_mem,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for rnd in range(args.rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"trace {args.trace}: {len(records)} requests, {blocks} block accesses; "
        f"median of {args.rounds} interleaved rounds"
    )
    print(f"{'case':40} {'median s':>9} {'best s':>8} {'us/block':>9}")
    for name, ts in times.items():
        print(f"{name:40} {med[name]:9.3f} {min(ts):8.3f} {1e6 * med[name] / blocks:9.2f}")
    ratios = {
        "from file: 3 replays / curve": med["from file: 3 LRU replays"]
        / med["from file: LRU curve, 32 capacities"],
        "in memory: 3 replays / curve": med["in memory: 3 LRU replays"]
        / med["in memory: LRU curve, 32 capacities"],
    }
    for name, r in ratios.items():
        print(f"{name}: {r:.2f}x (target > 1: the curve is faster than 3 replays)")
    out = Path(args.json)
    harness.write_json(
        out,
        {
            "trace": args.trace,
            "requests": len(records),
            "block_accesses": blocks,
            "curve_capacities": caps,
            "replay_capacities": list(REPLAY_CAPACITIES),
            "rounds": args.rounds,
            "seconds": times,
            "median_seconds": med,
            "ratios": ratios,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
