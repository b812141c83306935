"""Our engine against transformers' own continuous batching, side by side, on SmolLM2-135M.

Same model (SmolLM2-135M-Instruct, fp32 unless ``--dtype``, CPU, the same torch thread count
for both: one process, ``torch.set_num_threads``), the same prompts, greedy decoding of exactly
``--new-tokens`` tokens (no stop token), both engines interleaved in every round (the order
alternates), medians over rounds. Each engine starts every workload empty (a fresh
`AsyncEngine`; a fresh transformers ``ContinuousBatchingManager``, so a fresh paged cache).

Workloads:

- ``shared_system_prompt``: a chat with a ~500-token system prompt; ``--requests`` (32)
  short distinct questions, at most ``--concurrency`` (8) in flight (a closed loop: a new
  request is sent when one finishes).
- ``grpo_groups``: ``--group`` (8) identical ~500-token prompts sent at once.
- ``cold``: ``--group`` distinct ~500-token prompts sent at once, nothing shared.

Per workload and engine: TTFT p50/p95 (arrival to first token), makespan (first arrival to
last completion), tokens/s (generated tokens / makespan), and prefill tokens computed (ours:
the scheduler's computed prompt tokens minus the rows the runner computed once for several
requests; transformers: query tokens through the model minus one decode token per generated
token after the first).

Transformers runs ``model.init_continuous_batching(...)`` with
``ContinuousBatchingConfig(page_size=16, allow_block_sharing=True, max_batch_tokens=1024,
num_blocks=1024)`` (its default page of 256 tokens would share at most one block of a
500-token system prompt; 16 matches ours) and per-request first-token times from
``add_request(..., record_timestamps=True)``. Ours: `AsyncEngine` with
``EngineConfig(release_policy=AFTER_PREFILL, block_size=16, max_batch_tokens=1024)`` and
paged attention.

    python benchmarks/engine/engine_vs_transformers.py [--rounds 3] [--threads 1] [--dtype float32]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from transformers import ContinuousBatchingConfig, GenerationConfig

from prefixflight.backends.torch import (
    AsyncEngine,
    EngineConfig,
    SamplingParams,
    TransformersRunner,
    load_smollm2,
)
from prefixflight.core import ReleasePolicy

PAGE_SIZE = 16
MAX_BATCH_TOKENS = 1024
WORKLOADS = ("shared_system_prompt", "grpo_groups", "cold")
ENGINES = ("ours", "transformers")

_TOPICS = (
    "harbour records", "river tolls", "wool trade", "salt roads", "the council of wardens",
    "the storm archive", "timber prices", "dyed cloth", "the northern road", "the hill fort",
    "ledger clerks", "inland towns", "trading houses", "the river bar", "new-moon hearings",
    "cargo lists",
)  # fmt: skip


def _system_prompt(tok: Any, target: int) -> str:
    """A policy-like system prompt of about ``target`` tokens."""
    lines = ["You are the archive assistant of a harbour city. Follow these rules."]
    i = 0
    while len(tok("\n".join(lines))["input_ids"]) < target:
        t = _TOPICS[i % len(_TOPICS)]
        lines.append(
            f"Rule {i + 1}: when asked about {t}, cite the ledger volume, keep to the facts the "
            f"clerks recorded, and say plainly when the records on {t} are incomplete."
        )
        i += 1
    return "\n".join(lines)


def _document(tok: Any, target: int, salt: int) -> str:
    words: list[str] = []
    i = salt
    while len(tok(" ".join(words))["input_ids"]) < target:
        t = _TOPICS[i % len(_TOPICS)]
        words.append(f"Entry {salt}.{i}: the {t} changed in year {1200 + 7 * i + salt}.")
        i += 3
    return " ".join(words)


def build_prompts(tok: Any, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    def chat(system: str | None, user: str) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    system = _system_prompt(tok, args.prompt_tokens)
    questions = [
        f"Question {i}: what do the records say about {_TOPICS[i % len(_TOPICS)]}?"
        for i in range(args.requests)
    ]
    doc = _document(tok, args.prompt_tokens, 0)
    return {
        "shared_system_prompt": [chat(system, q) for q in questions],
        "grpo_groups": [chat(None, doc + "\nSummarise the entries.")] * args.group,
        "cold": [
            chat(None, _document(tok, args.prompt_tokens, 1 + k) + "\nSummarise the entries.")
            for k in range(args.group)
        ],
    }


class Result:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.first_arrival = float("inf")
        self.last_finish = 0.0
        self.tokens = 0
        self.prefill = 0

    def summary(self) -> dict[str, float]:
        t = sorted(self.ttft)
        makespan = self.last_finish - self.first_arrival
        return {
            "ttft_p50": statistics.median(t),
            "ttft_p95": t[min(len(t) - 1, round(0.95 * (len(t) - 1)))],
            "makespan": makespan,
            "tokens_per_s": self.tokens / makespan,
            "prefill_tokens_computed": float(self.prefill),
        }


# -- ours ----------------------------------------------------------------------------------
def run_ours(
    runner: TransformersRunner, prompts: list[list[int]], concurrency: int, new: int
) -> Result:
    res = Result()
    config = EngineConfig(
        release_policy=ReleasePolicy.AFTER_PREFILL,
        num_pages=runner.pool.num_pages,
        block_size=PAGE_SIZE,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_running=max(concurrency, 8),
    )
    dedup0 = runner.deduplicated_tokens

    async def main() -> None:
        queue = list(reversed(prompts))
        async with AsyncEngine(runner, config) as engine:

            async def client() -> None:
                while queue:
                    prompt = queue.pop()
                    rep = await engine.generate(prompt, SamplingParams(max_tokens=new)).result()
                    assert rep.ttft is not None and len(rep.output_token_ids) == new
                    res.ttft.append(rep.ttft)
                    res.first_arrival = min(res.first_arrival, rep.arrived_at)
                    res.last_finish = max(res.last_finish, rep.finished_at)
                    res.tokens += len(rep.output_token_ids)

            await asyncio.gather(*(client() for _ in range(concurrency)))
            res.prefill = engine.scheduler.stats.prefill_tokens

    asyncio.run(main())
    res.prefill -= runner.deduplicated_tokens - dedup0
    return res


# -- transformers' continuous batching -------------------------------------------------------
def run_transformers(
    model: Any, prompts: list[list[int]], concurrency: int, new: int, counter: list[int]
) -> Result:
    res = Result()
    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=new, do_sample=False, eos_token_id=-1
    )
    cb = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=1024,
        max_batch_tokens=MAX_BATCH_TOKENS,
        allow_block_sharing=True,
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        counter[0] = 0
        queue = list(reversed(prompts))
        sent: dict[str, float] = {}

        def send() -> None:
            prompt = queue.pop()
            t = time.perf_counter()
            rid = manager.add_request(prompt, max_new_tokens=new, record_timestamps=True)
            sent[rid] = t
            res.first_arrival = min(res.first_arrival, t)

        for _ in range(min(concurrency, len(queue))):
            send()
        done = 0
        while done < len(prompts):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' continuous batching returned no result")
            if not out.is_finished():
                continue
            now = time.perf_counter()
            if out.error is not None:
                raise RuntimeError(out.error)
            assert out.timestamps is not None and len(out.generated_tokens) == new
            res.ttft.append(out.timestamps[0] - sent[out.request_id])
            res.last_finish = max(res.last_finish, min(now, out.timestamps[-1]))
            res.tokens += len(out.generated_tokens)
            done += 1
            if queue:
                send()
        res.prefill = counter[0] - len(prompts) * (new - 1)
    finally:
        manager.stop(block=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    torch.set_num_threads(args.threads)
    ours_model = load_smollm2(device="cpu", dtype=args.dtype)
    tok = ours_model.tokenizer
    theirs = load_smollm2(device="cpu", dtype=args.dtype).model  # its own copy (CB switches
    # its attention implementation)
    prompts = build_prompts(tok, args)
    lengths = {w: sorted({len(p) for p in ps}) for w, ps in prompts.items()}
    runner = TransformersRunner.for_model(
        ours_model.model, num_pages=1024, block_size=PAGE_SIZE, device="cpu", dtype=args.dtype
    )
    counter = [0]

    def count(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None:
            counter[0] += int(ids.shape[-1])

    theirs.register_forward_pre_hook(count, with_kwargs=True)
    conc = {"shared_system_prompt": args.concurrency}
    # warm-up: one short request each (allocation, first-call costs)
    run_ours(runner, [prompts["cold"][0][:64]], 1, 2)
    run_transformers(theirs, [prompts["cold"][0][:64]], 1, 2, counter)

    runs: dict[str, dict[str, Callable[[], Result]]] = {}
    for w in workloads:
        c = conc.get(w, len(prompts[w]))
        runs[w] = {
            "ours": lambda w=w, c=c: run_ours(runner, prompts[w], c, args.new_tokens),  # type: ignore[misc]
            "transformers": lambda w=w, c=c: run_transformers(  # type: ignore[misc]
                theirs, prompts[w], c, args.new_tokens, counter
            ),
        }
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        w: {e: [] for e in ENGINES} for w in workloads
    }
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for w in workloads:
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            for e in order:
                s = runs[w][e]().summary()
                samples[w][e].append(s)
                print(
                    f"round {r + 1} {w:<22} {e:<12} "
                    + " ".join(f"{k}={v:.3f}" for k, v in s.items()),
                    flush=True,
                )
    load_after = os.getloadavg()
    med = {
        w: {
            e: {k: statistics.median(s[k] for s in samples[w][e]) for k in samples[w][e][0]}
            for e in ENGINES
        }
        for w in workloads
    }
    print(
        f"\nSmolLM2-135M {args.dtype} on cpu, {args.threads} thread(s), "
        f"{args.new_tokens} new tokens, "
        f"median of {args.rounds} rounds; load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    head = (
        f"{'workload':<22} {'engine':<12} {'TTFT p50':>9} {'TTFT p95':>9} {'makespan':>9} "
        f"{'tok/s':>7} {'prefill':>8}"
    )
    print(head)
    for w in workloads:
        for e in ENGINES:
            m = med[w][e]
            print(
                f"{w:<22} {e:<12} {m['ttft_p50']:>8.2f}s {m['ttft_p95']:>8.2f}s "
                f"{m['makespan']:>8.2f}s {m['tokens_per_s']:>7.1f} "
                f"{m['prefill_tokens_computed']:>8.0f}"
            )
        o, t = med[w]["ours"], med[w]["transformers"]
        print(
            f"{'':<22} {'ours/theirs':<12} {o['ttft_p50'] / t['ttft_p50']:>9.2f} "
            f"{o['ttft_p95'] / t['ttft_p95']:>9.2f} {o['makespan'] / t['makespan']:>9.2f} "
            f"{o['tokens_per_s'] / t['tokens_per_s']:>7.2f}"
        )
    if args.json:
        harness.write_json(
            args.json,
            {
                "workloads": med,
                "samples": samples,
                "prompt_lengths": lengths,
                "settings": {
                    "model": "SmolLM2-135M-Instruct",
                    "dtype": args.dtype,
                    "device": "cpu",
                    "threads": args.threads,
                    "new_tokens": args.new_tokens,
                    "rounds": args.rounds,
                    "requests": args.requests,
                    "concurrency": args.concurrency,
                    "group": args.group,
                    "ours": "AsyncEngine, EngineConfig(release_policy=AFTER_PREFILL, "
                    "page_size=16, max_batch_tokens=1024), paged attention",
                    "transformers": "init_continuous_batching, ContinuousBatchingConfig("
                    "page_size=16, num_blocks=1024, max_batch_tokens=1024, "
                    "allow_block_sharing=True), sdpa",
                },
                "load": [load_before, load_after],
                "units": {"ttft": "s", "makespan": "s", "tokens_per_s": "tokens/s"},
            },
        )


if __name__ == "__main__":
    main()
