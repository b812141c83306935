"""How the burst router's gain grows with prompt length, and how the baseline depends on
its index lag. The shape of llm-d's burst prefix-affinity PR: 4 replicas, G=8, k=-1, a
100 ms window.

For each prompt-length range the same GRPO workload (same seed) runs through the baseline
(llm-d's approximate prefix router) and through the burst router in front of it; the table
prints co-location, hit rate and step times side by side with the step-time gain. A second
table varies the baseline's ``index_lag`` (how late a routing decision reaches its index) on
the PR's short prompts: that one parameter decides how badly a cold burst scatters.

    python benchmarks/router/router_gain.py [--steps 40] [--json out/router_gain.json]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from prefixflight.core import BurstConfig, BurstRouter, ReplicaLoad
from prefixflight.core.routing import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
)
from prefixflight.sim import (
    ClusterConfig,
    RouterReport,
    Workload,
    grpo_workload,
    simulate_cluster,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

LENGTHS = ((64, 128), (256, 512), (1024, 2048), (4096, 8192))
LAGS_MS = (0.0, 2.0, 5.0, 10.0, 20.0, 50.0)


def run_pair(
    wl: Workload, cluster: ClusterConfig, lag_s: float, seed: int
) -> tuple[RouterReport, RouterReport]:
    approx = ApproxPrefixConfig(index_lag=lag_s)
    approx_router = ApproxPrefixRouter(approx, random.Random(seed))
    base = simulate_cluster(wl, approx_router, cluster, name="approx")
    replicas = [ReplicaLoad(name=n) for n in cluster.replica_names]
    burst = BurstAffinityRouter(
        BurstRouter(BurstConfig(window_ms=100, max_per_replica=-1), replicas),
        ApproxPrefixRouter(approx, random.Random(seed)),
    )
    return base, simulate_cluster(wl, burst, cluster, name="burst+approx")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index-lag-ms", type=float, default=10.0)
    ap.add_argument("--json", default="out/router_gain.json")
    args = ap.parse_args()
    cluster = ClusterConfig(replicas=4)
    doc: dict[str, Any] = {
        "cluster": attrs_dict(cluster),
        "by_prompt_length": [],
        "by_index_lag": [],
    }

    print(f"prompt length sweep (index lag {args.index_lag_ms:g} ms)")
    head = (
        f"{'prompt tokens':>13} {'coloc base':>10} {'coloc burst':>11} {'hit base':>8} "
        f"{'hit burst':>9} {'step base s':>11} {'step burst s':>12} {'p95 base s':>10} "
        f"{'p95 burst s':>11} {'step gain':>9}"
    )
    print(head)
    for lo, hi in LENGTHS:
        wl = grpo_workload(
            random.Random(args.seed),
            steps=args.steps,
            prompts_per_step=args.prompts,
            samples=8,
            prompt_tokens=(lo, hi),
        )
        base, burst = run_pair(wl, cluster, args.index_lag_ms / 1000.0, args.seed)
        gain = 1.0 - burst.mean_step_time / base.mean_step_time
        print(
            f"{f'{lo}-{hi}':>13} {pct(base.groups_fully_colocated):>10} "
            f"{pct(burst.groups_fully_colocated):>11} {pct(base.hit_rate):>8} "
            f"{pct(burst.hit_rate):>9} {base.mean_step_time:>11.2f} "
            f"{burst.mean_step_time:>12.2f} {base.p95_step_time:>10.2f} "
            f"{burst.p95_step_time:>11.2f} {100 * gain:>8.1f}%"
        )
        doc["by_prompt_length"].append(
            {
                "prompt_tokens": [lo, hi],
                "baseline": base.to_dict(),
                "burst": burst.to_dict(),
                "step_time_gain": gain,
            }
        )

    print()
    print("baseline index lag sweep (prompt tokens 64-128)")
    print(
        f"{'lag ms':>6} {'coloc base':>10} {'distinct base':>13} {'hit base':>8} "
        f"{'coloc burst':>11} {'hit burst':>9}"
    )
    wl = grpo_workload(
        random.Random(args.seed),
        steps=args.steps,
        prompts_per_step=args.prompts,
        samples=8,
        prompt_tokens=LENGTHS[0],
    )
    for lag in LAGS_MS:
        base, burst = run_pair(wl, cluster, lag / 1000.0, args.seed)
        print(
            f"{lag:>6g} {pct(base.groups_fully_colocated):>10} "
            f"{base.mean_distinct_replicas or 0:>13.2f} {pct(base.hit_rate):>8} "
            f"{pct(burst.groups_fully_colocated):>11} {pct(burst.hit_rate):>9}"
        )
        doc["by_index_lag"].append(
            {"index_lag_ms": lag, "baseline": base.to_dict(), "burst": burst.to_dict()}
        )
    path = Path(args.json)
    harness.write_json(path, doc)
    print(f"wrote {path}")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def attrs_dict(c: ClusterConfig) -> dict[str, Any]:
    import attrs

    return attrs.asdict(c)


if __name__ == "__main__":
    main()
