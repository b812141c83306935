"""A/B of the coordinator's decision overhead: this checkout against another one, in one
process, interleaved.

The other checkout's ``prefixflight`` package is imported under another name (pass the
folder that holds it renamed, e.g. ``prefixflight_old``). For each variant of
`flight_overhead.py` (1,000 open flights) short samples of the same event stream alternate
between the two implementations; CPU time of this process (not wall time, so other load on
a shared machine counts less) per event, best and median of the samples, and the ratio.

    python benchmarks/flight/flight_ab.py --other /tmp/old --name prefixflight_old [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

N_FLIGHTS = 1_000
BLOCKS = 32


def _run(core: ModuleType, variant: str, cycles: int) -> float:
    cfg: dict[str, Any] = {
        "after_prefill": {},
        "max_wait": {"max_wait": 1e9},
        "partial_prefix": {"min_shared_blocks": 4},
    }
    cfg = cfg[variant]
    partial = variant == "partial_prefix"
    c = core.FlightCoordinator(core.FlightConfig(**cfg))

    def key(i: int) -> Any:
        return core.FlightKey(b"", i.to_bytes(32, "little"), 500)

    def blocks(i: int) -> tuple[int, ...]:
        return tuple((i << 8) | j for j in range(BLOCKS)) if partial else ()

    now = 0.0
    for i in range(N_FLIGHTS):
        c.handle(core.Arrived(request_id=2 * i, key=key(i), now=now, blocks=blocks(i)))
        c.handle(core.Arrived(request_id=2 * i + 1, key=key(i), now=now, blocks=blocks(i)))
    events: list[Any] = []
    for k in range(cycles):
        new, old = N_FLIGHTS + k, k
        now += 1e-6
        events += [
            core.Arrived(request_id=2 * new, key=key(new), now=now, blocks=blocks(new)),
            core.Arrived(request_id=2 * new + 1, key=key(new), now=now, blocks=blocks(new)),
            core.PrefillDone(request_id=2 * old, now=now),
            core.Finished(request_id=2 * old, now=now),
            core.Finished(request_id=2 * old + 1, now=now),
        ]
    handle = c.handle
    gc.disable()
    try:
        t0 = time.process_time_ns()
        for ev in events:
            handle(ev)
        t1 = time.process_time_ns()
    finally:
        gc.enable()
    assert len(c) == N_FLIGHTS
    return (t1 - t0) / 1e3 / len(events)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", required=True, help="folder holding the other package")
    p.add_argument("--name", required=True, help="the other package's (renamed) name")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cycles", type=int, default=2_000)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(args.other)))
    impls = {
        "this": importlib.import_module("prefixflight.core"),
        "other": importlib.import_module(f"{args.name}.core"),
    }
    variants = ("after_prefill", "max_wait", "partial_prefix")
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for variant in variants:
            for label, core in impls.items():  # interleaved: load hits both alike
                samples.setdefault((variant, label), []).append(_run(core, variant, args.cycles))
    rows = []
    print(f"{'variant':<16}{'other best':>12}{'this best':>12}{'other med':>12}{'this med':>12}"
          f"{'this/other':>12}")  # fmt: skip
    for variant in variants:
        o, t = samples[variant, "other"], samples[variant, "this"]
        row = {
            "variant": variant,
            "other_best_us": min(o),
            "this_best_us": min(t),
            "other_median_us": statistics.median(o),
            "this_median_us": statistics.median(t),
            "ratio_best": min(t) / min(o),
        }
        rows.append(row)
        print(f"{variant:<16}{min(o):>12.3f}{min(t):>12.3f}{statistics.median(o):>12.3f}"
              f"{statistics.median(t):>12.3f}{min(t) / min(o):>11.2f}x")  # fmt: skip
    if args.json:
        doc = {"benchmark": "flight_ab", "flights": N_FLIGHTS, "rounds": args.rounds,
               "events_per_sample": 5 * args.cycles, "cpu_time": True, "rows": rows}  # fmt: skip
        harness.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
