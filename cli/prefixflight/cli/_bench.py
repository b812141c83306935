"""The four TTFT experiments of the single-flight prefill study of mini-vllm-rs, measured with
our engine on a real model.

1. ``warm_prefix``: a document prompt whose first blocks an earlier request cached.
2. ``incremental_publication``: one request starts; once its first token is out, N more with
   the same prompt arrive while it decodes; publish-per-step against publish-on-completion
   (no flight coordination, so only publication timing differs).
3. ``single_flight``: N identical requests arrive together under ``independent``,
   ``on_completion`` and ``after_prefill`` (publication on completion, the study's baseline;
   flight leaders publish their prompt when its prefill ends, as the study's early release does).
4. ``late_arrival``: a second identical request arrives after the first started decoding.

Every run uses a fresh engine (empty cache, fresh scheduler) on one shared runner, so runs
never see each other's pages. Strategies are interleaved within each repetition (the order
rotates between repetitions) and each row reports the median over repetitions, because other
processes on a small machine make single timings unreliable. Times are wall-clock seconds
from the scheduler's reports (``time.perf_counter``).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from prefixflight.backends.torch import (
    AsyncEngine,
    EngineConfig,
    SamplingParams,
    TransformersRunner,
)
from prefixflight.core import ReleasePolicy, RequestReport

from ._bench_plan import BenchRun, TTFTBenchConfig, plan_runs

__all__ = ["BenchRun", "TTFTBenchConfig", "format_tables", "plan_runs", "run_one", "summarize"]

Progress = Callable[[Iterable[Any]], Iterable[Any]]

_DOC_SENTENCES = (
    "The harbour city kept its records in a long stone hall near the water.",
    "Each ledger listed ships, cargo, tolls and the names of the clerks on duty.",
    "In the dry season the river fell and the larger vessels waited outside the bar.",
    "Merchants from the inland towns brought wool, salt, timber and dyed cloth.",
    "A council of seven wardens set the tolls and heard disputes every new moon.",
    "When the great storm came, the archive was moved to the hill fort for a decade.",
    "Scholars later compared the ledgers with letters kept by the trading houses.",
    "They found that prices rose sharply whenever the northern road was closed.",
)
_QUESTIONS = (
    "Question: why did the council move the archive, and what changed afterwards? Answer:",
    "Summarise in two sentences how tolls were decided and who kept the ledgers. Summary:",
)


def document_tokens(tokenizer: Any, n: int, salt: int = 0) -> list[int]:
    """``n`` token ids of a deterministic plain-English document (``salt`` varies it)."""
    parts: list[str] = []
    ids: list[int] = []
    i = salt
    while len(ids) < n:
        parts.append(f"Entry {i}. {_DOC_SENTENCES[i % len(_DOC_SENTENCES)]}")
        i += 1
        if len(parts) % 16 == 0:
            ids = list(tokenizer(" ".join(parts))["input_ids"])
    ids = list(tokenizer(" ".join(parts))["input_ids"])
    return [int(t) for t in ids[:n]]


def _engine(runner: TransformersRunner, config: TTFTBenchConfig, **kw: Any) -> AsyncEngine:
    cfg = EngineConfig(
        num_pages=runner.pool.num_pages,
        block_size=config.block_size,
        max_batch_tokens=config.max_batch_tokens,
        max_running=config.max_running,
        **kw,
    )
    return AsyncEngine(runner, cfg)


def warm_up(runner: TransformersRunner, tokenizer: Any, config: TTFTBenchConfig) -> None:
    """One small request so lazy initialisation is not charged to the first measurement."""

    async def go() -> None:
        async with _engine(runner, config) as engine:
            await engine.generate(
                document_tokens(tokenizer, 64, 99), SamplingParams(max_tokens=4)
            ).result()

    asyncio.run(go())


def run_one(
    run: BenchRun, runner: TransformersRunner, tokenizer: Any, config: TTFTBenchConfig
) -> dict[str, Any]:
    """Execute one run; return its raw measurements (seconds, tokens)."""
    return asyncio.run(_run(run, runner, tokenizer, config))


async def _run(
    run: BenchRun, runner: TransformersRunner, tokenizer: Any, config: TTFTBenchConfig
) -> dict[str, Any]:
    out = SamplingParams(max_tokens=config.output_tokens)
    if run.experiment == "warm_prefix":
        doc = document_tokens(tokenizer, config.warm_cached_tokens)
        tail = config.warm_prompt_tokens - config.warm_cached_tokens
        q1, q2 = ([int(t) for t in tokenizer(q)["input_ids"]] for q in _QUESTIONS)
        one = SamplingParams(max_tokens=1)
        async with _engine(runner, config) as engine:
            cold = await engine.generate(doc + (q1 * tail)[:tail], one).result()
            warm = await engine.generate(doc + (q2 * tail)[:tail], one).result()
        return {
            "prompt_tokens": config.warm_prompt_tokens,
            "recovered_tokens": warm.cached_tokens,
            "cold_ttft": _ttft(cold),
            "warm_ttft": _ttft(warm),
        }
    if run.experiment == "incremental_publication":
        prompt = document_tokens(tokenizer, config.incremental_prompt_tokens, 1)
        async with _engine(
            runner,
            config,
            release_policy=ReleasePolicy.INDEPENDENT,
            incremental_publication=run.policy == "publish_per_step",
        ) as engine:
            first = engine.generate(prompt, out)
            await first.__anext__()  # the first request is decoding now
            followers = [engine.generate(prompt, out) for _ in range(run.concurrency)]
            await asyncio.gather(first.result(), *(f.result() for f in followers))
        reports = [g.report for g in (first, *followers) if g.report is not None]
        return _row(prompt, reports, first_counts=False)
    policy = ReleasePolicy(run.policy)
    tokens = (
        config.flight_prompt_tokens
        if run.experiment == "single_flight"
        else config.late_prompt_tokens
    )
    prompt = document_tokens(tokenizer, tokens, 2)
    async with _engine(
        runner, config, release_policy=policy, incremental_publication=False
    ) as engine:
        if run.experiment == "single_flight":
            gens = [engine.generate(prompt, out) for _ in range(run.concurrency)]
        else:
            gens = [engine.generate(prompt, out)]
            await gens[0].__anext__()  # decoding has started
            gens.append(engine.generate(prompt, out))
        await asyncio.gather(*(g.result() for g in gens))
    reports = [g.report for g in gens if g.report is not None]
    return _row(prompt, reports, first_counts=True)


def _ttft(report: RequestReport) -> float:
    assert report.ttft is not None
    return report.ttft


def _row(
    prompt: Sequence[int], reports: list[RequestReport], *, first_counts: bool
) -> dict[str, Any]:
    """``reports`` in arrival order; followers are everyone after the first request.
    ``mean_ttft`` covers everyone when ``first_counts``, else the followers only."""
    followers = reports[1:]
    timed = reports if first_counts else followers
    return {
        "prompt_tokens": len(prompt),
        "recovered_tokens_per_follower": statistics.mean(r.cached_tokens for r in followers),
        "mean_ttft": statistics.mean(_ttft(r) for r in timed),
        "follower_mean_ttft": statistics.mean(_ttft(r) for r in followers),
        "slowest_completion": max(r.latency for r in reports),
    }


def summarize(
    results: list[tuple[BenchRun, dict[str, Any]]],
    config: TTFTBenchConfig,
    *,
    model: str,
    device: str,
    dtype: str,
    threads: int,
) -> dict[str, Any]:
    """Medians over repetitions, in ``prefixflight simulate flight``'s JSON shape."""
    report: dict[str, Any] = {
        "model": model,
        "device": device,
        "dtype": dtype,
        "threads": threads,
        "repetitions": config.repetitions,
        "block_size": config.block_size,
        "output_tokens": config.output_tokens,
        "max_batch_tokens": config.max_batch_tokens,
    }
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for run, measured in results:
        groups.setdefault((run.experiment, run.policy, run.concurrency), []).append(measured)
    warm_runs = groups.get(("warm_prefix", "warm", 1))
    if warm_runs:
        cold_ttft = statistics.median(v["cold_ttft"] for v in warm_runs)
        warm_ttft = statistics.median(v["warm_ttft"] for v in warm_runs)
        report["warm_prefix"] = {
            "prompt_tokens": warm_runs[0]["prompt_tokens"],
            "recovered_tokens": int(statistics.median(v["recovered_tokens"] for v in warm_runs)),
            "cold_ttft": cold_ttft,
            "warm_ttft": warm_ttft,
            "ttft_reduction": 1.0 - warm_ttft / cold_ttft,
            "samples": warm_runs,
        }
    for exp in ("incremental_publication", "single_flight", "late_arrival"):
        rows: list[dict[str, Any]] = []
        for (e, policy, n), values in groups.items():
            if e != exp:
                continue
            rows.append(
                {
                    "policy": policy,
                    "concurrency": n,
                    "prompt_tokens": values[0]["prompt_tokens"],
                    "recovered_tokens_per_follower": statistics.median(
                        v["recovered_tokens_per_follower"] for v in values
                    ),
                    "mean_ttft": statistics.median(v["mean_ttft"] for v in values),
                    "slowest_completion": statistics.median(
                        v["slowest_completion"] for v in values
                    ),
                    "follower_mean_ttft": statistics.median(
                        v["follower_mean_ttft"] for v in values
                    ),
                    "samples": values,
                }
            )
        if rows:
            rows.sort(key=lambda r: (r["concurrency"], _ORDER.index(r["policy"])))
            report[exp] = rows
    return report


_ORDER = (
    "publish_on_completion",
    "publish_per_step",
    "independent",
    "on_completion",
    "after_prefill",
)


def _pct(new: float, base: float) -> str:
    change = (new - base) / base * 100.0
    return f"{'down' if change < 0 else 'up'} {abs(change):.1f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "   " + "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), *(fmt.format(*r) for r in rows)]


def format_tables(report: dict[str, Any]) -> str:
    """The report as plain-text tables (the study's layout, our numbers)."""
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}, "
        f"{report['threads']} threads), block size {report['block_size']}, "
        f"{report['output_tokens']} output tokens, "
        + ("one run" if report["repetitions"] == 1 else f"median of {report['repetitions']} runs"),
    ]
    sections = iter(range(1, 5))  # number the sections present without gaps (demo runs two)
    warm = report.get("warm_prefix")
    if warm:
        lines += [
            "",
            f"{next(sections)}. Warm document prefix",
            f"   recovered {warm['recovered_tokens']} of {warm['prompt_tokens']} prompt tokens; "
            f"TTFT {_ms(warm['cold_ttft'])} cold -> {_ms(warm['warm_ttft'])} warm "
            f"({_pct(warm['warm_ttft'], warm['cold_ttft'])})",
        ]
    inc = report.get("incremental_publication")
    if inc:
        by_n: dict[int, dict[str, Any]] = {}
        for r in inc:
            by_n.setdefault(r["concurrency"], {})[r["policy"]] = r
        inc_rows: list[tuple[str, ...]] = []
        for n, pair in sorted(by_n.items()):
            base, new = pair.get("publish_on_completion"), pair.get("publish_per_step")
            if base is None or new is None:
                continue
            inc_rows.append(
                (
                    str(n),
                    f"{base['recovered_tokens_per_follower']:.0f} / "
                    f"{new['recovered_tokens_per_follower']:.0f} of {new['prompt_tokens']}",
                    _ms(base["mean_ttft"]),
                    _ms(new["mean_ttft"]),
                    _pct(new["mean_ttft"], base["mean_ttft"]),
                )
            )
        lines += [
            "",
            f"{next(sections)}. Incremental publication "
            "(N requests arrive while the first decodes)",
        ]
        header: tuple[str, ...] = (
            "N",
            "recovered/follower",
            "mean TTFT on completion",
            "per step",
            "change",
        )
        lines += _table(header, inc_rows)
    for key, title in (
        ("single_flight", "Single flight (N identical requests arrive together)"),
        ("late_arrival", "Late arrival (a second request arrives while the first decodes)"),
    ):
        flight_rows = report.get(key)
        if not flight_rows:
            continue
        base_policy = "independent" if key == "single_flight" else "on_completion"
        bases = {r["concurrency"]: r for r in flight_rows if r["policy"] == base_policy}
        rows: list[tuple[str, ...]] = []
        for r in flight_rows:
            b = bases.get(r["concurrency"])
            rows.append(
                (
                    str(r["concurrency"]),
                    r["policy"],
                    f"{r['recovered_tokens_per_follower']:.0f}",
                    _ms(r["mean_ttft"]),
                    "baseline" if b is None or b is r else _pct(r["mean_ttft"], b["mean_ttft"]),
                    f"{r['slowest_completion']:.2f} s",
                    "baseline"
                    if b is None or b is r
                    else _pct(r["slowest_completion"], b["slowest_completion"]),
                )
            )
        header = ("N", "policy", "recovered/follower", "mean TTFT", "change", "slowest", "change")
        lines += ["", f"{next(sections)}. {title}", *_table(header, rows)]
    return "\n".join(lines)


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads for torch's intra-op parallelism."""
    torch.set_num_threads(threads)


def describe_device(runner: TransformersRunner) -> tuple[str, str, int]:
    """(device, dtype, threads) for the report."""
    dtype = str(runner.pool.dtype).removeprefix("torch.")
    return str(runner.pool.device), dtype, torch.get_num_threads()
