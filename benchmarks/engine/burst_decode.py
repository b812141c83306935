"""Decode steps of a GRPO-style burst: 16 rows at once (the old ``--max-running 16``) or 32.

32 requests share one ``--prompt``-token prompt (a GRPO group's prompt: its pages are shared,
as the prefix cache shares them) and each decodes on pages of its own. With at most 16
running, the second 16 wait until the first 16 finish, so every output position costs two
16-row steps; with 32 running (``prefixflight serve``'s default is now 64), one 32-row step.
The model is a random-weight Llama with SmolLM2-135M's dimensions and all 30 layers (the
same arithmetic as the real model), through `TransformersRunner`'s fused forward. Each round
runs ``--steps`` decode steps of 16 rows and of 32 rows, interleaved; the median step time
over all rounds is reported with the tokens per second it gives, and the median of the
process's CPU time per step (the steadier measure on a shared machine).

    python benchmarks/engine/burst_decode.py [--rounds 3] [--steps 4] [--dtype bfloat16]
        [--json docs/results/burst_decode.json]
"""

from __future__ import annotations

import argparse
import json
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
from transformers import LlamaConfig, LlamaForCausalLM

from prefixflight.backends.torch import TransformersRunner
from prefixflight.core import DecodeWork, PrefillWork, StepPlan

SMOLLM2: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
PAGE = 16
ROWS = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    model.eval()
    shared = args.prompt // PAGE
    own = -(-(args.rounds * 2 * args.steps + 2 + args.prompt % PAGE) // PAGE) + 1
    runner = TransformersRunner.for_model(
        model, num_pages=1 + shared + ROWS * own, block_size=PAGE, device="cpu", dtype=dtype
    )
    prompt = tuple(range(10, 10 + args.prompt))
    prefix = tuple(range(1, 1 + shared))
    tables = [prefix + tuple(1 + shared + r * own + i for i in range(own)) for r in range(ROWS)]
    # the shared prompt once, then each row's remainder (the part after the last full page)
    runner.execute(
        StepPlan(
            step=0,
            prefills=(
                PrefillWork(request_id=0, token_ids=prompt, start=0, pages=tables[0], sample=True),
            ),
        )
    )
    cut = shared * PAGE
    rest = tuple(
        PrefillWork(request_id=r, token_ids=prompt[cut:], start=cut, pages=tables[r], sample=True)
        for r in range(1, ROWS)
        if cut < len(prompt)
    )
    if rest:
        runner.execute(StepPlan(step=1, prefills=rest))
    position = [len(prompt)] * ROWS
    n = 2
    times: dict[int, list[float]] = {16: [], 32: []}
    cpu: dict[int, list[float]] = {16: [], 32: []}

    def decode(rows: range) -> float:
        nonlocal n
        plan = StepPlan(
            step=n,
            decodes=tuple(
                DecodeWork(request_id=r, token_id=7, position=position[r], pages=tables[r])
                for r in rows
            ),
        )
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(plan)
        ms = (time.perf_counter() - t0) * 1e3
        cpu[len(rows)].append((time.process_time() - c0) * 1e3)
        for r in rows:
            position[r] += 1
        n += 1
        return ms

    decode(range(16))  # warm-up of both shapes
    decode(range(16, 32))
    decode(range(32))
    cpu[16].clear()
    cpu[32].clear()
    for r in range(args.rounds):
        for width in (16, 32) if r % 2 == 0 else (32, 16):
            for _ in range(args.steps):
                if width == 16:
                    # the 16 running rows of the old default (the other 16 wait)
                    times[16].append(decode(range(16)))
                else:
                    times[32].append(decode(range(32)))
    step16, step32 = statistics.median(times[16]), statistics.median(times[32])
    cpu16, cpu32 = statistics.median(cpu[16]), statistics.median(cpu[32])
    result = {
        "machine": "2 cores shared with other jobs",
        "load_average_at_end": os.getloadavg(),
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt": args.prompt,
        "layers": 30,
        "step_ms": {"16 rows": round(step16, 1), "32 rows": round(step32, 1)},
        "tokens_per_s": {
            "16 running (32 requests: two 16-row steps per position)": round(16e3 / step16, 1),
            "32 running": round(32e3 / step32, 1),
        },
        "speedup_32_over_16": round(2 * step16 / step32, 2),
        "step_cpu_ms": {"16 rows": round(cpu16, 1), "32 rows": round(cpu32, 1)},
        "cpu_speedup_32_over_16": round(2 * cpu16 / cpu32, 2),
        "steps_ms": {str(k): [round(x, 1) for x in v] for k, v in times.items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        harness.write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
