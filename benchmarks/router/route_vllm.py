"""``prefixflight route`` in front of two real vLLM CPU replicas, against the routers people
deploy instead: vllm-router and sglang-router (their cache-aware policies, vllm-router's
KV-event-aware one, and round robin).

    python benchmarks/router/route_vllm.py --rounds 3 --json docs/results/route_vllm.json

Self-contained: it builds what is missing (the vLLM CPU venv with benchmarks/vllm/setup.sh,
vllm-router and sglang-router each in a venv of its own under --venvs, never this project's
environment), converts SmolLM2-135M-Instruct once (``load_smollm2``'s cache), starts two vLLM
OpenAI servers on loopback, one core each (VLLM_CPU_OMP_THREADS_BIND=0 and 1), with KV events
on, and then, per round, every router in turn (order rotated by round), each on prefix caches
reset before it starts:

- GRPO: ``--steps`` steps of ``--prompts`` prompts x G=8 samples (temperature 1, fixed output
  length), a step's requests sent at once, the next step when it is done;
- shared-prefix mix: ``--mix-requests`` requests, each one of 4 system prompts plus its own
  question, Poisson arrivals at ``--mix-rate`` per second.

Every request is a streamed text completion through the router under test (the openai
client). Where it ran is read from the answer (each replica serves the model under its own
first name, ``rep0``/``rep1``, and under the shared name the client asks for); hit rates come
from the replicas' own /metrics (``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``); TTFT is the client's, from sending to the first
streamed token (routing and any window included). Medians of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness
from benchmarks.vllm import launch as vllm_launch

ROOT = harness.ROOT
VLLM_VERSION = "0.32.0"
PEERS = {"vllm-router": "vllm-router==0.1.17", "sglang-router": "sglang-router==0.3.2"}
MODEL = "smollm2"  # the name every replica also serves; the client asks for it
BLOCK = 32  # vLLM's KV block size here (a multiple of 32 on CPU)
G = 8

ROUTERS = {
    "burst": "prefixflight route --quiet-ms 0 (llm-d's fixed 100 ms window, KV events)",
    "burst_adaptive": "prefixflight route --quiet-ms 0 --lone-wait-ms 10 (KV events)",
    "burst_quiet": "prefixflight route --quiet-ms 10 (the default; KV events)",
    "prefix": "prefixflight route --policy prefix (no window, KV events)",
    "round_robin": "prefixflight route --policy round_robin",
    "vllm_router_cache_aware": "vllm-router --policy cache_aware",
    "vllm_router_kv_aware": "vllm-router --policy kv_aware (KV events)",
    "vllm_router_round_robin": "vllm-router --policy round_robin",
    "sglang_router_cache_aware": "sglang-router --policy cache_aware",
    "sglang_router_round_robin": "sglang-router --policy round_robin",
}
DEFAULT_ROUTERS = [
    "burst",
    "burst_adaptive",
    "burst_quiet",
    "prefix",
    "round_robin",
    "vllm_router_cache_aware",
    "vllm_router_kv_aware",
    "vllm_router_round_robin",
    "sglang_router_cache_aware",
]


# -- environments -------------------------------------------------------------------------------
def ensure_venvs(venvs: Path) -> dict[str, Path]:
    """The vLLM venv and one venv per peer router, built when missing (never this project's)."""
    vllm = venvs / "vllm"
    subprocess.run(["bash", str(ROOT / "benchmarks/vllm/setup.sh"), str(vllm)], check=True)
    out = {"vllm": vllm}
    for name, spec in PEERS.items():
        venv = venvs / name
        exe = venv / "bin" / name
        if not exe.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin/pip"), "install", "-q", spec], check=True)
        out[name] = exe
    return out


def model_dir() -> Path:
    from prefixflight.backends.torch import load_smollm2

    return load_smollm2(device="cpu").path


class Replica:
    """One vLLM server from the shared launcher: one core, KV events on (vLLM binds the
    wildcard endpoints, the routers connect), ``/reset_prefix_cache`` (dev mode), served
    as ``rep<i>`` and as the shared name the client asks for."""

    def __init__(self, i: int, venv: Path, model: Path, logs: Path) -> None:
        self.name = f"rep{i}"
        kv_port, replay_port = harness.free_port(), harness.free_port()
        self.kv = f"tcp://127.0.0.1:{kv_port}"
        self.replay = f"tcp://127.0.0.1:{replay_port}"
        self.server = vllm_launch.launch(
            model,
            venv=venv,
            cpus=str(i),
            block_size=BLOCK,
            dtype="auto",
            max_model_len=4096,
            dev_mode=True,
            kv_events={
                "publisher": "zmq",
                "endpoint": f"tcp://*:{kv_port}",
                "replay_endpoint": f"tcp://*:{replay_port}",
            },
            args=["--served-model-name", self.name, MODEL],
            log_path=logs / f"{self.name}.log",
        )
        self.url = self.server.base_url

    def metrics(self) -> dict[str, float]:
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            for key in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                if line.startswith(key + "{"):
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def reset(self) -> None:
        import httpx

        r = httpx.post(self.url + "/reset_prefix_cache", timeout=30)
        r.raise_for_status()


# -- routers ------------------------------------------------------------------------------------
def start_router(
    name: str, replicas: list[Replica], exes: dict[str, Path], model: Path, logs: Path
) -> tuple[harness.Process, str]:
    port = harness.free_port()
    urls = [r.url for r in replicas]
    env = dict(os.environ)
    if name in ("burst", "burst_adaptive", "burst_quiet", "prefix", "round_robin"):
        policy = "burst" if name.startswith("burst") else name
        argv = [sys.executable, "-m", "prefixflight.cli", "route", "--port", str(port)]
        argv += ["--policy", policy, "--tokenizer", str(model), "--engine-block-size", str(BLOCK)]
        for r in replicas:
            argv += ["--backend", r.url]
        if name != "round_robin":
            for r in replicas:
                argv += ["--kv-events", r.kv, "--kv-events-replay", r.replay]
        argv += ["--quiet-ms", "10" if name == "burst_quiet" else "0"]
        if name == "burst_adaptive":
            argv += ["--lone-wait-ms", "10"]
        env["PYTHONPATH"] = harness.pythonpath()
    elif name.startswith("vllm_router_"):
        policy = name.removeprefix("vllm_router_")
        argv = [str(exes["vllm-router"]), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warning"]
        argv += ["--prometheus-port", str(harness.free_port())]
        if policy == "kv_aware":
            for r in replicas:
                argv += ["--kv-event-source", f"{r.url}={r.kv}"]
                argv += ["--kv-event-replay-source", f"{r.url}={r.replay}"]
            argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model)]
    elif name.startswith("sglang_router_"):
        policy = name.removeprefix("sglang_router_")
        argv = [str(exes["sglang-router"]), "launch", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warn"]
        argv += ["--prometheus-port", str(harness.free_port())]
    else:
        raise SystemExit(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    proc = harness.Process(name, argv, logs / f"router-{name}.log", env)
    base = f"http://127.0.0.1:{port}"
    proc.wait_http(base + "/v1/models", 120)
    return proc, base


# -- workloads ----------------------------------------------------------------------------------
_COMMON = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their been has will would "
    "who more if no out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came "
    "right used take three "
)
WORDS = tuple(_COMMON.split())


def text_of(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text (common words are one token each here)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def grpo_steps(seed: int, steps: int, prompts: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        step = []
        for p in range(prompts):
            text = f"Problem {seed}-{s}-{p}. " + text_of(rng, rng.randint(256, 384))
            for g in range(G):
                step.append({"group": f"{s}-{p}", "prompt": text, "max_tokens": 32, "seed": g})
        out.append(step)
    return out


def mix_requests(seed: int, n: int, rate: float) -> list[tuple[float, dict[str, Any]]]:
    rng = random.Random(seed + 1)
    systems = [f"System {seed}-{k}: " + text_of(rng, 384) for k in range(4)]
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        system = systems[rng.randrange(len(systems))]
        question = f" Question {i}: " + text_of(rng, rng.randint(24, 64))
        out.append((t, {"group": None, "prompt": system + question, "max_tokens": 16, "seed": i}))
    return out


async def one(client: Any, req: dict[str, Any], t0: float) -> dict[str, Any]:
    sent = time.perf_counter()
    ttft = None
    replica = None
    cached = None
    stream = await client.completions.create(
        model=MODEL,
        prompt=req["prompt"],
        max_tokens=req["max_tokens"],
        temperature=1.0,
        seed=req["seed"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        replica = replica or chunk.model
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - sent
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else None
    return {
        "group": req["group"],
        "replica": replica,
        "ttft": ttft,
        "cached_tokens": cached,
        "sent": sent - t0,
        "done": time.perf_counter() - t0,
    }


async def _at(client: Any, at: float, req: dict[str, Any], t0: float) -> dict[str, Any]:
    """Send ``req`` ``at`` seconds after ``t0`` (an arrival of the mix)."""
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    return await one(client, req, t0)


async def reset(replicas: list[Replica], base: str) -> None:
    """Empty the replicas' prefix caches, and the router's KV index with them.

    vLLM publishes the AllBlocksCleared of a ``/reset_prefix_cache`` only with its next
    engine step, so each replica gets a one-token request of its own (shorter than a block:
    it stores nothing); then, for a router that shows its KV index
    (``prefixflight_route_kv_blocks``), the index is awaited empty. Without this, a router
    started after another one ran the same prompts read the first one's blocks as resident
    during its first GRPO step, and sent samples where nothing was cached any more."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        for r in replicas:
            r.reset()
            poke = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            (await client.post(r.url + "/v1/completions", json=poke)).raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = (await client.get(base + "/metrics")).text
            held = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("prefixflight_route_kv_blocks{")
            ]
            if not any(held):  # empty, or not a router with an index (a peer)
                break
            await asyncio.sleep(0.05)  # polling a real condition, bounded above
        else:
            raise RuntimeError(f"the router's KV index did not empty after the reset: {held}")
    await asyncio.sleep(0.5)  # a peer's own KV-event index (vllm-router's) catches up too


async def run_phases(base: str, steps: Any, mix: Any, replicas: list[Replica]) -> dict[str, Any]:
    import openai

    out: dict[str, Any] = {}
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
        await one(c, {"group": None, "prompt": "warm up", "max_tokens": 2, "seed": 0}, 0.0)
        await reset(replicas, base)
        for phase in ("grpo", "mix"):
            before = [r.metrics() for r in replicas]
            t0 = time.perf_counter()
            results: list[dict[str, Any]] = []
            if phase == "grpo":
                for step in steps:
                    results += await asyncio.gather(*(one(c, q, t0) for q in step))
            else:
                results = list(await asyncio.gather(*(_at(c, at, q, t0) for at, q in mix)))
            wall = time.perf_counter() - t0
            after = [r.metrics() for r in replicas]
            hits = sum(
                a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
                for a, b in zip(after, before, strict=True)
            )
            queries = sum(
                a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                for a, b in zip(after, before, strict=True)
            )
            out[phase] = {"wall_s": wall, "hits": hits, "queries": queries, "requests": results}
    return out


# -- summaries ----------------------------------------------------------------------------------
def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    grpo, mix = run["grpo"], run["mix"]
    groups: dict[str, set[str]] = {}
    for r in grpo["requests"]:
        groups.setdefault(r["group"], set()).add(r["replica"])
    spread = [len(v) for v in groups.values()]
    everything = grpo["requests"] + mix["requests"]

    def ttfts(rs: list[dict[str, Any]]) -> list[float]:
        return [r["ttft"] for r in rs if r["ttft"] is not None]

    def rate(*phases: dict[str, Any]) -> float:
        q = sum(p["queries"] for p in phases)
        return sum(p["hits"] for p in phases) / q if q else 0.0

    per_replica: dict[str, int] = {}
    for r in everything:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {
        "groups_colocated": sum(1 for n in spread if n == 1) / len(spread),
        "replicas_per_group": statistics.fmean(spread),
        "hit_rate": rate(grpo, mix),
        "grpo_hit_rate": rate(grpo),
        "mix_hit_rate": rate(mix),
        "ttft_p50": quantile(ttfts(everything), 0.5),
        "ttft_p95": quantile(ttfts(everything), 0.95),
        "grpo_ttft_p50": quantile(ttfts(grpo["requests"]), 0.5),
        "mix_ttft_p50": quantile(ttfts(mix["requests"]), 0.5),
        "mix_ttft_p95": quantile(ttfts(mix["requests"]), 0.95),
        "makespan_s": grpo["wall_s"] + mix["wall_s"],
        "grpo_wall_s": grpo["wall_s"],
        "mix_wall_s": mix["wall_s"],
        "requests_per_replica": dict(sorted(per_replica.items())),
        "failed": sum(1 for r in everything if r["ttft"] is None),
    }


COLUMNS: list[tuple[str, str, str]] = [
    ("co-loc", "groups_colocated", "{:.1%}"),
    ("repl/grp", "replicas_per_group", "{:.2f}"),
    ("hit", "hit_rate", "{:.1%}"),
    ("GRPO hit", "grpo_hit_rate", "{:.1%}"),
    ("mix hit", "mix_hit_rate", "{:.1%}"),
    ("TTFT p50", "ttft_p50", "{:.3f}"),
    ("TTFT p95", "ttft_p95", "{:.3f}"),
    ("GRPO p50", "grpo_ttft_p50", "{:.3f}"),
    ("mix p50", "mix_ttft_p50", "{:.3f}"),
    ("makespan", "makespan_s", "{:.2f}"),
]
"""Per router: groups fully co-located, mean replicas per group, prefix hit rate (the
replicas' own counters; overall, GRPO phase, mix phase), TTFT p50/p95 in seconds (overall,
then the p50 of each phase), makespan in seconds (both phases)."""


def median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(summary: dict[str, dict[str, Any]]) -> str:
    width = max(len(n) for n in summary)
    lines = [f"{'router':{width}}" + "".join(f"{c:>10}" for c, _, _ in COLUMNS)]
    for name, m in summary.items():
        cells = ["n/a" if m.get(k) is None else f.format(m[k]) for _, k, f in COLUMNS]
        lines.append(f"{name:{width}}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help=", ".join(ROUTERS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="GRPO steps")
    p.add_argument("--prompts", type=int, default=4, help="prompts per GRPO step (x8 samples)")
    p.add_argument("--mix-requests", type=int, default=48)
    p.add_argument("--mix-rate", type=float, default=3.0, help="mix arrivals per second")
    p.add_argument(
        "--venvs",
        type=Path,
        default=ROOT / ".venv-route",
        help="where the vLLM venv and one venv per peer router live (built when missing)",
    )
    p.add_argument("--logs", type=Path, default=ROOT / ".route-bench-logs")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--table", type=Path, default=None, metavar="JSON", help="print the table of a result"
    )
    args = p.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())["summary"]))
        return 0
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    for n in names:
        if n not in ROUTERS:
            p.error(f"unknown router {n!r}; choose from {', '.join(ROUTERS)}")
    args.logs.mkdir(parents=True, exist_ok=True)
    exes = ensure_venvs(args.venvs)
    model = model_dir()
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start side by side
        replicas = list(pool.map(lambda i: Replica(i, exes["vllm"], model, args.logs), range(2)))
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    raw: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load: list[float] = []
    try:
        for rnd in range(args.rounds):
            steps = grpo_steps(rnd, args.steps, args.prompts)
            mix = mix_requests(rnd, args.mix_requests, args.mix_rate)
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                proc, base = start_router(name, replicas, exes, model, args.logs)
                try:
                    load.append(os.getloadavg()[0])
                    result = asyncio.run(run_phases(base, steps, mix, replicas))
                finally:
                    proc.stop()
                s = summarize(result)
                runs[name].append(s)
                raw[name].append(result)
                print(
                    f"round {rnd + 1} {name}: co-located {s['groups_colocated']:.0%}, hit "
                    f"{s['hit_rate']:.1%}, TTFT p50 {s['ttft_p50']:.3f} s, makespan "
                    f"{s['makespan_s']:.1f} s, failed {s['failed']}",
                    flush=True,
                )
    finally:
        for r in replicas:
            r.server.stop()
    keys = {
        k for rs in runs.values() for r in rs for k, v in r.items() if isinstance(v, float | int)
    }
    summary: dict[str, dict[str, Any]] = {
        n: {k: median_of(rs, k) for k in sorted(keys)} for n, rs in runs.items()
    }
    print()
    print(table(summary))
    peers = [n for n in names if not n.startswith(("burst", "prefix", "round_robin"))]
    for ours in [n for n in names if n.startswith("burst")]:
        if not peers:
            break
        best_hit = max(peers, key=lambda n: summary[n]["hit_rate"] or 0)
        best_ttft = min(peers, key=lambda n: summary[n]["ttft_p50"] or float("inf"))
        o = summary[ours]
        print(
            f"{ours}: hit rate {100 * (o['hit_rate'] - summary[best_hit]['hit_rate']):+.1f} "
            f"points vs the best peer ({best_hit}); TTFT p50 x"
            f"{o['ttft_p50'] / summary[best_ttft]['ttft_p50']:.2f} the best peer's ({best_ttft})"
        )
    if args.json is not None:
        doc = {
            "command": harness.command(sys.argv[1:] if argv is None else argv),
            "settings": {
                "replicas": 2,
                "vllm": f"vllm-cpu {VLLM_VERSION}, SmolLM2-135M-Instruct, one core each, "
                f"--enforce-eager, --block-size {BLOCK}",
                "peers": PEERS,
                "routers": {n: ROUTERS[n] for n in names},
                "rounds": args.rounds,
                "grpo": f"{args.steps} steps x {args.prompts} prompts (256-384 tokens) x G={G}, "
                "32 output tokens",
                "mix": f"{args.mix_requests} requests: 4 system prompts of 384 tokens + a "
                f"24-64-token question, Poisson {args.mix_rate}/s, 16 output tokens",
                "load_average_1min": load,
            },
            "summary": summary,
            "rounds": runs,
        }
        harness.write_json(args.json, doc, indent=1)
        (args.logs / "raw.json").write_text(json.dumps(raw) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
