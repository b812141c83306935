"""Where does a serving engine compute a shared prefix twice? prefixflight against vLLM.

Each engine serves the same converted SmolLM2-135M folder over HTTP, one at a time, and
the same client sends the same prompts (token ids) to each:

- ``burst_warm_4``: a 532-token prompt once, then 4 more copies at once (128 tokens out);
- ``burst_cold_4`` / ``burst_cold_8``: 4 or 8 identical cold 532-token prompts at once
  (the single-flight prefill study's burst, 128 out);
- ``doc_together_4``: 4 identical long documents (``--doc-tokens``, 8,000 by default) at
  once, under a step budget below the document (``--budget``, 2,048), 16 out;
- ``doc_late_4``: one long document, then 3 copies ``--late`` seconds later, while its
  prefill is under way;
- ``doc_tails_4``: 4 prompts sharing the long document, each with its own 64-token tail,
  at once.

Per workload it reports the prompt tokens the engine computed (the sum of prompt minus
cached tokens over the responses, ``usage.prompt_tokens_details.cached_tokens``; and from
the server's metrics: prefixflight's ``computed_prompt_tokens``, vLLM's prompt tokens minus
its prefix-cache hits), how many of them an ideal prefix cache at the engine's block size
would not have computed (``duplicate``: each request reusing the longest block-aligned
prefix any earlier request has, always computing its last token), the mean TTFT and the
slowest completion.

Engines: ``ours`` (``prefixflight serve``, release policy ``--policy``), ``ours-independent``
(no single flight: same-step sharing alone), ``vllm`` (its defaults, the same step budget),
``vllm-threshold`` (``--long-prefill-token-threshold``: long prefills are capped per step so
several progress side by side, vLLM V1's form of concurrent partial prefills; vLLM 0.32 has
no ``--max-num-partial-prefills`` any more), and each of the two vLLM engines with
prefixflight's single flight inside (``vllm-flight``, ``vllm-threshold-flight``: the plugin,
``--scheduler-cls prefixflight.vllm.Scheduler`` with ``single_flight`` on, release
``--policy``; the vLLM venv needs prefixflight installed, as benchmarks/vllm/setup.sh does).

    python benchmarks/flight/duplicate_prefill.py --model-dir DIR [--vllm-python PY]
        [--engines ours,vllm,...] [--rounds 1] [--doc-tokens 8000] [--json FILE]

The machine is shared: token counts are exact, times are noisy (interleave rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

ENGINES = (
    "ours",
    "ours-independent",
    "vllm",
    "vllm-threshold",
    "vllm-flight",
    "vllm-threshold-flight",
)
WORKLOADS = (
    "burst_warm_4",
    "burst_cold_4",
    "burst_cold_8",
    "doc_together_4",
    "doc_late_4",
    "doc_tails_4",
)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def workload(
    name: str, seed: int, doc_tokens: int, late: float
) -> list[tuple[float, list[int], int, bool]]:
    """``(delay seconds, prompt ids, max tokens, measured)`` per request, in arrival order."""
    rng = random.Random(f"{name}-{seed}")
    if name.startswith("burst"):
        prompt = tokens(rng, 532)
        n = int(name.rsplit("_", 1)[1])
        warm = [(0.0, prompt, 128, False)] if "warm" in name else []
        return warm + [(0.0, prompt, 128, True)] * n
    doc = tokens(rng, doc_tokens)
    if name == "doc_together_4":
        return [(0.0, doc, 16, True)] * 4
    if name == "doc_late_4":
        return [(0.0, doc, 16, True)] + [(late, doc, 16, True)] * 3
    if name == "doc_tails_4":
        base = doc[: doc_tokens - 64]
        return [(0.0, base + tokens(rng, 64), 16, True) for _ in range(4)]
    raise ValueError(name)


def ideal_computed(prompts: Sequence[list[int]], block: int) -> int:
    """Prompt tokens a perfect prefix cache at ``block`` computes, requests in order."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            for a, b in zip(p, q, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += len(p) - min(best, len(p) - 1) // block * block
    return total


class Server:
    def __init__(self, engine: str, args: argparse.Namespace) -> None:
        self.engine = engine
        self.port = harness.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if engine.startswith("ours"):
            policy = "independent" if engine == "ours-independent" else args.policy
            cmd = [
                args.ours_python, "-m", "prefixflight.cli", "serve",
                "--port", str(self.port), "--max-batch-tokens", str(args.budget),
                "--num-pages", str(args.num_pages), "--block-size", str(args.ours_block),
                "--release-policy", policy, "--threads", str(args.threads),
                "--dtype", args.ours_dtype, "--max-running", "16", "--max-waiting", "64",
            ]  # fmt: skip
            self.block = args.ours_block
        else:
            cmd = [
                args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.model_dir, "--served-model-name", "smollm2",
                "--enable-prompt-tokens-details", "--host", "127.0.0.1",
                "--port", str(self.port), "--enforce-eager",
                "--max-num-batched-tokens", str(args.budget), "--max-model-len", "8192",
                "--block-size", str(args.vllm_block),
            ]  # fmt: skip
            if engine.startswith("vllm-threshold"):
                cmd += ["--long-prefill-token-threshold", str(args.threshold)]
            if engine.endswith("-flight"):
                flight = {"single_flight": {"release": args.policy}}
                cmd += ["--scheduler-cls", "prefixflight.vllm.Scheduler"]
                cmd += ["--additional-config", json.dumps({"prefixflight": flight})]
            env.update(
                VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="2"
            )
            self.block = args.vllm_block
        log = Path(args.logs) / f"{engine}-{self.port}.log"
        self.server = harness.Process(engine, cmd, log, env)
        self.startup = self.server.wait_http(self.base + "/health", 300)
        self.model = httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            if key in (
                "vllm:prompt_tokens_total",
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total",
                "prefixflight:computed_prompt_tokens_total",
            ):
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def computed_from_metrics(self, before: dict[str, float], after: dict[str, float]) -> float:
        def d(k: str) -> float:
            return after.get(k, 0.0) - before.get(k, 0.0)

        if self.engine.startswith("ours"):
            return d("prefixflight:computed_prompt_tokens_total")
        return d("vllm:prompt_tokens_total") - d("vllm:prefix_cache_hits_total")

    def stop(self) -> None:
        self.server.stop()


async def one(
    client: httpx.AsyncClient, srv: Server, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": srv.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    sent = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", srv.base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if (
                chunk.get("choices")
                and first is None
                and chunk["choices"][0].get("text") is not None
            ):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "prompt_tokens": int(usage.get("prompt_tokens", len(prompt))),
        "cached_tokens": cached,
        "ttft": (first or end) - sent,
        "latency": end - sent,
    }


async def run_workload(
    srv: Server, name: str, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    reqs = workload(name, seed, args.doc_tokens, args.late)
    async with httpx.AsyncClient(timeout=600) as client:
        warm = [r for r in reqs if not r[3]]
        for _, prompt, out, _ in warm:
            await one(client, srv, prompt, out)
        before = srv.metrics()
        start = time.perf_counter()

        async def delayed(delay: float, prompt: list[int], out: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            return await one(client, srv, prompt, out)

        measured = [r for r in reqs if r[3]]
        results = await asyncio.gather(*(delayed(d, p, o) for d, p, o, _ in measured))
        await asyncio.sleep(0.5)  # the server counts a request when it ends
        after = srv.metrics()
    prompts = [p for _, p, _, _ in reqs]
    computed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in results)
    ideal = ideal_computed(prompts, srv.block) - ideal_computed(prompts[: len(warm)], srv.block)
    return {
        "workload": name,
        "requests": len(results),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": [r["cached_tokens"] for r in results],
        "computed_prompt_tokens": computed,
        "computed_from_metrics": srv.computed_from_metrics(before, after),
        "ideal_computed": ideal,
        "duplicate_tokens": computed - ideal,
        "mean_ttft": sum(r["ttft"] for r in results) / len(results),
        "slowest_completion": max(r["latency"] for r in results),
    }


def summary(rows: list[dict[str, Any]]) -> str:
    """A markdown table: per workload and engine, the medians over rounds."""

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2]

    out = [
        "| workload | engine | block | prompt tokens computed (ideal) | duplicate | mean TTFT (s) "
        "| slowest (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["workload"], r["engine"]) for r in rows},
        key=lambda k: (WORKLOADS.index(k[0]) if k[0] in WORKLOADS else 99, ENGINES.index(k[1])),
    )
    for w, e in keys:
        rs = [r for r in rows if (r["workload"], r["engine"]) == (w, e)]
        computed = med([r["computed_prompt_tokens"] for r in rs])
        dup = med([r["duplicate_tokens"] for r in rs])
        out.append(
            f"| {w} | {e} | {rs[0]['block_size']} | {computed:.0f} ({rs[0]['ideal_computed']}) "
            f"| {dup:.0f} | {med([r['mean_ttft'] for r in rs]):.2f} "
            f"| {med([r['slowest_completion'] for r in rs]):.1f} |"
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", required=True, help="the converted SmolLM2 folder (load_smollm2)")
    p.add_argument("--vllm-python", default=str(harness.ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--ours-python", default=sys.executable)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--doc-tokens", type=int, default=8000)
    p.add_argument("--late", type=float, default=1.0, help="doc_late_4: seconds before the copies")
    p.add_argument("--budget", type=int, default=2048, help="tokens per step, both engines")
    p.add_argument("--threshold", type=int, default=512, help="vllm-threshold's cap per prefill")
    p.add_argument("--policy", default="after_prefill", help="ours: the release policy")
    p.add_argument("--ours-block", type=int, default=16)
    p.add_argument("--vllm-block", type=int, default=128)
    p.add_argument("--ours-dtype", default="bfloat16")
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--logs", default="/tmp")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    engines = args.engines.split(",")
    names = args.workloads.split(",")
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine in order:
            srv = Server(engine, args)
            print(f"round {r + 1} {engine}: up in {srv.startup:.1f} s", flush=True)
            try:
                asyncio.run(run_workload(srv, "burst_cold_4", 10_000 + r, args))  # warm-up
                for name in names:
                    row = asyncio.run(run_workload(srv, name, r, args))
                    row.update(engine=engine, round=r + 1, block_size=srv.block)
                    rows.append(row)
                    print(
                        f"  {name:<15} computed {row['computed_prompt_tokens']:>6} "
                        f"(metrics {row['computed_from_metrics']:>7.0f}, ideal "
                        f"{row['ideal_computed']:>6}, duplicate {row['duplicate_tokens']:>6}) "
                        f"cached {row['cached_tokens']} ttft {row['mean_ttft']:.3f} s "
                        f"slowest {row['slowest_completion']:.2f} s",
                        flush=True,
                    )
            finally:
                srv.stop()
    load = os.getloadavg()
    print(summary(rows))
    print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        del config["json"]
        harness.write_json(args.json, {"load_average_after": load, "config": config, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
