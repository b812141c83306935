"""N concurrent streaming clients sharing a system prompt: AsyncEngine called directly
against the same engine behind ``prefixflight serve`` (HTTP + server-sent events).

Both sides serve SmolLM2-135M-Instruct with the same engine settings. Each client sends
one chat request (the shared system prompt, then a question of its own) with greedy
decoding, ``max_tokens`` tokens and ``ignore_eos`` (so both sides produce the same number
of tokens). A round is N clients at once; before the rounds each side serves one warm-up
request, so the system prompt is cached, as it would be on a long-running server. Rounds
alternate between the two sides (direct, HTTP, direct, ...) so both see the same machine
load. The server is a real ``prefixflight serve`` subprocess on a free 127.0.0.1 port,
driven by ``httpx`` streaming clients; everything is bounded by ``--timeout``.

TTFT is measured by the client: from sending the request to its first token (direct: the
first token from the `Generation`; HTTP: the first SSE chunk with text). Tokens/s is the
tokens of all clients over the wall time of their rounds. ``cached_token_share`` is the
servers' ``usage.prompt_tokens_details.cached_tokens`` over ``prompt_tokens``.

    python benchmarks/serve/serve_load.py [--clients 8] [--rounds 3] [--max-tokens 32]
        [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
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

import httpx
import torch

from prefixflight.backends.torch import AsyncEngine, EngineConfig, SamplingParams, load_smollm2
from prefixflight.serve.http import HFCodec

SYSTEM = (
    "You are a careful assistant for a travel agency. You answer questions about trains, "
    "flights, hotels and museums in European capitals. Be brief: one or two sentences. "
    "Prices are in euros. Opening hours are local time. If you do not know an answer, say "
    "so instead of guessing. Never invent train numbers or flight numbers. Prefer public "
    "transport over taxis, and mention accessibility when it matters. "
) * 3
TOPICS = (
    "Paris",
    "Rome",
    "Berlin",
    "Madrid",
    "Vienna",
    "Prague",
    "Lisbon",
    "Athens",
    "Dublin",
    "Oslo",
    "Warsaw",
    "Brussels",
    "Budapest",
    "Helsinki",
    "Copenhagen",
    "Amsterdam",
)


def question(round_: int, client: int) -> list[dict[str, str]]:
    city = TOPICS[(round_ * 7 + client) % len(TOPICS)]
    text = f"Round {round_}, client {client}: what is one museum worth visiting in {city}?"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Side:
    """TTFTs, tokens and wall time of one side over its rounds."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.tokens = 0
        self.wall = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def summary(self, *, cached: bool) -> dict[str, float]:
        out = {
            "ttft_p50": statistics.median(self.ttft),
            "ttft_p95": percentile(self.ttft, 0.95),
            "tokens_per_s": self.tokens / self.wall,
        }
        if cached:
            out["cached_token_share"] = self.cached_tokens / self.prompt_tokens
        return out


async def direct_round(
    engine: AsyncEngine, codec: HFCodec, r: int, n: int, max_tokens: int, side: Side
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(c: int) -> None:
        ids = codec.chat(question(r, c))
        sent = time.perf_counter()
        first = None
        count = 0
        async for _ in engine.generate(ids, params):
            if first is None:
                first = time.perf_counter() - sent
            count += 1
        assert first is not None
        side.ttft.append(first)
        side.tokens += count

    start = time.perf_counter()
    await asyncio.gather(*(one(c) for c in range(n)))
    side.wall += time.perf_counter() - start


async def http_round(
    client: httpx.AsyncClient, model: str, r: int, n: int, max_tokens: int, side: Side | None
) -> None:
    async def one(c: int) -> None:
        body = {
            "model": model,
            "messages": question(r, c),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = None
        usage = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if (
                    first is None
                    and chunk["choices"]
                    and chunk["choices"][0]["delta"].get("content")
                ):
                    first = time.perf_counter() - sent
                if chunk.get("usage"):
                    usage = chunk["usage"]
        assert first is not None and usage is not None
        if side is not None:
            side.ttft.append(first)
            side.tokens += usage["completion_tokens"]
            side.prompt_tokens += usage["prompt_tokens"]
            side.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]

    start = time.perf_counter()
    await asyncio.gather(*(one(c) for c in range(n)))
    if side is not None:
        side.wall += time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_smollm2(device="cpu")
    codec = HFCodec(loaded.tokenizer)
    config = EngineConfig(num_pages=args.num_pages, max_running=max(16, args.clients))
    flags = ["--num-pages", str(args.num_pages), "--threads", str(args.threads)]
    flags += ["--max-running", str(max(16, args.clients)), "--max-waiting", str(4 * args.clients)]
    proc, url, _ = harness.start_serve("smollm2", flags, timeout=args.timeout)
    direct, http = Side(), Side()
    try:
        limits = httpx.Limits(max_connections=args.clients + 4)
        timeout = httpx.Timeout(args.timeout)
        async with (
            AsyncEngine.from_model(loaded.model, config, tokenizer=loaded.tokenizer) as engine,
            httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client,
        ):
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            # warm-up: one request each, so the shared system prompt is cached on both sides
            await direct_round(engine, codec, -1, 1, args.max_tokens, Side())
            await http_round(client, model, -1, 1, args.max_tokens, None)
            for r in range(args.rounds):
                await direct_round(engine, codec, r, args.clients, args.max_tokens, direct)
                await http_round(client, model, r, args.clients, args.max_tokens, http)
    finally:
        harness.stop_serve(proc)
    d = direct.summary(cached=False)
    h = http.summary(cached=True)
    return {
        "clients": args.clients,
        "direct": d,
        "http": h,
        "ttft_overhead": h["ttft_p50"] / d["ttft_p50"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds, for every wait")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    if min(args.clients, args.rounds, args.max_tokens, args.threads) < 1:
        ap.error("--clients, --rounds, --max-tokens and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    report = asyncio.run(asyncio.wait_for(run(args), timeout=args.timeout))
    d, h = report["direct"], report["http"]
    print(
        f"{args.clients} concurrent streaming clients x {args.rounds} rounds, "
        f"{args.max_tokens} tokens each, SmolLM2-135M-Instruct, {args.threads} threads "
        f"(load average {load_before:.1f} before, run took "
        f"{time.perf_counter() - started:.0f} s)"
    )
    print(f"{'side':<8}{'TTFT p50':>11}{'TTFT p95':>11}{'tokens/s':>10}{'cached share':>14}")
    print(
        f"{'direct':<8}{d['ttft_p50']:>10.3f}s{d['ttft_p95']:>10.3f}s"
        f"{d['tokens_per_s']:>10.1f}{'-':>14}"
    )
    print(
        f"{'http':<8}{h['ttft_p50']:>10.3f}s{h['ttft_p95']:>10.3f}s"
        f"{h['tokens_per_s']:>10.1f}{h['cached_token_share']:>14.3f}"
    )
    print(
        f"HTTP / direct: TTFT p50 x{report['ttft_overhead']:.3f}, "
        f"TTFT p95 x{h['ttft_p95'] / d['ttft_p95']:.3f}, "
        f"tokens/s x{h['tokens_per_s'] / d['tokens_per_s']:.3f}"
    )
    if args.json:
        harness.write_json(args.json, report)


if __name__ == "__main__":
    main()
