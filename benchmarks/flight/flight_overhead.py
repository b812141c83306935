"""Decision overhead of the single-flight coordinator as the number of open flights grows.

For each size N (10, 1,000, 100,000 concurrent flights) the coordinator is filled with N open
flights (a leader and one waiting follower each), then a steady stream of events is timed
that keeps N constant: a new leader arrives, a follower joins it, the oldest leader's
prefill completes (its follower is released, the flight closes) and both finish. That is
five `handle` calls per cycle covering Lead, Wait, Release and termination. Variants: the
plain default (AFTER_PREFILL), with ``max_wait`` (deadline queue), and with partial-prefix
coordination over 32-block prompts (an index lookup per block). Sizes are interleaved and
repeated; the table shows the median and best microseconds per event and the ratio of the
largest size to the smallest. The cost of building a `FlightKey` from a 500-token prompt
(host side, once per request) is shown for scale.

    python benchmarks/flight/flight_overhead.py [--rounds 5] [--cycles 20000] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixflight.core import (
    FlightConfig,
    FlightCoordinator,
    FlightKey,
    ReleasePolicy,
)
from prefixflight.core.flight import Arrived, Finished, FlightEvent, PrefillDone

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

SIZES = (10, 1_000, 100_000)
BLOCKS = 32


def _key(i: int) -> FlightKey:
    return FlightKey(b"", i.to_bytes(32, "little"), 500)


def _blocks(i: int, partial: bool) -> tuple[object, ...]:
    if not partial:
        return ()
    return tuple((i << 8) | j for j in range(BLOCKS))  # distinct per prompt


VARIANTS: dict[str, Callable[[], FlightConfig]] = {
    "after_prefill": lambda: FlightConfig(policy=ReleasePolicy.AFTER_PREFILL),
    "max_wait": lambda: FlightConfig(policy=ReleasePolicy.AFTER_PREFILL, max_wait=1e9),
    "partial_prefix": lambda: FlightConfig(policy=ReleasePolicy.AFTER_PREFILL, min_shared_blocks=4),
}


def _setup(n: int, cycles: int, config: FlightConfig) -> tuple[FlightCoordinator, list[Any]]:
    partial = config.min_shared_blocks is not None
    c = FlightCoordinator(config)
    now = 0.0
    for i in range(n):  # N open flights: leader 2i, follower 2i + 1
        c.handle(Arrived(request_id=2 * i, key=_key(i), now=now, blocks=_blocks(i, partial)))
        c.handle(Arrived(request_id=2 * i + 1, key=_key(i), now=now, blocks=_blocks(i, partial)))
    events: list[FlightEvent] = []
    for k in range(cycles):
        new, old = n + k, k
        now += 1e-6
        blocks = _blocks(new, partial)
        events += [
            Arrived(request_id=2 * new, key=_key(new), now=now, blocks=blocks),
            Arrived(request_id=2 * new + 1, key=_key(new), now=now, blocks=blocks),
            PrefillDone(request_id=2 * old, now=now),
            Finished(request_id=2 * old, now=now),
            Finished(request_id=2 * old + 1, now=now),
        ]
    return c, events


def _time(c: FlightCoordinator, events: list[Any]) -> float:
    handle = c.handle
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for ev in events:
            handle(ev)
        t1 = time.perf_counter_ns()
    finally:
        gc.enable()
    assert len(c) >= min(SIZES), "the number of open flights must stay constant"
    return (t1 - t0) / 1e3 / len(events)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cycles", type=int, default=20_000, help="5 events each")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)

    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for variant, make in VARIANTS.items():
            for n in SIZES:  # interleaved: noise hits every size alike
                c, events = _setup(n, args.cycles, make())
                assert len(c) == n
                samples.setdefault((variant, n), []).append(_time(c, events))
                assert len(c) == n

    prompt = list(range(500))
    t0 = time.perf_counter_ns()
    reps = 2_000
    for _ in range(reps):
        FlightKey.of(prompt)
    key_us = (time.perf_counter_ns() - t0) / 1e3 / reps

    rows = []
    print(f"{'variant':<16}{'flights':>10}{'median us/event':>18}{'best us/event':>16}")
    for variant in VARIANTS:
        base = statistics.median(samples[variant, SIZES[0]])
        for n in SIZES:
            s = samples[variant, n]
            med = statistics.median(s)
            print(f"{variant:<16}{n:>10,}{med:>18.3f}{min(s):>16.3f}")
            rows.append(
                {
                    "variant": variant,
                    "flights": n,
                    "median_us_per_event": med,
                    "best_us_per_event": min(s),
                    "samples_us_per_event": s,
                    "ratio_to_smallest": med / base,
                }
            )
        top = statistics.median(samples[variant, SIZES[-1]])
        print(f"{'':<16}{'ratio':>10}{top / base:>17.2f}x  ({SIZES[-1]:,} vs {SIZES[0]} flights)")
    print(f"\nFlightKey.of(500 tokens), host side, once per request: {key_us:.2f} us")
    if args.json:
        data = {
            "benchmark": "flight_overhead",
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "rounds": args.rounds,
            "events_per_sample": 5 * args.cycles,
            "rows": rows,
            "flight_key_500_tokens_us": key_us,
        }
        harness.write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
