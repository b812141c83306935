"""Host-side cost of the scheduler per step, next to the model's step time.

A backend step of SmolLM2-135M on CPU takes 35-95 ms (`prefixflight bench calibrate`); the
scheduler's own work per step (plan building, result checking, publication, admission) must be small
next to it. For R running requests (8, 64, 512) this times ``schedule`` + ``complete_step`` in two
phases: decode-only steps (every request decodes; a block completes every 16 steps and is published)
and a prefill burst (R requests of 512 tokens admitted and prefilled under a budget of R + 512
tokens per step, half of them sharing their prompt with an earlier one, so admission looks
up, pins and reuses). Sizes are interleaved and repeated; the table shows microseconds per
step and per request in the step.

    python benchmarks/flight/scheduler_overhead.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prefixflight.core import Scheduler, SchedulerConfig, StepPlan, StepResult

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

SIZES = (8, 64, 512)
PROMPT = 512


def _result(plan: StepPlan) -> StepResult:
    sampled = [(p.request_id, 1) for p in plan.prefills if p.sample]
    sampled += [(d.request_id, 1) for d in plan.decodes]
    return StepResult(step=plan.step, sampled=tuple(sampled))


def _make(r: int) -> Scheduler:
    pages = r * ((PROMPT + 256 + 2 * r) // 16 + 2) + 64
    return Scheduler(SchedulerConfig(num_pages=pages, max_batch_tokens=r + 512, max_running=r))


def _prompt(i: int) -> list[int]:
    base = i // 2  # pairs share a prompt: the second reuses the first's blocks
    return [(base * 7919 + j) % 49152 for j in range(PROMPT)]


def _run_steps(s: Scheduler, now: float, max_steps: int | None = None) -> tuple[int, int, float]:
    """Run until idle (or max_steps); return (steps, request-slots, seconds of host time)."""
    steps = slots = 0
    t = 0.0
    while s.has_unfinished and (max_steps is None or steps < max_steps):
        t0 = time.perf_counter()
        plan = s.schedule(now)
        if plan.is_empty:
            break
        s.complete_step(_result(plan), now + 0.01)
        t += time.perf_counter() - t0
        now += 0.01
        steps += 1
        slots += len(plan.prefills) + len(plan.decodes)
    return steps, slots, t


def _burst(r: int) -> tuple[float, float]:
    s = _make(r)
    for i in range(r):
        s.add_request(i, _prompt(i), max_new_tokens=1, now=0.0)
    gc.disable()
    try:
        steps, slots, t = _run_steps(s, 0.0)
    finally:
        gc.enable()
    return t / steps * 1e6, t / slots * 1e6


def _decode(r: int, steps: int) -> tuple[float, float]:
    s = _make(r)
    for i in range(r):
        s.add_request(i, _prompt(i), max_new_tokens=steps + r + 4, now=0.0)  # outlive warm-up
    while (
        any(st.value != "running" for st in s.requests().values())
        or s.stats.prefill_tokens + s.stats.cached_tokens < r * PROMPT
    ):
        plan = s.schedule(s.now)
        s.complete_step(_result(plan), s.now)
    gc.disable()
    try:
        n, slots, t = _run_steps(s, s.now, max_steps=steps)
    finally:
        gc.enable()
    assert slots == n * r, "every request decodes in every step"
    return t / n * 1e6, t / slots * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for r in SIZES:
            samples.setdefault(("decode", r), []).append(_decode(r, args.decode_steps))
            samples.setdefault(("prefill_burst", r), []).append(_burst(r))
    rows: list[dict[str, Any]] = []
    print(f"{'phase':<15}{'running':>9}{'us/step':>12}{'us/request':>13}")
    for phase in ("decode", "prefill_burst"):
        for r in SIZES:
            s = samples[phase, r]
            per_step = statistics.median(x for x, _ in s)
            per_req = statistics.median(y for _, y in s)
            print(f"{phase:<15}{r:>9}{per_step:>12.1f}{per_req:>13.2f}")
            rows.append(
                {
                    "phase": phase,
                    "running": r,
                    "median_us_per_step": per_step,
                    "median_us_per_request": per_req,
                    "samples": s,
                }
            )
    if args.json:
        harness.write_json(args.json, {"benchmark": "scheduler_overhead",
                           "python": sys.version.split()[0], "rounds": args.rounds,
                           "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
