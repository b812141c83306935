"""Assignment overhead of `BurstRouter`: cost per request vs batch size and replica count.

For batches of 10, 100 and 1,000 requests over 4, 16 and 64 replicas it times
`assign_batch` (the work done when a window seals) on a GRPO-shaped batch (groups of 8
identical two-block prompts, every prompt sharing its first block with one other prompt,
``min_colocate_blocks=1`` so the prefix index is exercised), and, side by side, the
approximate prefix router (`ApproxPrefixRouter.route`, one request at a time) on the same
requests. A second, adversarial shape ("shared") makes every request its own unit: n
distinct prompts sharing one leading block. Timings are interleaved and repeated; the
minimum per configuration is reported.

Growth: if assignment were O(n log n) in the batch size n, the cost *per request* would grow
at most like log n, i.e. by log(1000)/log(10) = 3x from n=10 to n=1000. The table prints the
measured ratio next to that bound. Measured, not asserted.

    python benchmarks/router/router_overhead.py [--repeat 5] [--json out/router_overhead.json]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from prefixflight.core import BurstConfig, ReplicaLoad, RouteRequest
from prefixflight.core.routing import ApproxPrefixRouter, assign_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

SIZES = (10, 100, 1000)
REPLICAS = (4, 16, 64)


def batch(n: int, rng: random.Random) -> list[RouteRequest]:
    out: list[RouteRequest] = []
    prompt = 0
    while len(out) < n:
        family = prompt // 2  # two prompts share their first block
        blocks = (("f", family), ("p", prompt))
        for _ in range(min(8, n - len(out))):
            out.append(RouteRequest(request_id=len(out), blocks=blocks, num_tokens=128))
        prompt += 1
    rng.shuffle(out)
    return out


def shared_batch(n: int) -> list[RouteRequest]:
    """The adversarial shape: n distinct prompts sharing one leading block, so every request
    is its own unit and every unit matches every replica already holding the prefix."""
    return [
        RouteRequest(request_id=i, blocks=(("s", 0), ("q", i)), num_tokens=128) for i in range(n)
    ]


def time_call(fn: Any, loops: int) -> float:
    t = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - t) / loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="out/router_overhead.json")
    args = ap.parse_args()
    rng = random.Random(0)
    config = BurstConfig(min_colocate_blocks=1)
    cases = [(n, r) for r in REPLICAS for n in SIZES]
    batches = {n: batch(n, rng) for n in SIZES}
    loads = {r: [ReplicaLoad(name=f"r{i:02d}", running=i % 3) for i in range(r)] for r in REPLICAS}
    shared = {n: shared_batch(n) for n in SIZES}
    burst: dict[tuple[int, int], float] = {}
    burst_shared: dict[tuple[int, int], float] = {}
    approx: dict[tuple[int, int], float] = {}
    for _ in range(args.repeat):  # interleave the configurations, keep each one's best
        for n, r in cases:
            reqs, reps = batches[n], loads[r]
            loops = max(1, 20000 // n)
            t = time_call(lambda reqs=reqs, reps=reps: assign_batch(reqs, reps, config), loops)
            burst[n, r] = min(burst.get((n, r), math.inf), t / n)
            sh = shared[n]
            t = time_call(lambda sh=sh, reps=reps: assign_batch(sh, reps, config), loops)
            burst_shared[n, r] = min(burst_shared.get((n, r), math.inf), t / n)

            def route_all(reqs: list[RouteRequest] = reqs, reps: list[ReplicaLoad] = reps) -> None:
                router = ApproxPrefixRouter()
                for q in reqs:
                    router.route(q, 0.0, reps)

            t = time_call(route_all, max(1, 4000 // n))
            approx[n, r] = min(approx.get((n, r), math.inf), t / n)

    bound = math.log(SIZES[-1]) / math.log(SIZES[0])
    print(
        f"{'replicas':>8} {'batch':>6} {'burst us/req':>13} {'shared us/req':>14} "
        f"{'approx us/req':>14} {'burst/approx':>13}"
    )
    rows: list[dict[str, Any]] = []
    for r in REPLICAS:
        for n in SIZES:
            b, a = burst[n, r] * 1e6, approx[n, r] * 1e6
            s_us = burst_shared[n, r] * 1e6
            print(f"{r:>8} {n:>6} {b:>13.2f} {s_us:>14.2f} {a:>14.2f} {b / a:>13.2f}")
            rows.append(
                {
                    "replicas": r,
                    "batch": n,
                    "burst_us_per_request": b,
                    "burst_shared_us_per_request": s_us,
                    "approx_us_per_request": a,
                }
            )
    print()
    growth: dict[str, float] = {}
    for label, table in (("grpo", burst), ("shared", burst_shared)):
        for r in REPLICAS:
            g = table[SIZES[-1], r] / table[SIZES[0], r]
            growth[f"{label}/{r}"] = g
            verdict = "within" if g <= bound else "ABOVE"
            print(
                f"{label:>6}, {r:>2} replicas: per-request cost x{g:.2f} from batch "
                f"{SIZES[0]} to {SIZES[-1]} ({verdict} the n log n bound x{bound:.1f})"
            )
    path = Path(args.json)
    harness.write_json(
        path,
        {
            "rows": rows,
            "growth_10_to_1000": growth,
            "nlogn_bound": bound,
            "repeat": args.repeat,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
