"""Where a forward pass's time goes: a cold prefill and decode steps, by operation kind.

SmolLM2-135M-Instruct on the CPU, the paged runner with the fused forward (``fused``), the
model's own modules over the same paged attention (``modules``) and the gather reference
(``gather``, no decode reuse). Per variant: a cold ``--prompt``-token prefill (in chunks of
``--chunk`` tokens, one forward pass each, as a server's step budget cuts a long prompt;
default: one pass), a decode step of 1 row and one of 8 rows at that context (each on pages of
its own), and one of 32 rows in 4 groups of 8 (a GRPO burst: each group over one prompt's
pages, each row with a page of its own). Each is timed (wall-clock minimum and the
process's CPU time, median, over ``--repeat`` runs: on a shared machine CPU time is the
steadier of the two) and then profiled once with ``torch.profiler``; the profile's operator
self-times are summed into kinds: matrix products of the projections (``aten::mm``/``addmm``,
oneDNN's prepacked ``mkldnn::_linear_pointwise``), attention (``bmm``, ``_softmax``, torch's
fused CPU attention kernel), KV pool reads and writes (``index_select``/``index_copy_``),
and everything else (norms, rotary embedding, activations, copies, allocation). Profiled
times include the profiler's own overhead per operation, so compare kinds, not totals.

    python benchmarks/engine/forward_profile.py [--dtype bfloat16] [--threads 2]
        [--prompt 904] [--chunk N] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch.profiler import ProfilerActivity, profile

from prefixflight.backends.torch import TransformersRunner, load_smollm2
from prefixflight.core import DecodeWork, PrefillWork, StepPlan

KINDS = {
    "aten::mm": "projections",
    "aten::addmm": "projections",
    "mkldnn::_linear_pointwise": "projections",
    "aten::bmm": "attention",
    "aten::_softmax": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::index_select": "kv pool",
    "aten::index_copy_": "kv pool",
    "aten::index": "kv pool",
}
VARIANTS = ("fused", "modules", "gather")


def measure(fn: Callable[[], object], repeat: int) -> dict[str, Any]:
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kinds: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        kinds[KINDS.get(event.key, "other")] += event.self_cpu_time_total / 1e3
    total = sum(kinds.values())
    return {
        "wall_ms_min": min(walls) * 1e3,
        "cpu_ms_median": statistics.median(cpus) * 1e3,
        "profiled_ms": {k: round(v, 2) for k, v in kinds.most_common()},
        "profiled_share": {k: round(v / total, 3) for k, v in kinds.most_common()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=904)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: whole)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_smollm2(device="cpu", dtype=args.dtype).model
    ps, ctx, rows = 16, args.prompt, 8
    chunk = args.chunk or ctx
    per = -(-(ctx + 8) // ps)
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(100, 40000, (ctx,), generator=g).tolist()) for _ in range(rows)]
    pages = [tuple(range(i * per, (i + 1) * per)) for i in range(rows)]
    groups, per_group = 4, 8
    own = range(rows * per, rows * per + groups * per_group)  # a page each, past the prompt's
    grouped = [(*pages[i // per_group][: ctx // ps], p) for i, p in enumerate(own)]
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants.split(","):
        kw: dict[str, Any] = {"deduplicate": False}
        if variant == "modules":
            kw["fused"] = False
        elif variant == "gather":
            kw.update(attention="gather", reuse_decode=False)
        runner = TransformersRunner.for_model(
            model, num_pages=own.stop, block_size=ps, device="cpu", dtype=args.dtype, **kw
        )
        step = iter(range(10**9))

        def prefill(i: int, r: TransformersRunner = runner, s: Any = step) -> None:
            for start in range(0, ctx, chunk):
                work = PrefillWork(
                    request_id=i,
                    token_ids=prompts[i][start : start + chunk],
                    start=start,
                    pages=pages[i],
                    sample=start + chunk >= ctx,
                )
                r.execute(StepPlan(step=next(s), prefills=(work,)))

        def decode(
            tables: Sequence[tuple[int, ...]],
            first: int = 0,
            r: TransformersRunner = runner,
            s: Any = step,
        ) -> None:
            """One decode step, a row per page table (request ids from ``first``)."""
            works = tuple(
                DecodeWork(request_id=first + j, token_id=5, position=ctx, pages=t)
                for j, t in enumerate(tables)
            )
            r.execute(StepPlan(step=next(s), decodes=works))

        for i in range(rows):
            prefill(i)
        decode(pages)
        results[variant] = {
            f"prefill_{ctx}": measure(lambda: prefill(0), max(2, args.repeat // 2)),
            "decode_1": measure(lambda: decode(pages[:1]), args.repeat * 2),
            f"decode_{rows}": measure(lambda: decode(pages), args.repeat * 2),
            f"decode_{groups}x{per_group}": measure(lambda: decode(grouped, rows), args.repeat * 2),
        }
        for what, m in results[variant].items():
            kinds = ", ".join(f"{k} {v:.0%}" for k, v in m["profiled_share"].items())
            print(
                f"{variant:<8} {what:<13} wall {m['wall_ms_min']:8.1f} ms (min)  "
                f"cpu {m['cpu_ms_median']:8.1f} ms (median)  profile: {kinds}",
                flush=True,
            )
    if args.json:
        out = {
            "results": results,
            "settings": {
                "model": "SmolLM2-135M-Instruct",
                "dtype": args.dtype,
                "threads": args.threads,
                "prompt_tokens": ctx,
                "chunk_tokens": chunk,
                "repeat": args.repeat,
                "load_average": os.getloadavg()[0],
            },
        }
        harness.write_json(args.json, out)


if __name__ == "__main__":
    main()
