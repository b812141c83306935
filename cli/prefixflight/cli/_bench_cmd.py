"""``prefixflight bench ttft`` (the TTFT experiments of the single-flight prefill study of
mini-vllm-rs) and ``bench calibrate`` (the
simulator's cost model), on a real model (torch extra).

The torch backend is imported inside the command, so the rest of the CLI never needs torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from prefixflight.core._extras import missing_extra

from ._args import Option, add_options, at_least, output_file
from ._bench_plan import EXPERIMENTS
from ._io import write_atomic, write_stdout
from ._progress import progress

__all__ = [
    "add_dtype_argument",
    "backend",
    "emit",
    "measure_ttft",
    "prepare_torch_process",
    "register",
    "run_calibrate",
    "run_ttft",
]


def _sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {value!r}")
    return sizes


def _experiments(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid experiment {(bad or [value])[0]!r} (choose from {', '.join(EXPERIMENTS)})"
        )
    return names


def add_dtype_argument(p: argparse._ActionsContainer) -> None:
    """``--dtype`` (``bench``, ``demo``, ``serve``); the default is the backend's
    ``resolve_dtype``, which this help describes."""
    p.add_argument(
        "--dtype",
        default=None,
        help="bfloat16, float32 or float16 (default: bfloat16 on CUDA and on CPUs with native "
        "bf16, AVX512-BF16 or AMX; float32 on other CPUs)",
    )


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``bench ttft`` and ``demo``."""
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_dtype_argument(p)
    p.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's choice, the core count)",
    )
    p.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the report as JSON here"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


# fmt: off
_TTFT: tuple[Option, ...] = (  # (flag, type, default, metavar, help)
    ("--repetitions", at_least(1), 3, "N", "repetitions of every run; the tables show medians"),
    ("--output-tokens", at_least(1), 128, "N", "tokens every request generates"),
    ("--experiments", _experiments, ",".join(EXPERIMENTS), "LIST",
     "comma-separated subset of " + ", ".join(EXPERIMENTS)),
    ("--concurrency", _sizes, "2,4,8", "LIST",
     "request counts for the incremental-publication and single-flight experiments"),
    ("--max-batch-tokens", at_least(1), 1024, "N", "the scheduler's token budget per step"),
)
_CALIBRATE: tuple[Option, ...] = (
    ("--repetitions", at_least(1), 5, "N", "interleaved repetitions of every measurement"),
    ("--prefill-lengths", _sizes, "16,64,128,256,384,500", "LIST",
     "cold prefill lengths; the largest is the full prompt"),
    ("--decode-batches", _sizes, "1,2,4,8", "LIST", "decode batch sizes"),
)
# fmt: on


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure on a real model (needs the torch extra)",
        description="Benchmarks on a real model with the torch backend.",
    )
    which = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = which.add_parser(
        "ttft",
        help="the single-flight study's TTFT experiments on SmolLM2-135M",
        description=(
            "Run the four experiments of the single-flight prefill study of mini-vllm-rs "
            "(warm prefix, incremental publication, single flight, late arrival) with "
            "prefixflight's engine on SmolLM2-135M-Instruct, interleaving strategies, and "
            "print medians over repetitions."
        ),
    )
    add_options(p, _TTFT)
    add_model_options(p)
    p.set_defaults(func=run_ttft, parser=p)
    c = which.add_parser(
        "calibrate",
        help="fit the simulator's cost model to measured step times",
        description=(
            "Time hand-made steps with prefixflight's runner on SmolLM2-135M-Instruct (cold "
            "prefills of several lengths, a short suffix over reused pages, decode steps at "
            "several batch sizes), interleaved and repeated, and fit `simulate flight`'s cost "
            "model: step = overhead + prefill_per_token * prompt tokens + decode_per_request "
            "* decodes. Prints the fit, measured vs predicted times, and the flags that "
            "reproduce it in `prefixflight simulate flight`."
        ),
    )
    add_options(c, _CALIBRATE)
    c.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_dtype_argument(c)
    c.add_argument("--threads", type=at_least(1), default=2, metavar="N", help="torch CPU threads")
    c.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the report as JSON here"
    )
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=run_calibrate, parser=c)


def prepare_torch_process() -> None:
    """Process settings for a command that runs torch; call before torch is imported.

    ``OMP_WAIT_POLICY=PASSIVE`` (unless the user set a policy): OpenMP reads it once, when
    torch loads. With the default spinning policy any other busy process on a small machine
    turns a 0.7 s prefill into 8-14 s; the passive policy protects them, at a cost on a quiet
    machine (a 2-thread forward up to 2x slower: docs/torch.md), so ``prefixflight serve``
    does not call this. The library never changes the environment; this entry point does,
    for its own process.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def backend() -> ModuleType:
    """The torch backend's benchmark module; `UsageError` if the torch extra is missing.

    Prepares the process for torch first (`prepare_torch_process`), so call it before
    anything else imports torch.
    """
    prepare_torch_process()
    try:
        import prefixflight.backends.torch  # noqa: F401  (a clear error if the extra is missing)
        from prefixflight.cli import _bench
    except ImportError as exc:
        raise missing_extra("this command", "torch", exc) from None
    return _bench


def measure_ttft(
    args: argparse.Namespace,
    config: Any,
    *,
    label: str,
    before: Callable[[Any, Any], None] | None = None,
) -> dict[str, Any]:
    """Load the model, run every planned run with a progress bar, return the summary."""
    bench = backend()
    from prefixflight.backends.torch import TransformersRunner, load_smollm2

    if args.threads is not None:
        bench.set_threads(args.threads)
    started = time.perf_counter()
    loaded = load_smollm2(device=None if args.device == "auto" else args.device, dtype=args.dtype)
    runner = TransformersRunner.for_model(
        loaded.model,
        num_pages=config.num_pages,
        block_size=config.block_size,
        device=loaded.model.device,
        dtype=loaded.model.dtype,
    )
    if not args.quiet and sys.stderr is not None:
        print(
            f"{label}: {loaded.name} loaded in {time.perf_counter() - started:.1f} s, with a "
            f"KV cache of {runner.pool.num_pages} pages of {runner.pool.block_size} tokens",
            file=sys.stderr,
        )
    if before is not None:
        before(runner, loaded.tokenizer)
    bench.warm_up(runner, loaded.tokenizer, config)
    runs = bench.plan_runs(config)
    # no bar off a terminal: log lines (none if stderr is closed)
    log = not args.quiet and sys.stderr is not None and not sys.stderr.isatty()
    results = []
    for i, run in enumerate(
        progress(runs, desc=label, unit="run", total=len(runs), quiet=args.quiet), 1
    ):
        results.append((run, bench.run_one(run, runner, loaded.tokenizer, config)))
        if log:
            print(
                f"{label}: run {i}/{len(runs)} {run.experiment} {run.policy} "
                f"n={run.concurrency} rep={run.repetition} done at "
                f"{time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    device, dtype, threads = bench.describe_device(runner)
    report: dict[str, Any] = bench.summarize(
        results, config, model=loaded.name, device=device, dtype=dtype, threads=threads
    )
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    return report


def emit(report: dict[str, Any], args: argparse.Namespace) -> None:
    write_stdout(backend().format_tables(report) + "\n")
    if args.json:
        import json

        write_atomic(args.json, json.dumps(report, indent=2) + "\n")


def run_ttft(args: argparse.Namespace) -> int:
    config = backend().TTFTBenchConfig(
        repetitions=args.repetitions,
        output_tokens=args.output_tokens,
        experiments=args.experiments,
        incremental_followers=args.concurrency,
        flight_concurrency=args.concurrency,
        max_batch_tokens=args.max_batch_tokens,
    )
    emit(measure_ttft(args, config, label="bench ttft"), args)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    bench = backend()  # sets OMP_WAIT_POLICY before torch loads
    from prefixflight.backends.torch import TransformersRunner, load_smollm2
    from prefixflight.cli import _calibrate as cal

    config = cal.CalibrationConfig(
        prefill_lengths=args.prefill_lengths,
        decode_batches=args.decode_batches,
        repetitions=args.repetitions,
    )
    bench.set_threads(args.threads)
    started = time.perf_counter()
    loaded = load_smollm2(device=None if args.device == "auto" else args.device, dtype=args.dtype)
    runner = TransformersRunner.for_model(
        loaded.model,
        num_pages=cal.num_pages(config),
        block_size=config.block_size,
        device=loaded.model.device,
        dtype=loaded.model.dtype,
        deduplicate=False,
    )
    report: dict[str, Any] = {"model": loaded.name, **cal.describe(runner)}
    report.update(
        cal.calibrate(
            runner,
            loaded.tokenizer,
            config,
            progress=lambda it: progress(
                it,
                desc="bench calibrate",
                unit="rep",
                total=config.repetitions,
                quiet=args.quiet,
            ),
        )
    )
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_stdout(cal.format_report(report) + "\n")
    if args.json:
        import json

        write_atomic(args.json, json.dumps(report, indent=2) + "\n")
    return 0
