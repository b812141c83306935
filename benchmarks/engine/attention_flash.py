"""Mask-free attention for long rows: torch's fused CPU kernel against the blocked products.

A lone row of a paged step (a prompt chunk of ``long_chunk`` tokens or more) attends over
its pages through `PagedStep`. ``kernel``: torch's fused CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``), ``is_causal`` without a cached prefix,
and with one the prefix (no mask) and the new tokens (causal) as two calls merged through
their log-sum-exps. ``products``: the path `main` had before this change, and today's for
the dtypes not in ``FLASH_MIN`` (bf16): queries in blocks of 256, each a batched product
against the keys it can see, the block's own triangle masked, ``softmax``, a second
product. Today's code takes the kernel for fp32 (``today`` in each row of the JSON says
which path the dtype takes): for fp32 ``products`` is before and ``kernel`` after.

Two measurements, every round running ``products`` and ``kernel`` back to back (A/B
interleaved, the order alternating between rounds), the minimum wall time of the rounds
and the median of the process's CPU time reported (on a shared machine the CPU time is the
steadier of the two):

- the attention call alone: one layer's `PagedStep.attend` with SmolLM2-shaped heads
  (``--heads`` 9 query heads, ``--kv-heads`` 3 KV heads, head dim 64; the issue measured 14
  and 2), pages in shuffled order
  (so a cached prefix is gathered), for each ``N[:CACHED]`` of ``--cases``;
- a real prefill through `TransformersRunner` (fused forward): a random-weight Llama with
  SmolLM2-135M's dimensions and ``--layers`` layers (the real model has 30; attention per
  layer is the same, so fewer layers keep the run short), and the tiny test model, for each
  case of ``--prefill-cases`` (a cached case prefills the cached tokens first, untimed,
  then times the new chunk over them). Each pair's logits are compared (max abs diff);
- decode rows a step attends together (``ROWSxCONTEXT`` of ``--decode-cases``, each row on
  pages of its own): the batched product with its mask, or one kernel call per row
  (`PER_ROW_MIN`; fp32 from 1,024 keys today).

    python benchmarks/engine/attention_flash.py [--rounds 2] [--dtypes float32,bfloat16]
        [--json docs/results/attention_flash.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prefixflight.backends import TINY_LLAMA
from prefixflight.backends.torch import PagedKVPool, TransformersRunner
from prefixflight.backends.torch import _paged as paged_module
from prefixflight.backends.torch._paged import PagedStep
from prefixflight.core import PrefillWork, StepPlan

SMOLLM2: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100000.0,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": True,
}
"""SmolLM2-135M-Instruct's dimensions (its config.json), random weights."""


USED = dict(paged_module.FLASH_MIN)
"""The dtypes today's code runs the kernel for on lone rows (the rest: the products)."""
USED_PER_ROW = dict(paged_module.PER_ROW_MIN)
"""The dtypes (and the keys per row from which) batched rows go one by one."""


@contextmanager
def kernel(on: bool) -> Iterator[None]:
    """The fused kernel for every lone row, and for every row of a batch one by one, in fp32
    and bf16 (``on``); or the blocked products and the batched product with its mask for all
    of them (the paths `main` had before this change)."""
    tables = (paged_module.FLASH_MIN, paged_module.PER_ROW_MIN)
    saved = [dict(t) for t in tables]
    for table in tables:
        table.clear()
        if on:
            table.update({torch.float32: 0, torch.bfloat16: 0})
    try:
        yield
    finally:
        for table, old in zip(tables, saved, strict=True):
            table.clear()
            table.update(old)


def parse_case(text: str) -> tuple[int, int]:
    new, _, cached = text.partition(":")
    return int(new), int(cached or 0)


CPU: dict[str, list[float]] = {}
"""The process's CPU milliseconds of each timed call, per ``products``/``kernel`` (reset per
case): on a shared machine the steadier measure (other jobs inflate wall time far more)."""


def timed(fn: Callable[[], Any], name: str | None = None) -> tuple[float, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    if name is not None:
        CPU.setdefault(name, []).append(cpu)
    return wall, out


def attention_call(
    case: tuple[int, int], dtype: torch.dtype, heads: int, kv_heads: int, rounds: int
) -> dict[str, Any]:
    new, cached = case
    ps = 16
    pages = -(-(new + cached) // ps)
    pool = PagedKVPool(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=64,
        num_pages=pages + 1,
        block_size=ps,
        dtype=dtype,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = pool.layer_views(0)
    k_pool.copy_(torch.randn(k_pool.shape, generator=gen).to(dtype))
    v_pool.copy_(torch.randn(v_pool.shape, generator=gen).to(dtype))
    table = list(range(1, pages + 1))
    random.Random(0).shuffle(table)
    query = (torch.randn((new, heads, 64), generator=gen) / 8).to(dtype)
    key = torch.randn((new, kv_heads, 64), generator=gen).to(dtype)
    value = torch.randn((new, kv_heads, 64), generator=gen).to(dtype)

    def attend(step: PagedStep) -> torch.Tensor:
        return step.attend(0, query, key, value, 1.0)

    times: dict[str, list[float]] = {"products": [], "kernel": []}
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            order = ("products", "kernel") if r % 2 else ("kernel", "products")
            for name in order:
                with kernel(name == "kernel"):
                    step = PagedStep(pool, [(cached, new, table)])
                    ms, out = timed(partial(attend, step), name if r else None)
                if r:
                    times[name].append(ms)
                outs[name] = out.float()
    diff = float((outs["products"] - outs["kernel"]).abs().max())
    return summary(times, new=new, cached=cached, max_abs_diff=diff)


def decode_rows(
    rows: int, context: int, dtype: torch.dtype, heads: int, kv_heads: int, rounds: int
) -> dict[str, Any]:
    """One layer's attention for ``rows`` decode rows at ``context`` .. keys, each on pages
    of its own (shuffled): batched with a mask (products) or one kernel call per row."""
    ps = 16
    per = -(-(context + rows + 1) // ps)
    pool = PagedKVPool(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=64,
        num_pages=rows * per + 1,
        block_size=ps,
        dtype=dtype,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(0)
    for view in pool.layer_views(0):
        view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    free = list(range(1, rows * per + 1))
    random.Random(0).shuffle(free)
    spec = [(context + r, 1, free[r * per : (r + 1) * per]) for r in range(rows)]
    query = (torch.randn((rows, heads, 64), generator=gen) / 8).to(dtype)
    key = torch.randn((rows, kv_heads, 64), generator=gen).to(dtype)
    value = torch.randn((rows, kv_heads, 64), generator=gen).to(dtype)

    def attend(step: PagedStep) -> torch.Tensor:
        return step.attend(0, query, key, value, 1.0)

    times: dict[str, list[float]] = {"products": [], "kernel": []}
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            order = ("products", "kernel") if r % 2 else ("kernel", "products")
            for name in order:
                with kernel(name == "kernel"):
                    step = PagedStep(pool, spec)
                    ms, out = timed(partial(attend, step), name if r else None)
                if r:
                    times[name].append(ms)
                outs[name] = out.float()
    diff = float((outs["products"] - outs["kernel"]).abs().max())
    return summary(times, rows=rows, context=context, max_abs_diff=diff)


def summary(times: dict[str, list[float]], **extra: Any) -> dict[str, Any]:
    products, kernel = min(times["products"]), min(times["kernel"])
    cpu = {k: statistics.median(v) for k, v in CPU.items()}
    rounds_cpu = {k: [round(x, 1) for x in v] for k, v in CPU.items()}
    CPU.clear()
    return {
        **extra,
        "products_ms": round(products, 1),
        "kernel_ms": round(kernel, 1),
        "speedup": round(products / kernel, 2),
        "products_cpu_ms": round(cpu["products"], 1),
        "kernel_cpu_ms": round(cpu["kernel"], 1),
        "cpu_speedup": round(cpu["products"] / cpu["kernel"], 2),
        "rounds_ms": {k: [round(x, 1) for x in v] for k, v in times.items()},
        "rounds_cpu_ms": rounds_cpu,
    }


def build_model(kind: str, layers: int, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    if kind == "tiny":
        config = LlamaConfig(**TINY_LLAMA, max_position_embeddings=16384)
    else:
        config = LlamaConfig(**SMOLLM2, num_hidden_layers=layers)
    model: Any = LlamaForCausalLM(config)
    return model.eval().to(dtype)


def prefill(model: Any, case: tuple[int, int], dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    new, cached = case
    ps = 16
    pages = -(-(new + cached) // ps)
    runner = TransformersRunner.for_model(
        model, num_pages=pages + 1, block_size=ps, device="cpu", dtype=dtype
    )
    table = tuple(range(1, pages + 1))
    rng = random.Random(1)
    vocab = runner.vocab_size
    ids = tuple(rng.randrange(vocab) for _ in range(new + cached))

    def work(step: int, start: int, end: int) -> StepPlan:
        chunk = PrefillWork(
            request_id=step, token_ids=ids[start:end], start=start, pages=table, sample=True
        )
        return StepPlan(step=step, prefills=(chunk,))

    times: dict[str, list[float]] = {"products": [], "kernel": []}
    logits: dict[str, torch.Tensor] = {}
    n = 0

    def timed_chunk(step: int, name: str) -> float:
        ms, _ = timed(lambda: runner.execute(work(step, cached, cached + new)), name)
        return ms

    for name in ("products", "kernel"):  # warm-up: a short prefill on each path
        with kernel(name == "kernel"):
            runner.execute(work(n, 0, min(128, len(ids))))
            n += 1
    for r in range(rounds):
        order = ("products", "kernel") if r % 2 else ("kernel", "products")
        for name in order:
            with kernel(name == "kernel"):
                if cached:
                    runner.execute(work(n, 0, cached))  # the cached prefix, untimed
                    n += 1
                ms = timed_chunk(n, name)
            times[name].append(ms)
            logits[name] = runner.last_logits[n].float()
            n += 1
    diff = float((logits["products"] - logits["kernel"]).abs().max())
    scale = float(logits["products"].abs().max())
    same = bool(logits["products"].argmax() == logits["kernel"].argmax())
    return summary(
        times, new=new, cached=cached, max_abs_diff=diff, logit_scale=scale, same_argmax=same
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--cases", default="1024,4096,8192,512:4096,1024:3072,4096:8192")
    ap.add_argument("--decode-cases", default="8x4000,32x2000,32x500")
    ap.add_argument("--prefill-cases", default="4096,8192,512:4096,1024:3072")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--models", default="smollm2-shaped,tiny")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
    result: dict[str, Any] = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "shared": "2 cores shared with other jobs; minimum over interleaved rounds",
        },
        "rounds": args.rounds,
        "load_average_at_start": os.getloadavg(),
        "attention_call": [],
        "decode_rows": [],
        "prefill": [],
    }
    for dt in dtypes:
        for text in filter(None, args.cases.split(",")):
            row = attention_call(parse_case(text), dt, args.heads, args.kv_heads, args.rounds)
            row |= {
                "today": "kernel" if dt in USED else "products",
                "dtype": str(dt).removeprefix("torch."),
                "heads": args.heads,
                "kv_heads": args.kv_heads,
            }
            result["attention_call"].append(row)
            print(
                "attention",
                row["dtype"],
                text,
                row["products_ms"],
                "->",
                row["kernel_ms"],
                f"x{row['speedup']}",
                f"cpu x{row['cpu_speedup']}",
                f"diff {row['max_abs_diff']:.1e}",
                flush=True,
            )
    for dt in dtypes:
        for text in filter(None, args.decode_cases.split(",")):
            rows, _, context = text.partition("x")
            row = decode_rows(int(rows), int(context), dt, args.heads, args.kv_heads, args.rounds)
            row |= {
                "today": "kernel" if int(context) >= USED_PER_ROW.get(dt, 1 << 62) else "products",
                "dtype": str(dt).removeprefix("torch."),
            }
            result["decode_rows"].append(row)
            print(
                "decode rows",
                row["dtype"],
                text,
                row["products_ms"],
                "->",
                row["kernel_ms"],
                f"x{row['speedup']}",
                f"cpu x{row['cpu_speedup']}",
                f"diff {row['max_abs_diff']:.1e}",
                flush=True,
            )
    for kind in filter(None, args.models.split(",")):
        for dt in dtypes:
            model = build_model(kind, args.layers, dt)
            for text in filter(None, args.prefill_cases.split(",")):
                row = prefill(model, parse_case(text), dt, args.rounds)
                row |= {
                    "today": "kernel" if dt in USED else "products",
                    "model": kind,
                    "dtype": str(dt).removeprefix("torch."),
                    "layers": model.config.num_hidden_layers,
                }
                result["prefill"].append(row)
                print(
                    "prefill",
                    kind,
                    row["dtype"],
                    text,
                    row["products_ms"],
                    "->",
                    row["kernel_ms"],
                    f"x{row['speedup']}",
                    f"cpu x{row['cpu_speedup']}",
                    f"diff {row['max_abs_diff']:.1e} of {row['logit_scale']:.1f}",
                    "same argmax" if row["same_argmax"] else "ARGMAX DIFFERS",
                    flush=True,
                )
    result["load_average_at_end"] = os.getloadavg()
    if args.json:
        harness.write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
