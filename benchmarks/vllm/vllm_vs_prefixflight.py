"""vLLM's OpenAI server against ``prefixflight serve``: the same model, client and workloads.

Both servers serve the converted SmolLM2-135M-Instruct folder that `load_smollm2` writes, at
their defaults on this CPU (bf16 where the CPU has native bf16), with 2 threads each: vLLM
CPU (``python -m vllm.entrypoints.openai.api_server --dtype bfloat16
--enable-prompt-tokens-details``, ``VLLM_CPU_OMP_THREADS_BIND=0-1``,
``VLLM_CPU_KVCACHE_SPACE=1``; its defaults: block 128, chunked prefill with a 2,048-token
step, torch.compile) and ``prefixflight serve --threads 2`` (block 16, a 2,048-token step).
One server runs at a time; a round starts each server, runs every workload on it and stops
it, and the order alternates from round to round, so both see the same machine. Every
number is the median over rounds; ratios are ours / vLLM's.

One client for both: the ``openai`` package's ``AsyncOpenAI``, streaming, with
``stream_options.include_usage`` (so each request reports ``cached_tokens``); greedy, and
``ignore_eos`` so both generate exactly ``max_tokens``. TTFT is the client's, from sending
to the first streamed text. The workloads (token ids and chat messages) are built once from
the model's tokenizer and are the same for both servers; ``--workload FILE`` writes them
(or reads them, if FILE exists). A workload sends its own ``cache_salt``, so nothing it
reuses comes from another workload.

Workloads (the single-flight prefill study of mini-vllm-rs for the first four):

- ``cold_prompt`` / ``warm_prefix``: a 904-token document prompt, then a second one sharing
  its first 880 tokens (1 output token each): cold TTFT, warm TTFT and cached tokens;
- ``identical_4`` / ``identical_8``: 4 or 8 identical cold 532-token prompts at once, 128
  output tokens: mean TTFT, slowest completion, cached tokens per request;
- ``chat_8``: 8 chat clients sharing a ~500-token system prompt, 4 requests each in a closed
  loop, 64 output tokens (after one warm-up request that caches the system prompt);
- ``grpo_8``: 4 groups of 8 identical ~500-token prompts, all sent at once, sampled at
  temperature 1, 64 output tokens (no per-request seed: vllm-cpu 0.32.0's engine dies on a
  seeded request whose prefill is split across steps, "CPU Generator does not use offset");
- ``long_document`` / ``long_document_8k``: a 4,000- or 8,000-token document and 8
  questions about it at once (chunked prefill on both: the prompt is longer than either
  server's step), 32 output tokens;
- ``startup``: seconds from starting the server process to its first ``/health`` 200.

``--servers`` picks the servers: ``prefixflight`` and ``vllm`` by default;
``prefixflight-vllm-kernel`` is ours with vLLM CPU's attention kernel (``serve --attention
vllm-cpu --vllm-library`` the vLLM venv); ``vllm-plugin`` and ``vllm-checked`` are vLLM with
prefixflight's scheduler plugin inside.

Per workload and server: TTFT p50/p95, mean TTFT, tokens/s (output tokens over the time from
the first request sent to the last finished), slowest completion, cached tokens (mean per
request, from the usage), and prefill tokens computed from the server's own ``/metrics``
(the difference over the workload: vLLM's ``vllm:prompt_tokens_by_source_total{source=
"local_compute"}``, ours ``prefixflight:computed_prompt_tokens_total``), and ``cpu_s``: the
CPU seconds the server's process tree used during the workload (user + system, all its
threads and processes; with psutil), which other jobs on a shared machine inflate far less
than they inflate wall-clock times.

    python benchmarks/vllm/vllm_vs_prefixflight.py [--rounds 3] [--json FILE]
        [--vllm-python .venv-vllm/bin/python] [--workloads chat_8,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

ROOT = harness.ROOT
SERVERS = ("prefixflight", "prefixflight-vllm-kernel", "vllm", "vllm-plugin", "vllm-checked")
# ours with vLLM CPU's attention kernel (serve --attention vllm-cpu), from the vLLM venv
KERNEL = "prefixflight-vllm-kernel"
# vLLM with prefixflight inside (the plugin, docs/vllm.md): its "lru" eviction, and the same
# in checked mode; the vLLM venv needs prefixflight installed (benchmarks/vllm/setup.sh does)
PLUGIN = {"vllm-plugin": {"eviction": "lru"}, "vllm-checked": {"eviction": "lru", "checked": True}}
WORKLOADS = (
    "cold_prompt",
    "warm_prefix",
    "identical_4",
    "identical_8",
    "chat_8",
    "grpo_8",
    "long_document",
    "long_document_8k",
)
DOCUMENTS = {"long_document": 4000, "long_document_8k": 8000}  # workload: document tokens
THREADS = 2
_TOPICS = (
    "harbour records", "river tolls", "wool trade", "salt roads", "the council of wardens",
    "the storm archive", "timber prices", "dyed cloth", "the northern road", "the hill fort",
    "ledger clerks", "inland towns", "trading houses", "the river bar", "new-moon hearings",
    "cargo lists",
)  # fmt: skip


# -- workloads ----------------------------------------------------------------------------------
def _system_prompt(tok: Any, target: int) -> str:
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


def build_workloads(model_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    # the single-flight study's documents, as `prefixflight bench ttft` builds them
    from prefixflight.cli._bench import document_tokens as _document

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def ids(text: str) -> list[int]:
        return [int(t) for t in tok(text)["input_ids"]]

    doc = _document(tok, 880, 0)
    tail = 904 - 880
    questions = (
        "Question: why did the council move the archive, and what changed afterwards? Answer:",
        "Summarise in two sentences how tolls were decided and who kept the ledgers. Summary:",
    )
    q1, q2 = ((ids(q) * tail)[:tail] for q in questions)
    system = _system_prompt(tok, 500)
    chats = [
        [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": f"Question {i}: what do the records say about "
                f"{_TOPICS[i % len(_TOPICS)]}?",
            },
        ]
        for i in range(33)
    ]
    return {
        "warm": {"cold": doc + q1, "warm": doc + q2, "max_tokens": 1},
        "identical": {"prompt": _document(tok, 532, 2), "max_tokens": 128},
        "chat": {"clients": 8, "warmup": chats[0], "requests": chats[1:], "max_tokens": 64},
        "grpo": {
            "prompts": [
                _document(tok, 500, 11 + 5 * g) + ids("\nSummarise the entries.") for g in range(4)
            ],
            "group": 8,
            "max_tokens": 64,
        },
        **{
            name: {
                "prompts": [
                    _document(tok, n, 7)
                    + ids(f"\nQuestion {i}: what does the document say about {t}? Answer:")
                    for i, t in enumerate(_TOPICS[:8])
                ],
                "max_tokens": 32,
            }
            for name, n in DOCUMENTS.items()
        },
    }


# -- servers ------------------------------------------------------------------------------------
class Server:
    """One server process on 127.0.0.1: started, timed to its first /health 200, stopped."""

    def __init__(self, kind: str, args: argparse.Namespace, log: Path) -> None:
        self.kind = kind
        self.port = harness.free_port()
        env = dict(os.environ)
        if kind.startswith("vllm"):
            env.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="1")
            cmd = [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(args.model_dir),
                "--served-model-name",
                "model",
                "--dtype",
                "bfloat16",
                "--enable-prompt-tokens-details",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *args.vllm_arg,
            ]
            if kind in PLUGIN:
                cmd += ["--scheduler-cls", "prefixflight.vllm.Scheduler"]
                cmd += ["--additional-config", json.dumps({"prefixflight": PLUGIN[kind]})]
        else:
            env = harness.checkout_env(env)
            cmd = [
                sys.executable,
                "-m",
                "prefixflight.cli",
                "serve",
                "--served-model-name",
                "model",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--threads",
                str(THREADS),
                *args.prefixflight_arg,
            ]
            if kind == KERNEL:
                venv = Path(args.vllm_python).parents[1]
                cmd += ["--attention", "vllm-cpu", "--vllm-library", str(venv)]
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = harness.Process(kind, cmd, log, env)
        self.proc = self.server.popen
        try:
            self.startup = self.server.wait_http(f"{self.url}/health", args.timeout)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None

    def stop(self) -> None:
        self.server.stop()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server process and its children so far."""
        try:
            import psutil  # type: ignore[import-untyped]
        except ImportError:
            return float("nan")
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return float("nan")
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def computed_prompt_tokens(self) -> float:
        """Prefill tokens computed so far, from the server's own /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if self.kind.startswith("vllm"):
                    if (
                        s.name == "vllm:prompt_tokens_by_source_total"
                        and s.labels.get("source") == "local_compute"
                    ):
                        total += s.value
                elif s.name == "prefixflight:computed_prompt_tokens_total":
                    total += s.value
        return total


# -- one request, one workload ------------------------------------------------------------------
class Req:
    """One request's client-side measurements (seconds of ``time.perf_counter``)."""

    __slots__ = ("cached", "done", "first", "sent", "tokens")

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.done = 0.0
        self.tokens = 0
        self.cached = 0


async def _request(
    client: AsyncOpenAI,
    *,
    prompt: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int,
    salt: str,
    temperature: float = 0.0,
    seed: int | None = None,
) -> Req:
    req = Req()
    extra = {"ignore_eos": True, "cache_salt": salt}
    common: dict[str, Any] = {
        "model": "model",
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": extra,
    }
    if seed is not None:
        common["seed"] = seed
    stream: Any
    if messages is not None:
        stream = await client.chat.completions.create(messages=messages, **common)  # type: ignore[arg-type]
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    usage = None
    async for chunk in stream:
        if chunk.choices and req.first is None:
            choice = chunk.choices[0]
            text = choice.delta.content if messages is not None else choice.text
            if text:
                req.first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    req.done = time.perf_counter()
    if usage is None or req.first is None:
        raise RuntimeError("the stream ended without text or usage")
    req.tokens = usage.completion_tokens
    details = usage.prompt_tokens_details
    req.cached = int(details.cached_tokens or 0) if details is not None else 0
    return req


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summary(reqs: Sequence[Req], computed: float, cpu: float) -> dict[str, Any]:
    ttft = [r.first - r.sent for r in reqs if r.first is not None]
    start = min(r.sent for r in reqs)
    end = max(r.done for r in reqs)
    return {
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": _percentile(ttft, 0.95),
        "mean_ttft": statistics.mean(ttft),
        "tokens_per_s": sum(r.tokens for r in reqs) / (end - start),
        "prefill_tokens_computed": computed,
        "cached_tokens": statistics.mean(r.cached for r in reqs),
        "cached_tokens_per_request": [r.cached for r in reqs],
        "slowest_completion": max(r.done - r.sent for r in reqs),
        "cpu_s": cpu,
    }


async def run_workloads(
    server: Server, work: dict[str, Any], names: Sequence[str], round_: int
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}

    def report(name: str, s: dict[str, Any]) -> None:
        print(
            f"round {round_ + 1} {server.kind:<12} {name:<14} ttft p50 {s['ttft_p50']:7.3f} "
            f"mean {s['mean_ttft']:7.3f} slowest {s['slowest_completion']:7.2f} "
            f"tok/s {s['tokens_per_s']:7.1f} cached {s['cached_tokens']:7.1f} "
            f"computed {s['prefill_tokens_computed']:6.0f} cpu {s['cpu_s']:6.2f} s",
            flush=True,
        )

    client = AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        timeout=600.0,
        max_retries=0,
    )

    async def measured(name: str, body: Callable[[str], Awaitable[list[Req]]]) -> None:
        before, cpu = server.computed_prompt_tokens(), server.cpu_seconds()
        try:
            reqs = await body(f"{name}-{round_}")
        except Exception as exc:  # recorded; a server that died fails the rest the same way
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"round {round_ + 1} {server.kind:<12} {name:<14} FAILED: {exc}", flush=True)
            return
        computed = server.computed_prompt_tokens() - before
        out[name] = _summary(reqs, computed, server.cpu_seconds() - cpu)
        report(name, out[name])

    async with client:
        # warm-up: first-call costs (compilation, allocation) are nobody's TTFT
        await _request(client, prompt=work["identical"]["prompt"][:64], max_tokens=4, salt="w")
        if "cold_prompt" in names or "warm_prefix" in names:
            w = work["warm"]
            salt = f"warm-{round_}"
            before, cpu0 = server.computed_prompt_tokens(), server.cpu_seconds()
            cold = await _request(client, prompt=w["cold"], max_tokens=1, salt=salt)
            mid, cpu1 = server.computed_prompt_tokens(), server.cpu_seconds()
            warm = await _request(client, prompt=w["warm"], max_tokens=1, salt=salt)
            after, cpu2 = server.computed_prompt_tokens(), server.cpu_seconds()
            out["cold_prompt"] = _summary([cold], mid - before, cpu1 - cpu0)
            out["warm_prefix"] = _summary([warm], after - mid, cpu2 - cpu1)
            report("cold_prompt", out["cold_prompt"])
            report("warm_prefix", out["warm_prefix"])
        for n in (4, 8):
            name = f"identical_{n}"
            if name in names:
                ident = work["identical"]

                async def burst(salt: str, n: int = n, ident: dict[str, Any] = ident) -> list[Req]:
                    return list(
                        await asyncio.gather(
                            *(
                                _request(
                                    client,
                                    prompt=ident["prompt"],
                                    max_tokens=ident["max_tokens"],
                                    salt=salt,
                                )
                                for _ in range(n)
                            )
                        )
                    )

                await measured(name, burst)
        if "chat_8" in names:
            chat = work["chat"]

            async def chats(salt: str) -> list[Req]:
                await _request(client, messages=chat["warmup"], max_tokens=4, salt=salt)
                queue = list(reversed(chat["requests"]))
                done: list[Req] = []

                async def one_client() -> None:
                    while queue:
                        msgs = queue.pop()
                        done.append(
                            await _request(
                                client, messages=msgs, max_tokens=chat["max_tokens"], salt=salt
                            )
                        )

                await asyncio.gather(*(one_client() for _ in range(chat["clients"])))
                return done

            await measured("chat_8", chats)
        if "grpo_8" in names:
            grpo = work["grpo"]

            async def groups(salt: str) -> list[Req]:
                return list(
                    await asyncio.gather(
                        *(
                            _request(
                                client,
                                prompt=p,
                                max_tokens=grpo["max_tokens"],
                                salt=salt,
                                temperature=1.0,
                            )
                            for p in grpo["prompts"]
                            for _ in range(grpo["group"])
                        )
                    )
                )

            await measured("grpo_8", groups)
        for name in DOCUMENTS:
            if name in names:
                long = work[name]

                async def questions(salt: str, long: dict[str, Any] = long) -> list[Req]:
                    return list(
                        await asyncio.gather(
                            *(
                                _request(client, prompt=p, max_tokens=long["max_tokens"], salt=salt)
                                for p in long["prompts"]
                            )
                        )
                    )

                await measured(name, questions)
    return out


# -- the rounds ---------------------------------------------------------------------------------
def _median(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in samples[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(s[key] for s in samples)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--workload", default=None, metavar="FILE", help="write (or read) prompts")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--servers", default="prefixflight,vllm", help=f"comma-separated, of {', '.join(SERVERS)}"
    )
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
        help="the vLLM venv's python (benchmarks/vllm/setup.sh builds one; env VLLM_PYTHON)",
    )
    ap.add_argument("--model-dir", type=Path, default=None, help="default: load_smollm2's")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM flag")
    ap.add_argument("--prefixflight-arg", action="append", default=[], help="extra serve flag")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"), help="server logs folder")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    servers = [s for s in args.servers.split(",") if s]
    bad = [w for w in names if w not in WORKLOADS] + [s for s in servers if s not in SERVERS]
    if bad:
        ap.error(f"unknown workload or server {bad[0]!r}")
    if args.model_dir is None:
        from prefixflight.backends.torch import load_smollm2

        args.model_dir = load_smollm2(device="cpu").path  # converts once if needed
    if "vllm" in servers and not Path(args.vllm_python).exists():
        ap.error(f"no vLLM python at {args.vllm_python} (bash benchmarks/vllm/setup.sh VENV)")
    if args.workload and Path(args.workload).exists():
        work = json.loads(Path(args.workload).read_text())
    else:
        work = build_workloads(args.model_dir)
        if args.workload:
            Path(args.workload).write_text(json.dumps(work) + "\n")
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {s: [] for s in servers} for w in (*names, "startup")
    }
    load = [os.getloadavg()[0]]
    errors: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]
        for kind in order:
            log = args.logs / f"vllm_vs_prefixflight-{kind}-{r}.log"
            server = Server(kind, args, log)
            try:
                print(f"round {r + 1} {kind:<12} startup {server.startup:6.1f} s", flush=True)
                samples["startup"][kind].append({"startup_s": server.startup})
                got = asyncio.run(run_workloads(server, work, names, r))
            finally:
                server.stop()
            for w, s in got.items():
                if w in samples and "error" not in s:
                    samples[w][kind].append(s)
                elif w in samples:
                    errors.append({"round": r, "server": kind, "workload": w, **s})
        load.append(os.getloadavg()[0])
    med = {w: {s: _median(v) for s, v in by.items() if v} for w, by in samples.items()}
    print(f"\nmedians of {args.rounds} rounds; load average {load}")
    keys = (
        "ttft_p50", "ttft_p95", "mean_ttft", "tokens_per_s", "slowest_completion",
        "cached_tokens", "prefill_tokens_computed", "cpu_s", "startup_s",
    )  # fmt: skip
    ratios: dict[str, dict[str, float]] = {}
    for w, by in med.items():
        for kind, m in by.items():
            print(f"{w:<14} {kind:<12} " + " ".join(f"{k}={m[k]:.3f}" for k in keys if k in m))
        for kind in PLUGIN:  # the plugin's overhead: vLLM with it against vLLM without
            if kind in by and "vllm" in by:
                over: dict[str, float] = {
                    k: by[kind][k] / by["vllm"][k]
                    for k in ("ttft_p50", "tokens_per_s", "cpu_s")
                    if by["vllm"].get(k) not in (None, 0, 0.0) and k in by[kind]
                }
                ratios.setdefault(w, {}).update({f"{kind}/vllm {k}": v for k, v in over.items()})
                print(
                    f"{w:<14} {kind + '/vllm':<12} "
                    + " ".join(f"{k}=x{v:.3f}" for k, v in over.items())
                )
        for kind, prefix in (("prefixflight", ""), (KERNEL, "kernel/vllm ")):
            if kind in by and "vllm" in by:
                ours, theirs = by[kind], by["vllm"]
                over = {
                    k: ours[k] / theirs[k]
                    for k in keys
                    if k in ours and k in theirs and theirs[k] not in (0, 0.0)
                }
                ratios.setdefault(w, {}).update({prefix + k: v for k, v in over.items()})
                print(
                    f"{w:<14} {prefix or 'ours/vllm ':<12}"
                    + " ".join(f"{k}=x{v:.2f}" for k, v in over.items())
                )
    if {"prefixflight", "vllm"} <= set(servers):
        print("\n" + markdown_table(med))
    if args.json:
        report = {
            "workloads": med,
            "ratios": ratios,
            "samples": samples,
            "errors": errors,
            "settings": {
                "model": "SmolLM2-135M-Instruct (load_smollm2's converted folder)",
                "dtype": "bfloat16 (both; vLLM --dtype bfloat16, ours: the CPU default)",
                "threads": THREADS,
                "rounds": args.rounds,
                "vllm": "vllm-cpu 0.32.0: api_server --dtype bfloat16 "
                "--enable-prompt-tokens-details, VLLM_CPU_OMP_THREADS_BIND=0-1, "
                "VLLM_CPU_KVCACHE_SPACE=1, defaults otherwise (block 128, chunked prefill, "
                "2048-token steps, torch.compile)"
                + (f", {args.vllm_arg}" if args.vllm_arg else ""),
                "prefixflight": "prefixflight serve --threads 2, defaults otherwise (block 16, "
                "2048-token steps, release policy after_prefill)"
                + (f", {args.prefixflight_arg}" if args.prefixflight_arg else ""),
                "client": "openai AsyncOpenAI, streaming with include_usage, ignore_eos",
                "load_average": load,
                "cpu": _cpu_name(),
            },
        }
        harness.write_json(args.json, report)


HEADLINES = (
    ("startup", "startup_s", "start-up to /health", "s"),
    ("cold_prompt", "ttft_p50", "cold 904-token TTFT", "s"),
    ("warm_prefix", "ttft_p50", "warm-prefix TTFT", "s"),
    ("warm_prefix", "cached_tokens", "warm-prefix cached tokens", ""),
    ("identical_4", "mean_ttft", "4 identical 532-token prompts: mean TTFT", "s"),
    ("identical_4", "slowest_completion", "4 identical: slowest completion (128 out)", "s"),
    ("identical_4", "prefill_tokens_computed", "4 identical: prefill tokens computed", ""),
    ("identical_8", "mean_ttft", "8 identical: mean TTFT", "s"),
    ("identical_8", "slowest_completion", "8 identical: slowest completion", "s"),
    ("identical_8", "prefill_tokens_computed", "8 identical: prefill tokens computed", ""),
    ("chat_8", "ttft_p50", "8 chat clients, shared system prompt: TTFT p50", "s"),
    ("chat_8", "tokens_per_s", "8 chat clients: tokens/s", ""),
    ("chat_8", "prefill_tokens_computed", "8 chat clients: prefill tokens computed", ""),
    ("grpo_8", "ttft_p50", "GRPO, 4 groups of 8: TTFT p50", "s"),
    ("grpo_8", "tokens_per_s", "GRPO: tokens/s", ""),
    ("grpo_8", "slowest_completion", "GRPO: slowest completion", "s"),
    ("long_document", "ttft_p50", "4,000-token document, 8 questions: TTFT p50", "s"),
    ("long_document", "tokens_per_s", "long document: tokens/s", ""),
    ("long_document", "prefill_tokens_computed", "long document: prefill tokens computed", ""),
    ("long_document_8k", "ttft_p50", "8,000-token document, 8 questions: TTFT p50", "s"),
    ("long_document_8k", "slowest_completion", "8k document: slowest completion", "s"),
    ("long_document_8k", "tokens_per_s", "8k document: tokens/s", ""),
)


def markdown_table(med: dict[str, dict[str, dict[str, float]]]) -> str:
    """The headline measures as a Markdown table: ours, vLLM's, ours / vLLM's (and ours with
    vLLM's attention kernel, where it ran)."""
    kernel = any(KERNEL in by for by in med.values())
    head = "| measure | prefixflight | vLLM | ours / vLLM |"
    rule = "|---|---:|---:|---:|"
    if kernel:
        head += " ours, vLLM's kernel | its / vLLM |"
        rule += "---:|---:|"
    lines = [head, rule]
    for workload, key, label, unit in HEADLINES:
        by = med.get(workload, {})
        if "prefixflight" not in by or "vllm" not in by or key not in by["vllm"]:
            continue
        theirs = by["vllm"][key]
        ours = by["prefixflight"].get(key)
        cells = [label, _cell(ours, unit), _cell(theirs, unit), _ratio(ours, theirs)]
        if kernel:
            with_kernel = by.get(KERNEL, {}).get(key)
            cells += [_cell(with_kernel, unit), _ratio(with_kernel, theirs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, unit: str) -> str:
    """A measure for the table: seconds to 3 places with their unit, counts whole."""
    return "-" if value is None else f"{value:.3f} {unit}" if unit else f"{value:.0f}"


def _ratio(value: float | None, theirs: float) -> str:
    return f"{value / theirs:.2f}x" if value is not None and theirs else "-"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
