"""``prefixflight conform ENGINE | --adapter MODULE:CLASS``: fuzz an engine's cache (or
your own adapter) against prefixflight's spec.

Runs the conformance machines of ``prefixflight.specs`` over the engine's declared adapter
(``prefixflight.specs.adapters``, or one an installed package registers in the entry-point
group ``prefixflight.adapters``): its prefix cache under `PrefixEngineConformance`, its
eviction policies under the policy machines, its scheduler under `SchedulerConformance`
(``--check`` picks some of them). ``--adapter`` runs any class or factory under the machine
its declaration names. Exit status 0 when it matches the spec up to its declared
differences, 1 when an undeclared difference is found (printed with its shrunk example), 2
for usage errors (an unknown engine, a bad ``--impl`` or ``--adapter``, a declaration that
promises calls the class lacks, an engine that cannot be imported here). vLLM, SGLang and
libCacheSim are imported only when their check runs, in the environment
``benchmarks/peers/setup.sh`` builds. The engines and checks are
``prefixflight.specs._registry``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from prefixflight.core import UsageError
from prefixflight.core._extras import missing_extra

from ._args import at_least, output_file
from ._io import write_atomic, write_stdout

__all__ = ["format_report", "register", "run"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from prefixflight.specs._registry import CHECKS, ENGINES  # the registry (no Hypothesis)

    engines = ", ".join(ENGINES)
    p = sub.add_parser(
        "conform",
        help="fuzz an engine's prefix cache, eviction policy or scheduler (vLLM, SGLang, "
        "libCacheSim, ours, or your own adapter) against the spec",
        description=(
            "Drive ENGINE's own cache calls (or your --adapter's) with requests sharing "
            "prefixes (or its eviction policy with block streams, its scheduler as a model "
            "runner would, its KV-event index with an engine's events), check it against "
            "prefixflight's spec after every step, and report every difference its adapter "
            "does not declare, shrunk to a minimal example. Exit 0: matches up to its "
            "declared differences; 1: an undeclared difference; 2: usage error."
        ),
    )
    p.add_argument(
        "engine",
        nargs="?",
        metavar="ENGINE",
        help=f"{engines}, or an engine an installed package registers (entry-point group "
        "prefixflight.adapters)",
    )
    p.add_argument(
        "--adapter",
        metavar="MODULE:CLASS",
        help="instead of ENGINE: your own adapter (any class or factory with a `semantics` "
        "declaration), run under the machine its declaration names (or --check's); MODULE is "
        "imported from the current directory",
    )
    p.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        help="a drop-in replacement for the engine's class (a subclass, built with the "
        "original's arguments), to fuzz a fork; MODULE is imported from the current directory",
    )
    p.add_argument(
        "--check",
        choices=CHECKS,
        action="append",
        metavar="NAME",
        help=f"run only this check of the engine ({', '.join(CHECKS)}; repeatable; "
        "default: all of them); with --adapter, the machine to run it under when its "
        "declaration names none",
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
    if os.getcwd() not in sys.path:  # --impl and --adapter name a module of the user's
        sys.path.insert(0, os.getcwd())
    if (args.engine is None) == (args.adapter is None):
        parser.error("name an ENGINE or an --adapter MODULE:CLASS (one of them)")
    try:
        from prefixflight.specs import _conform
    except ImportError as exc:
        parser.error(str(missing_extra("`prefixflight conform`", "specs", exc)))
    try:
        impl = _conform.load_class(args.impl) if args.impl else None
        report = _conform.conform(
            args.engine,
            adapter=args.adapter,
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
    what = args.engine or f"--adapter {args.adapter}"
    replay = f"prefixflight conform {what} --examples {args.examples} --steps {args.steps}"
    replay += "".join(f" --check {c}" for c in args.check or ())
    if args.impl:
        replay += f" --impl {args.impl}"
    write_stdout(format_report(doc, replay))
    if args.json:
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    return 0 if report.passed else 1
