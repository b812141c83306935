"""What paging costs on SmolLM2-135M: warm-prefix TTFT and batched decode vs transformers.

1. Warm prefix. A ``--prefix``-token document is cached in the pool's pages; each sample is a
   request for the document plus a fresh ``--suffix``-token question. Four variants,
   interleaved in every round:

   - ``engine``: `AsyncEngine` (paged attention, the default) serving the request with
     ``max_tokens=1``; its TTFT from the scheduler's report (arrival to first token);
   - ``paged`` / ``gather``: the runner's prefill step for the suffix over the cached pages
     (`TransformersRunner.execute`, sampling included), paged attention or the gather path;
   - ``bare``: plain transformers, one forward of the suffix over a ready, contiguous
     `DynamicCache` holding the document (then cropped back), plus the argmax.

   ``ratio`` = engine TTFT / bare forward (target <= 1.2).

2. Batched decode at 1, 2 and 8 rows whose contexts have different lengths (``--context``
   is the longest; the others spread down to half of it). ``paged`` and ``gather`` run the
   runner's decode step; ``plain`` decodes a left-padded batch with its own `DynamicCache`
   and a 2D attention mask, as ``generate`` does. Median step over ``--steps`` steps.

Plain transformers runs with the model's attention set back to ``sdpa``.

    python benchmarks/engine/paging_overhead.py [--rounds 5] [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
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

from prefixflight.backends.torch import (
    AsyncEngine,
    EngineConfig,
    SamplingParams,
    TransformersRunner,
    load_smollm2,
)
from prefixflight.core import DecodeWork, PrefillWork, StepPlan

PAGE_SIZE = 16
BATCHES = (1, 2, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=880)
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    model = load_smollm2(device=args.device).model

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(100, 40000, (n,), generator=g).tolist())

    # -- 1. warm prefix -------------------------------------------------------------------
    doc = rand(args.prefix)
    suffixes = [rand(args.suffix) for _ in range(4 * args.rounds + 1)]
    total = args.prefix + args.suffix
    per = -(-total // PAGE_SIZE)
    paged = TransformersRunner.for_model(
        model, num_pages=per + 64, block_size=PAGE_SIZE, device=dev, deduplicate=False
    )
    gather = TransformersRunner(model, paged.pool, deduplicate=False, attention="gather")
    pages = tuple(range(per))
    first = PrefillWork(request_id="doc", token_ids=doc, start=0, pages=pages, sample=False)
    paged.execute(StepPlan(step=0, prefills=(first,)))
    plain_impl = "sdpa"
    paged_impl = model.config._attn_implementation

    def use(impl: str) -> None:
        model.set_attn_implementation(impl)

    use(plain_impl)
    with torch.inference_mode():
        bare_cache = model(input_ids=torch.tensor([doc], device=dev), use_cache=True).cache
    use(paged_impl)

    engine_cfg = EngineConfig(num_pages=4 * per, block_size=PAGE_SIZE)
    engine_runner = TransformersRunner(model, _pool_like(paged, 4 * per))
    sfx = iter(suffixes)

    def runner_step(runner: TransformersRunner, n: int) -> float:
        work = PrefillWork(
            request_id=f"w{n}", token_ids=next(sfx), start=args.prefix, pages=pages, sample=True
        )
        sync()
        t = time.perf_counter()
        runner.execute(StepPlan(step=n, prefills=(work,)))
        sync()
        return time.perf_counter() - t

    def bare() -> float:
        ids = torch.tensor([next(sfx)], device=dev)
        use(plain_impl)
        with torch.inference_mode():
            sync()
            t = time.perf_counter()
            out = model(input_ids=ids, cache=bare_cache, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax().item())
            sync()
            dt = time.perf_counter() - t
            bare_cache.crop(-args.suffix)
        use(paged_impl)
        return dt

    warm: dict[str, list[float]] = {"engine": [], "paged": [], "gather": [], "bare": []}

    async def warm_rounds() -> None:
        async with AsyncEngine(engine_runner, engine_cfg) as engine:
            prompt = list(doc) + list(next(sfx))
            await engine.generate(prompt, SamplingParams(max_tokens=1)).result()  # caches doc
            for r in range(args.rounds):
                prompt = list(doc) + list(next(sfx))  # a fresh question every time
                rep = await engine.generate(prompt, SamplingParams(max_tokens=1)).result()
                assert rep.cached_tokens == args.prefix // PAGE_SIZE * PAGE_SIZE, rep
                assert rep.ttft is not None
                warm["engine"].append(rep.ttft)
                warm["paged"].append(runner_step(paged, 2 * r + 1))
                warm["gather"].append(runner_step(gather, 2 * r + 2))
                warm["bare"].append(bare())

    load_before = os.getloadavg()
    asyncio.run(warm_rounds())

    # -- 2. batched decode, mixed lengths -------------------------------------------------
    top = max(BATCHES)
    lengths = [args.context - (args.context // 2) * i // (top - 1) for i in range(top)]
    dper = -(-(args.context + args.steps) // PAGE_SIZE)
    dpaged = TransformersRunner.for_model(
        model, num_pages=top * dper, block_size=PAGE_SIZE, device=dev, deduplicate=False
    )
    dgather = TransformersRunner(model, dpaged.pool, deduplicate=False, attention="gather")
    prompts = [rand(n) for n in lengths]
    tables = [tuple(range(i * dper, (i + 1) * dper)) for i in range(top)]
    for i, p in enumerate(prompts):
        w = PrefillWork(request_id=i, token_ids=p, start=0, pages=tables[i], sample=True)
        dpaged.execute(StepPlan(step=0, prefills=(w,)))
    plain: dict[int, tuple[Any, torch.Tensor]] = {}
    use(plain_impl)
    with torch.inference_mode():
        for b in BATCHES:
            width = max(lengths[:b])
            ids = torch.zeros((b, width), dtype=torch.long)
            mask = torch.zeros((b, width), dtype=torch.long)
            for i in range(b):
                ids[i, width - lengths[i] :] = torch.tensor(prompts[i])
                mask[i, width - lengths[i] :] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=pos.to(dev),
                use_cache=True,
            )
            plain[b] = (out.cache, mask.to(dev))
    use(paged_impl)

    def decode_runner(runner: TransformersRunner, b: int) -> float:
        times = []
        for k in range(args.steps):
            decodes = tuple(
                DecodeWork(request_id=i, token_id=5, position=lengths[i] + k, pages=tables[i])
                for i in range(b)
            )
            sync()
            t = time.perf_counter()
            runner.execute(StepPlan(step=1 + k, decodes=decodes))
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def decode_plain(b: int) -> float:
        cache, mask = plain[b]
        pos0 = torch.tensor(lengths[:b], device=dev).unsqueeze(1)
        times = []
        use(plain_impl)
        with torch.inference_mode():
            for k in range(args.steps):
                m = torch.cat([mask, torch.ones((b, k + 1), dtype=mask.dtype, device=dev)], 1)
                ids = torch.full((b, 1), 5, device=dev)
                sync()
                t = time.perf_counter()
                out = model(
                    input_ids=ids,
                    attention_mask=m,
                    position_ids=pos0 + k,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                out.logits[:, -1].argmax(-1).tolist()
                sync()
                times.append(time.perf_counter() - t)
            cache.crop(-args.steps)
        use(paged_impl)
        return statistics.median(times)

    decode: dict[str, dict[int, list[float]]] = {
        v: {b: [] for b in BATCHES} for v in ("paged", "gather", "plain")
    }
    for _ in range(args.rounds):
        for b in BATCHES:
            decode["paged"][b].append(decode_runner(dpaged, b))
            decode["gather"][b].append(decode_runner(dgather, b))
            decode["plain"][b].append(decode_plain(b))
    load_after = os.getloadavg()

    med = {k: statistics.median(v) for k, v in warm.items()}
    dmed = {v: {b: statistics.median(s[b]) for b in BATCHES} for v, s in decode.items()}
    ratio = med["engine"] / med["bare"]
    print(
        f"SmolLM2-135M on {dev} ({next(model.parameters()).dtype}, {args.threads} threads), "
        f"median of {args.rounds} rounds"
    )
    print(f"\n1. warm prefix: {args.suffix} new tokens over {args.prefix} cached")
    print(f"{'variant':<8} {'ms':>8} {'/ bare':>7}")
    for k in ("engine", "paged", "gather", "bare"):
        print(f"{k:<8} {med[k] * 1e3:>8.1f} {med[k] / med['bare']:>7.2f}")
    print(f"ratio (engine TTFT / bare forward) = {ratio:.2f}  (target <= 1.2)")
    print(f"\n2. batched decode step, contexts {lengths[0]}..{lengths[-1]} tokens, median ms")
    print(f"{'rows':>4} {'paged':>8} {'gather':>8} {'plain':>8} {'paged/plain':>12}")
    for b in BATCHES:
        m = {v: dmed[v][b] * 1e3 for v in dmed}
        print(
            f"{b:>4} {m['paged']:>8.1f} {m['gather']:>8.1f} {m['plain']:>8.1f} "
            f"{m['paged'] / m['plain']:>12.2f}"
        )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        harness.write_json(
            args.json,
            {
                "warm_ttft": med["engine"],
                "bare_forward": med["bare"],
                "ratio": ratio,
                "warm_step": {"paged": med["paged"], "gather": med["gather"]},
                "decode_step": {v: {str(b): dmed[v][b] for b in BATCHES} for v in dmed},
                "decode_lengths": lengths,
                "samples": {"warm": warm, "decode": decode},
                "args": vars(args),
                "load": [load_before, load_after],
                "units": "seconds",
            },
        )


def _pool_like(runner: TransformersRunner, num_pages: int) -> Any:
    """A fresh pool shaped like ``runner``'s, for the engine's own cache."""
    from prefixflight.backends.torch import PagedKVPool

    p = runner.pool
    return PagedKVPool(
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        num_pages=num_pages,
        block_size=p.block_size,
        device=p.device,
        dtype=p.dtype,
    )


if __name__ == "__main__":
    main()
