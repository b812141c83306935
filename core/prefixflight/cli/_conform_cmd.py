"""``prefixflight conform ENGINE``: fuzz an engine's cache against prefixflight's spec.

Runs the conformance machines of ``prefixflight.specs`` over the engine's declared adapter
(``prefixflight.specs.adapters``): its prefix cache under `PrefixEngineConformance`, its
eviction policies under the policy machines, its scheduler under `SchedulerConformance`
(``--check`` picks some of them). Exit status 0 when the engine matches the spec
up to its declared differences, 1 when an undeclared difference is found (printed with its
shrunk example), 2 for usage errors (an unknown engine, a bad ``--impl``, an engine that
cannot be imported here). vLLM, SGLang and libCacheSim are imported only when their check
runs, in the environment ``benchmarks/peers/setup.sh`` builds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from prefixflight.core import UsageError

from ._args import at_least, output_file
from ._extras import missing_extra
from ._io import write_atomic, write_stdout

__all__ = ["format_report", "register", "run"]

_ENGINES = ("vllm", "sglang", "libcachesim", "prefixflight")
_CHECKS = ("engine", "lru", "s3fifo", "scheduler")  # pinned against specs' CHECKS by a test


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "conform",
        help="fuzz an engine's prefix cache or scheduler (vLLM, SGLang, libCacheSim, ours) "
        "against the spec",
        description=(
            "Drive ENGINE's own cache calls with requests sharing prefixes (or its eviction "
            "policy with block streams, or its scheduler as a model runner would), check it "
            "against prefixflight's spec after every step, and report every difference its "
            "adapter does not declare, shrunk to a minimal example. Exit 0: matches up to its "
            "declared differences; 1: an undeclared difference; 2: usage error."
        ),
    )
    p.add_argument("engine", choices=_ENGINES, metavar="ENGINE", help=", ".join(_ENGINES))
    p.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        help="a drop-in replacement for the engine's class (a subclass, built with the "
        "original's arguments), to fuzz a fork; MODULE is imported from the current directory",
    )
    p.add_argument(
        "--check",
        choices=_CHECKS,
        action="append",
        metavar="NAME",
        help=f"run only this check of the engine ({', '.join(_CHECKS)}; repeatable; "
        "default: all of them)",
    )
    p.add_argument(
        "--examples", type=at_least(1), default=100, metavar="N", help="examples per check"
    )
    p.add_argument("--steps", type=at_least(1), default=50, metavar="N", help="steps per example")
    p.add_argument(
        "--seed", type=at_least(0), metavar="S", help="Hypothesis seed (default: a fresh one)"
    )
    p.add_argument("--json", type=output_file, metavar="FILE", help="also write the report here")
    p.set_defaults(func=run, parser=p)


def format_report(report: dict[str, Any], replay: str) -> str:
    """The report as text: one block per check."""
    lines: list[str] = []
    for c in report["checks"]:
        head = f"{report['engine']} {c['name']}: {c['machine']} over {c['adapter']} ({c['impl']})"
        if c["passed"]:
            lines.append(
                f"{head}: passed {c['examples']} examples of up to {c['steps']} steps "
                f"(seed {c['seed']}, {c['seconds']:.1f} s)"
            )
        else:
            lines.append(f"{head}: UNDECLARED DIFFERENCE (seed {c['seed']})")
            lines.append(f"  {c['message']}")
            lines.append("  minimal example:")
            lines += [f"    {step}" for step in c["example"]]
            lines.append(f"  replay: {replay} --seed {c['seed']}")
        lines.append(f"  rules: {', '.join(c['rules'])}")
        if c["declared"]:
            lines.append("  declared differences:")
            for d in c["declared"]:
                lines.append(
                    f"    {d['name']}={d['value']} (default {d['default']}): {d['meaning']}"
                )
        else:
            lines.append("  declared differences: none")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if os.getcwd() not in sys.path:  # --impl names a module of the user's
        sys.path.insert(0, os.getcwd())
    try:
        from prefixflight.specs import _conform
    except ImportError as exc:
        parser.error(str(missing_extra("`prefixflight conform`", "specs", exc)))
    try:
        impl = _conform.load_class(args.impl) if args.impl else None
        report = _conform.conform(
            args.engine,
            impl=impl,
            examples=args.examples,
            steps=args.steps,
            seed=args.seed,
            checks=args.check,
            log=lambda s: print(f"conform: {s}", file=sys.stderr, flush=True),
        )
    except UsageError as exc:
        parser.error(str(exc))
    doc = report.to_json()
    replay = f"prefixflight conform {args.engine} --examples {args.examples} --steps {args.steps}"
    replay += "".join(f" --check {c}" for c in args.check or ())
    if args.impl:
        replay += f" --impl {args.impl}"
    write_stdout(format_report(doc, replay))
    if args.json:
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    return 0 if report.passed else 1
