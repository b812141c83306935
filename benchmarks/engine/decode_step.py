"""Decode step time of the torch runner against plain transformers, on SmolLM2-135M.

Each of B requests (B = 1, 2, 8) holds ``--context`` tokens in its pages; a sample is
``--steps`` consecutive decode steps of all B (the median step is kept). Four variants,
interleaved in every round: ``paged`` (the default runner: paged attention over the pool),
``gather`` (`TransformersRunner` with ``reuse_decode=False``,
which gathers every row's whole context from the pages each step), ``reuse`` (the default
runner, which reuses a steady batch's cache from the previous step; each sample's first
step still gathers, since the other variants wrote the shared pool in between) and
``plain`` (transformers decoding a batch of B with its own `DynamicCache`, cropped back
after each step). The table shows medians over rounds, the ratios to ``plain`` and the load.

    python benchmarks/engine/decode_step.py [--rounds 7] [--steps 4] [--context 500] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from prefixflight.backends.torch import TransformersRunner, load_smollm2
from prefixflight.core import DecodeWork, PrefillWork, StepPlan

BATCHES = (1, 2, 8)
PAGE_SIZE = 16
VARIANTS = ("paged", "gather", "reuse", "plain")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ctx, steps, top = args.context, args.steps, max(BATCHES)
    model = load_smollm2(device="cpu").model
    per = -(-(ctx + steps) // PAGE_SIZE)
    paged = TransformersRunner.for_model(
        model, num_pages=top * per, block_size=PAGE_SIZE, device="cpu", deduplicate=False
    )
    reuse = TransformersRunner(model, paged.pool, deduplicate=False, attention="gather")
    gather = TransformersRunner(
        model, paged.pool, deduplicate=False, reuse_decode=False, attention="gather"
    )
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(100, 40000, (ctx,), generator=g).tolist()) for _ in range(top)]
    pages = [tuple(range(i * per, (i + 1) * per)) for i in range(top)]
    for i, p in enumerate(prompts):
        work = PrefillWork(request_id=i, token_ids=p, start=0, pages=pages[i], sample=True)
        reuse.execute(StepPlan(step=0, prefills=(work,)))
    plain: dict[int, Any] = {}
    with torch.inference_mode():
        for b in BATCHES:
            plain[b] = model(input_ids=torch.tensor(prompts[:b]), use_cache=True).cache

    def run_runner(runner: TransformersRunner, b: int) -> float:
        times = []
        for k in range(steps):
            decodes = tuple(
                DecodeWork(request_id=i, token_id=5, position=ctx + k, pages=pages[i])
                for i in range(b)
            )
            t = time.perf_counter()
            runner.execute(StepPlan(step=1 + k, decodes=decodes))
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def run_plain(b: int) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(steps):
                ids = torch.full((b, 1), 5)
                t = time.perf_counter()
                model(input_ids=ids, cache=plain[b], use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - t)
            plain[b].crop(-steps)
        return statistics.median(times)

    samples: dict[str, dict[int, list[float]]] = {v: {b: [] for b in BATCHES} for v in VARIANTS}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for b in BATCHES:
            samples["paged"][b].append(run_runner(paged, b))
            samples["gather"][b].append(run_runner(gather, b))
            samples["reuse"][b].append(run_runner(reuse, b))
            samples["plain"][b].append(run_plain(b))
    load_after = os.getloadavg()
    med = {v: {b: statistics.median(s[b]) * 1e3 for b in BATCHES} for v, s in samples.items()}
    print(f"decode step, {ctx} cached tokens per request, {args.threads} threads, median ms")
    print(
        f"{'batch':>5} {'paged':>8} {'gather':>8} {'reuse':>8} {'plain':>8} "
        f"{'paged/plain':>12} {'gather/plain':>13} {'reuse/plain':>12}"
    )
    for b in BATCHES:
        m = {v: med[v][b] for v in VARIANTS}
        print(
            f"{b:>5} {m['paged']:>8.1f} {m['gather']:>8.1f} {m['reuse']:>8.1f} "
            f"{m['plain']:>8.1f} {m['paged'] / m['plain']:>12.2f} "
            f"{m['gather'] / m['plain']:>13.2f} {m['reuse'] / m['plain']:>12.2f}"
        )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(f"reused passes: {reuse.reused_passes}")
    if args.json:
        harness.write_json(
            args.json, {"args": vars(args), "median_ms": med, "load": [load_before, load_after]}
        )


if __name__ == "__main__":
    main()
