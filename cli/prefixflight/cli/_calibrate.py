"""Measure step times with `TransformersRunner` and fit the simulator's `CostModel`.

Every case is one hand-made `StepPlan` executed by the runner, exactly as the engine would:

- ``prefill N``: a cold prefill of N prompt tokens (several N, the largest the full prompt);
- ``suffix N over C``: N prompt tokens continuing from C tokens of KV in reused pages;
- ``decode xB``: one decode step for B requests, each over ``context`` tokens in pages.

Cases are interleaved within each repetition (the order rotates between repetitions) and
each is summarised by its median, because a small shared machine makes single timings
unreliable. `CostModel.fit` then fits ``step_overhead``, ``prefill_per_token`` and
``decode_per_request`` to the cold prefills and the decodes together; the suffix is left out
of the fit (the cost model has no term for attention over cached context) and shown against
the model's prediction.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from prefixflight.backends.torch import TransformersRunner
from prefixflight.core import (
    ConfigError,
    DecodeWork,
    PrefillWork,
    StepPlan,
)
from prefixflight.sim import (
    CostModel,
)

from ._bench import document_tokens

__all__ = ["CalibrationConfig", "calibrate", "describe", "format_report", "num_pages"]

Progress = Callable[[Iterable[Any]], Iterable[Any]]


@attrs.frozen(kw_only=True)
class CalibrationConfig:
    """The cases to measure and how often."""

    prefill_lengths: tuple[int, ...] = (16, 64, 128, 256, 384, 500)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    context: int = 496
    reused: int = 480
    suffix: int = 20
    repetitions: int = 5
    block_size: int = 16

    def __attrs_post_init__(self) -> None:
        for name in ("prefill_lengths", "decode_batches"):
            values = getattr(self, name)
            if len(set(values)) < 2 or min(values) < 1:
                raise ConfigError(f"{name} needs at least two distinct values >= 1, got {values}")
        if self.repetitions < 1:
            raise ConfigError(f"repetitions must be >= 1, got {self.repetitions}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not (0 < self.reused <= self.context and self.reused % self.block_size == 0):
            raise ConfigError(
                f"reused must be a multiple of block_size in (0, context], got {self.reused}"
            )
        if not 1 <= self.suffix <= self.context - self.reused + self.block_size:
            raise ConfigError(f"suffix must be >= 1 and end near the context, got {self.suffix}")
        if self.context < self.block_size:
            raise ConfigError(f"context must be >= block_size, got {self.context}")


@attrs.frozen
class _Case:
    name: str
    prefill_tokens: int  # tokens computed
    decodes: int
    context: int  # cached tokens attended to per row
    plan: StepPlan
    fitted: bool


def _pages(first: int, tokens: int, block_size: int) -> tuple[int, ...]:
    return tuple(range(first, first + -(-tokens // block_size)))


def num_pages(config: CalibrationConfig) -> int:
    """Pages the runner's pool needs for `calibrate`."""
    ps = config.block_size
    span = -(-max(max(config.prefill_lengths), config.context + config.suffix) // ps)
    return 3 * span + max(config.decode_batches)


def _cases(config: CalibrationConfig, tokens: list[int]) -> tuple[StepPlan, list[_Case]]:
    """A setup plan writing the shared context, and the measured cases.

    Pages: ``[0, P)`` take the cold prefills, ``[P, 2P)`` hold the shared context (and the
    suffix's own pages after it), and each decoding request writes its new token into a
    private page after those.
    """
    ps = config.block_size
    ctx = config.context
    span = -(-max(max(config.prefill_lengths), ctx + config.suffix) // ps)
    ctx_pages = _pages(span, ctx, ps)
    setup = StepPlan(
        step=0,
        prefills=(
            PrefillWork(
                request_id="context",
                token_ids=tuple(tokens[:ctx]),
                start=0,
                pages=ctx_pages,
                sample=False,
            ),
        ),
        decodes=(),
    )
    cases = []
    for n in config.prefill_lengths:
        work = PrefillWork(
            request_id="p",
            token_ids=tuple(tokens[:n]),
            start=0,
            pages=_pages(0, n, ps),
            sample=True,
        )
        cases.append(
            _Case(f"prefill {n}", n, 0, 0, StepPlan(step=1, prefills=(work,), decodes=()), True)
        )
    start, n = config.reused, config.suffix
    own = _pages(2 * span, start + n - start // ps * ps, ps)  # the suffix's own pages
    work = PrefillWork(
        request_id="s",
        token_ids=tuple(tokens[start : start + n]),
        start=start,
        pages=ctx_pages[: start // ps] + own,
        sample=True,
    )
    cases.append(
        _Case(
            f"suffix {n} over {start}",
            n,
            0,
            start,
            StepPlan(step=1, prefills=(work,), decodes=()),
            False,
        )
    )
    full = ctx // ps  # decodes read whole context pages and write into a private page
    position = full * ps
    private = 2 * span + len(own)
    for b in config.decode_batches:
        decodes = tuple(
            DecodeWork(
                request_id=i,
                token_id=tokens[(position + i) % len(tokens)],
                position=position,
                pages=(*ctx_pages[:full], private + i),
            )
            for i in range(b)
        )
        cases.append(
            _Case(
                f"decode x{b}", 0, b, position, StepPlan(step=1, prefills=(), decodes=decodes), True
            )
        )
    return setup, cases


def calibrate(
    runner: TransformersRunner,
    tokenizer: Any,
    config: CalibrationConfig = CalibrationConfig(),
    *,
    progress: Progress = lambda it: it,
) -> dict[str, Any]:
    """Measure every case ``config.repetitions`` times (interleaved) and fit `CostModel`.

    The runner should not deduplicate (decode rows here differ anyway). Returns the report:
    per-case samples and medians, the joint fit, the separate prefill-only and decode-only
    line fits, the fit's predictions, and the load average before and after.
    """
    load_before = os.getloadavg()
    cpu_before = _cpu_seconds()
    need = max(max(config.prefill_lengths), config.context + config.suffix)
    tokens = document_tokens(tokenizer, need, salt=3)
    setup, cases = _cases(config, tokens)
    if runner.pool.num_pages < num_pages(config):
        raise ConfigError(
            f"the runner's pool has {runner.pool.num_pages} pages, "
            f"calibration needs {num_pages(config)}"
        )
    runner.execute(setup)
    for case in cases:  # warm-up: lazy initialisation is not measured
        runner.execute(case.plan)
    samples: dict[str, list[float]] = {c.name: [] for c in cases}
    for rep in progress(range(config.repetitions)):
        shift = rep % len(cases)
        for case in cases[shift:] + cases[:shift]:
            t0 = time.perf_counter()
            runner.execute(case.plan)
            samples[case.name].append(time.perf_counter() - t0)
    cpu_after = _cpu_seconds()
    medians = {name: statistics.median(s) for name, s in samples.items()}
    fitted = [c for c in cases if c.fitted]
    cost = CostModel.fit((c.prefill_tokens, c.decodes, medians[c.name]) for c in fitted)
    prefill_only = _line([(c.prefill_tokens, medians[c.name]) for c in fitted if c.decodes == 0])
    decode_only = _line([(c.decodes, medians[c.name]) for c in fitted if c.decodes])
    full = max(config.prefill_lengths)
    rows = [
        {
            "case": c.name,
            "prefill_tokens": c.prefill_tokens,
            "decodes": c.decodes,
            "cached_context": c.context,
            "fitted": c.fitted,
            "median": medians[c.name],
            "min": min(samples[c.name]),
            "predicted": cost.time(c.prefill_tokens, c.decodes),
            "samples": samples[c.name],
        }
        for c in cases
    ]
    return {
        "model_parameters": attrs.asdict(cost),  # step_overhead, prefill/decode costs
        "calibration": {  # CostModel.calibrated(...) / `simulate flight` flags giving the fit
            "prefill_seconds": cost.time(full, 0),
            "prefill_tokens": full,
            "decode_batch1": cost.time(0, 1),
            "decode_batch8": cost.time(0, 8),
        },
        "separate_fits": {
            "prefill": {"intercept": prefill_only[0], "per_token": prefill_only[1]},
            "decode": {"intercept": decode_only[0], "per_request": decode_only[1]},
        },
        "cases": rows,
        "repetitions": config.repetitions,
        "block_size": config.block_size,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "other_processes_cores": _others(cpu_before, cpu_after),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
    }


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall, this process's CPU seconds, the whole machine's busy CPU seconds) on Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle, iowait
    t = os.times()
    return time.perf_counter(), t.user + t.system, busy / os.sysconf("SC_CLK_TCK")


def _others(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> float | None:
    """Cores used on average by other processes while the cases ran (None off Linux)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    other = (after[2] - before[2]) - (after[1] - before[1])
    return max(other, 0.0) / (after[0] - before[0])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Ordinary least squares ``y = a + b x`` (for the report only)."""
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def format_report(report: dict[str, Any]) -> str:
    """The fitted parameters, the measured-vs-predicted table, and the `simulate` flags."""
    p = report["model_parameters"]
    cal = report["calibration"]
    sep = report["separate_fits"]
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}, "
        f"{report['threads']} threads), median of {report['repetitions']} repetitions; "
        "load average before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}".format(
            *report["load_average_before"], *report["load_average_after"]
        ),
        f"cpu {report['cpu']}, {report['cores']} cores; other processes used "
        + (
            "unknown"
            if report["other_processes_cores"] is None
            else f"{report['other_processes_cores']:.2f} cores on average while measuring"
        ),
        "",
        f"fitted cost model: step = {p['step_overhead'] * 1e3:.2f} ms + "
        f"{p['prefill_per_token'] * 1e3:.4f} ms x prefill tokens + "
        f"{p['decode_per_request'] * 1e3:.2f} ms x decodes",
        f"  separate fits: prefill {sep['prefill']['intercept'] * 1e3:.2f} ms + "
        f"{sep['prefill']['per_token'] * 1e3:.4f} ms/token; decode "
        f"{sep['decode']['intercept'] * 1e3:.2f} ms + "
        f"{sep['decode']['per_request'] * 1e3:.2f} ms/request",
        "",
    ]
    head = ("case", "cached ctx", "median ms", "min ms", "model ms", "model error")
    body = [
        (
            r["case"] + ("" if r["fitted"] else " (not fitted)"),
            str(r["cached_context"]),
            f"{r['median'] * 1e3:.1f}",
            f"{r['min'] * 1e3:.1f}",
            f"{r['predicted'] * 1e3:.1f}",
            f"{(r['predicted'] - r['median']) / r['median'] * 100:+.1f}%",
        )
        for r in report["cases"]
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    lines += [
        "",
        "simulate with: prefixflight simulate flight "
        f"--prefill-seconds {cal['prefill_seconds']:.4f} "
        f"--prefill-tokens {cal['prefill_tokens']} "
        f"--decode-batch1 {cal['decode_batch1']:.5f} --decode-batch8 {cal['decode_batch8']:.5f}",
    ]
    return "\n".join(lines)


def describe(runner: TransformersRunner) -> dict[str, Any]:
    """device, dtype, threads of the run (for the report)."""
    return {
        "device": str(runner.pool.device),
        "dtype": str(runner.pool.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
