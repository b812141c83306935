"""``prefixflight simulate flight``: the tables of the single-flight prefill study of
mini-vllm-rs, computed by the simulated engine."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from prefixflight.core import ConfigError

from ._args import (
    Option,
    add_options,
    at_least,
    output_file,
    positive_float,
    ratio,
    usage_errors,
)
from ._io import write_atomic, write_stdout

if TYPE_CHECKING:  # the simulations are imported by `run`, not at start-up
    from prefixflight.sim import FindingsRow, FlightRow

__all__ = ["register", "run"]

SHARES: tuple[float | None, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, None, 1.0)
"""Fixed shares of the batch-1 decode step swept for the findings (None: calibrated)."""
PARTIAL_CASES = ((512, 16), (64, 448), (16, 496))
"""(shared document tokens, own tail tokens) for the partial-prefix experiment."""
OVERHEAD_BOUND_PREFILL_DIVISOR = 100


# fmt: off
_CALIBRATION: tuple[Option, ...] = (  # (flag, type, default, metavar, help)
    ("--prefill-seconds", positive_float, None, "S",
     "time of one full prefill of --prefill-tokens tokens"),
    ("--prefill-tokens", at_least(1), None, "N", "length of that prefill"),
    ("--decode-batch1", positive_float, None, "S", "a decode step at batch 1"),
    ("--decode-batch8", positive_float, None, "S", "a decode step at batch 8"),
    ("--overhead-share", ratio, None, "F",
     "replace the calibrated fixed share of the batch-1 decode step, in [0, 1]"),
)
_ENGINE: tuple[Option, ...] = (
    ("--max-batch-tokens", at_least(1), 2048, "N", "the scheduler's token budget per step"),
    ("--output-tokens", at_least(1), 128, "N", "tokens every request generates"),
    ("--late-after-tokens", at_least(1), 16, "N",
     "late arrival: the second request arrives once the first has produced N tokens "
     "(< --output-tokens)"),
)
# fmt: on


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "flight",
        help="the single-flight and incremental-publication tables, simulated",
        description=(
            "Run the experiments of the single-flight prefill study of mini-vllm-rs on the "
            "pure scheduler + coordinator + prefix cache with one cost model: step = overhead "
            "+ prefill_per_token * computed prompt tokens + decode_per_request * decodes, "
            "calibrated from measured times (by default those of `prefixflight bench "
            "calibrate` on SmolLM2-135M, fp32, 2 CPU threads; each flag given replaces one "
            "measured time). Prints markdown tables and a list of findings."
        ),
    )
    p.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write every row as JSON here"
    )
    cal = p.add_argument_group("cost model calibration (measured times; default: measured)")
    add_options(cal, _CALIBRATION)
    eng = p.add_argument_group("engine")
    add_options(eng, _ENGINE)
    eng.add_argument(
        "--no-same-step-sharing",
        dest="same_step_sharing",
        action="store_false",
        help="register a step's blocks after it runs, not when it is planned: requests "
        "admitted in one step then never read each other's pages (the engine before "
        "same-step sharing)",
    )
    p.set_defaults(func=run, parser=p)


def _pct(new: float, base: float) -> str:
    if base == 0:
        return "n/a"
    d = (new - base) / base * 100
    return f"{d:+.1f}%"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def _versus(r: FlightRow, base: FlightRow) -> list[str]:
    """Recovered tokens per follower, mean TTFT and slowest completion, each time with its
    change against ``base``."""
    return [
        f"{r.recovered_tokens_per_follower:.0f}",
        f"{r.mean_ttft:.3f}", _pct(r.mean_ttft, base.mean_ttft),
        f"{r.slowest_completion:.2f}", _pct(r.slowest_completion, base.slowest_completion),
    ]  # fmt: skip


def _by(rows: Sequence[FlightRow]) -> dict[tuple[str, int], FlightRow]:
    return {(r.policy, r.concurrency): r for r in rows}


def _incremental(rows: Sequence[FlightRow]) -> str:
    by = _by(rows)
    out = []
    for r in rows:
        base = by["publish_on_completion", r.concurrency]
        out.append([
            str(r.concurrency), r.policy,
            f"{r.recovered_tokens_per_follower:.0f} / {r.prompt_tokens}",
            f"{r.mean_ttft:.3f}", _pct(r.mean_ttft, base.mean_ttft),
            f"{r.slowest_completion:.2f}",
        ])  # fmt: skip
    head = ["followers", "policy", "recovered / prompt", "follower TTFT (s)",
            "vs on-completion", "slowest done (s)"]  # fmt: skip
    return _table(head, out)


def _single(rows: Sequence[FlightRow]) -> str:
    by = _by(rows)
    out = []
    for r in rows:
        base = by["independent", r.concurrency]
        out.append([
            str(r.concurrency), r.policy, *_versus(r, base), str(r.computed_prompt_tokens)
        ])  # fmt: skip
    head = ["requests", "policy", "recovered", "mean TTFT (s)", "vs indep.",
            "slowest done (s)", "vs indep.", "prompt computed"]  # fmt: skip
    return _table(head, out)


def _late(rows: Sequence[FlightRow]) -> str:
    base = next(r for r in rows if r.policy == "on_completion")
    out = [[r.policy, *_versus(r, base)] for r in rows]
    head = ["policy", "recovered", "mean TTFT (s)", "vs on-completion",
            "slowest done (s)", "vs on-completion"]  # fmt: skip
    return _table(head, out)


def _partial(rows: Sequence[FlightRow]) -> str:
    out = []
    for r in rows:
        mode, case = r.policy.split(":")
        base = next(b for b in rows if b.policy == f"exact_only:{case}")
        out.append([case, mode, *_versus(r, base), str(r.computed_prompt_tokens)])
    head = ["shared+tail", "mode", "recovered", "mean TTFT (s)", "vs exact",
            "slowest done (s)", "vs exact", "prompt computed"]  # fmt: skip
    return _table(head, out)


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def _findings(rows: Sequence[FindingsRow]) -> str:
    """One item per fixed share, its findings as sub-items (too long for table columns)."""
    out = []
    for f in rows:
        r = f.ratios
        out += [
            f"- fixed share {f.overhead_share:.2f}: step overhead "
            f"{f.step_overhead * 1e3:.1f} ms, decode {f.decode_per_request * 1e3:.1f} ms per "
            "request",
            "  - 2 requests, on_completion vs independent: TTFT worse "
            f"{_yes(f.on_completion_worse_ttft_at_2)} "
            f"({r['on_completion_vs_independent_ttft_at_2']:.2f}x), completion better "
            f"{_yes(f.on_completion_better_completion_at_2)} "
            f"({r['on_completion_vs_independent_completion_at_2']:.2f}x)",
            "  - late arrival, after_prefill vs on_completion: TTFT better "
            f"{_yes(f.late_early_release_better_ttft)} "
            f"({r['late_after_prefill_vs_on_completion_ttft']:.2f}x), completion worse "
            f"{_yes(f.late_early_release_worse_completion)} "
            f"({r['late_after_prefill_vs_on_completion_completion']:.2f}x)",
            "  - after_prefill has the best TTFT at 2, 4 and 8 requests: "
            f"{_yes(f.after_prefill_best_ttft)}",
        ]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    from prefixflight.sim import (
        CostModel,
        FlightSimConfig,
        simulate_findings,
        simulate_incremental_publication,
        simulate_late_arrival,
        simulate_partial_prefix,
        simulate_single_flight,
    )

    if args.late_after_tokens >= args.output_tokens:
        args.parser.error(
            f"--late-after-tokens must be < --output-tokens ({args.output_tokens}), "
            f"got {args.late_after_tokens}"
        )
    given = dict(
        prefill_seconds=args.prefill_seconds, prefill_tokens=args.prefill_tokens,
        decode_batch1=args.decode_batch1, decode_batch8=args.decode_batch8,
    )  # fmt: skip
    calibration = {k: v for k, v in given.items() if v is not None}
    try:
        cost = CostModel.calibrated(overhead_share=args.overhead_share, **calibration)
    except ConfigError as exc:
        flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in calibration.items())
        args.parser.error(f"these measured times give no valid cost model ({flags}): {exc}")
    with usage_errors(args.parser):
        sim = FlightSimConfig(
            max_batch_tokens=args.max_batch_tokens, same_step_sharing=args.same_step_sharing
        )
    out_n = args.output_tokens
    inc = simulate_incremental_publication(cost, sim, output_tokens=out_n)
    sf = simulate_single_flight(cost, sim, output_tokens=out_n)
    late = simulate_late_arrival(
        cost, sim, output_tokens=out_n, after_tokens=args.late_after_tokens
    )
    overhead_bound = CostModel(
        step_overhead=cost.step_overhead,
        prefill_per_token=cost.prefill_per_token / OVERHEAD_BOUND_PREFILL_DIVISOR,
        decode_per_request=cost.decode_per_request,
    )
    part: list[tuple[str, list[FlightRow]]] = [
        ("calibrated", simulate_partial_prefix(cost, sim, cases=PARTIAL_CASES)),
        ("overhead-bound", simulate_partial_prefix(overhead_bound, sim, cases=PARTIAL_CASES)),
    ]
    finds = simulate_findings(SHARES, sim, calibration=calibration)
    measured = CostModel.calibrated(**calibration)
    share = measured.step_overhead / (measured.step_overhead + measured.decode_per_request)
    text = [
        f"cost model: step = {cost.step_overhead * 1e3:.2f} ms + "
        f"{cost.prefill_per_token * 1e3:.4f} ms x prefill tokens + "
        f"{cost.decode_per_request * 1e3:.2f} ms x decodes;\n"
        f"block 16, max {sim.max_batch_tokens} tokens/step, {out_n} output tokens.\n"
        "TTFT: time to first token; slowest done: when the last request completes; recovered:\n"
        "prompt tokens a follower reused; prompt computed: prompt tokens prefilled in all.\n\n",
        "**Incremental publication vs publish-on-completion.** One request starts; at its "
        "first\ntoken N followers with the same prompt arrive (no single flight).\n\n",
        _incremental(inc) + "\n\n",
        "**Single flight: N identical requests arrive together.** Baseline: independent\n"
        "execution, publish on completion.\n\n",
        _single(sf) + "\n\n",
        "**Late arrival.** The second request arrives once the first has produced "
        f"{args.late_after_tokens} tokens.\n\n",
        _late(late) + "\n\n",
        "**Partial-prefix coordination.** 4 requests share a document and differ in their\n"
        "tail, arriving together, under two cost regimes. Modes: exact_only (followers wait\n"
        "only for an identical prompt) and partial (they wait for the shared prefix); vs exact:\n"
        "against exact_only for the same case.\n\n",
    ]
    if sim.same_step_sharing:
        text.append(
            "With same-step sharing the others read the document in the step that writes it,\n"
            "in both modes; --no-same-step-sharing shows what partial coordination buys\n"
            "without it.\n\n"
        )
    for regime, rows in part:
        if regime == "calibrated":
            text.append("Calibrated:\n\n")
        else:
            text.append(
                f"Overhead-bound: the same model with prefill {OVERHEAD_BOUND_PREFILL_DIVISOR}x "
                "cheaper per token (a GPU-like regime\nwhere the per-step cost dominates):\n\n"
            )
        text.append(_partial(rows) + "\n\n")
    text += [
        "**The single-flight study's subtler findings vs the decode step's fixed share.**\n"
        "Batch-1 decode and the full prefill keep their measured times; the share of the batch-1\n"
        "decode step that does not grow with the batch varies "
        f"({share:.2f} is the calibrated split).\n\n",
        _findings(finds) + "\n",
    ]
    write_stdout("".join(text))
    if args.json:
        data = {
            "cost_model": attrs.asdict(cost),  # step_overhead, prefill/decode costs
            "incremental_publication": [r.to_dict() for r in inc],
            "single_flight": [r.to_dict() for r in sf],
            "late_arrival": [r.to_dict() for r in late],
            "partial_prefix": [
                {"cost_regime": name, **r.to_dict()} for name, rows in part for r in rows
            ],
            "findings": [f.to_dict() for f in finds],
        }
        write_atomic(args.json, json.dumps(data, indent=2) + "\n")
    return 0
