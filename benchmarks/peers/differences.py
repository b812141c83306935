"""Every declared difference of the shipped adapters, shown by its minimal example.

For each engine's declaration and each field that departs from prefixflight's semantics,
run the engine's machine with that field set back to the default (with the fields it must
change with) and record the undeclared difference the machine then finds, shrunk by
Hypothesis: the minimal example docs/conformance.md quotes. Run in the peers environment:

    .venv-peers/bin/python benchmarks/peers/differences.py \
        --json docs/results/conformance_differences.json

A field set back that finds nothing is reported as such (the declaration is then not needed
at that many examples). A case with nothing set back runs a configuration the shipped
adapter leaves out and records what the machine finds there (vLLM's scheduler under
priority scheduling with a long-prefill threshold: a possible bug, found in more examples).
``--case NAME`` runs only those cases, merging their rows into an existing ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

from prefixflight.specs import (
    KVIndexConformance,
    PrefixEngineConformance,
    S3FIFOConformance,
    SchedulerConformance,
    isolated,
)
from prefixflight.specs._conform import _run
from prefixflight.specs.adapters import (
    DynamoIndexAdapter,
    LibCacheSimS3FIFO,
    SGLangAdapter,
    VLLMAdapter,
    VLLMSchedulerAdapter,
    libcachesim_s3fifo_configs,
)

# engine -> (make the machine for a declaration, the declaration, the fields set back
# together: one group per difference)
CASES: dict[str, tuple[Callable[[Any], type[Any]], Any, list[dict[str, Any]]]] = {
    "vllm": (
        lambda sem: PrefixEngineConformance.for_adapter(VLLMAdapter, semantics=sem),
        VLLMAdapter.semantics,
        [
            {"hit_cap": "full"},
            {"publish": "at-finish"},
            {"touch": "in-order"},
            {"pins": "ours"},
            {"duplicates": "freed"},
            {"invalidated": "reused-first"},
        ],
    ),
    "sglang": (
        lambda sem: PrefixEngineConformance.for_adapter(SGLangAdapter, semantics=sem),
        SGLangAdapter.semantics,
        [{"hit_cap": "full"}, {"unit": "block", "pins": "ours", "ops": {"reset"}}],
    ),
    "libcachesim s3fifo": (
        lambda sem: S3FIFOConformance.for_factory(
            isolated(LibCacheSimS3FIFO), semantics=sem, configs=libcachesim_s3fifo_configs()
        ),
        LibCacheSimS3FIFO.semantics,
        [{"sizing": "round"}, {"min_small_blocks": 1}],
    ),
    # with small queues of two blocks or more (a small queue of one caches nothing new, which
    # would otherwise be the first difference found)
    "libcachesim s3fifo, small queue >= 2": (
        lambda sem: S3FIFOConformance.for_factory(
            isolated(LibCacheSimS3FIFO),
            semantics=sem,
            configs=libcachesim_s3fifo_configs().filter(
                lambda c: int(c["capacity"] * c["small_ratio"]) >= 2
            ),
        ),
        LibCacheSimS3FIFO.semantics,
        [
            {"promote_at": 1},
            {"small_queue": "bounded", "min_small_blocks": 1},
            {"main_evictions": "ghost"},
            {"on_promote": "keep"},
        ],
    ),
    "vllm scheduler": (
        lambda sem: SchedulerConformance.for_adapter(VLLMSchedulerAdapter, semantics=sem),
        VLLMSchedulerAdapter.semantics,
        [{"same_step_reads": "declared"}, {"preemption": "none"}],
    ),
    "vllm scheduler, priority, long_prefill_token_threshold=4": (
        lambda sem: SchedulerConformance.for_adapter(
            functools.partial(VLLMSchedulerAdapter, long_prefill_token_threshold=4),
            semantics=sem,
        ),
        attrs.evolve(VLLMSchedulerAdapter.semantics, policies={"priority"}, chunking="any"),
        [{}],
    ),
    "dynamo": (
        lambda sem: KVIndexConformance.for_adapter(DynamoIndexAdapter, semantics=sem),
        DynamoIndexAdapter.semantics,
        [{"order": "any"}, {"removals": "any"}, {"copies": "counted"}],
    ),
}
EXAMPLES = {"vllm scheduler, priority, long_prefill_token_threshold=4": 3000}
"""Cases that need more examples than ``--examples`` to find what they find."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the findings here")
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="repeatable")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for engine, (machine_for, declared, reverts) in CASES.items():
        if args.case and engine not in args.case:
            continue
        examples = max(args.examples, EXAMPLES.get(engine, 0))
        for revert in reverts:
            sem = attrs.evolve(declared, **revert)
            t0 = time.perf_counter()
            message, example = _run(machine_for(sem), examples, args.steps, args.seed)
            steps = [line for line in example if not line.startswith("Draw ")]
            set_back = {k: sorted(v) if isinstance(v, set) else v for k, v in revert.items()}
            rows.append(
                {
                    "engine": engine,
                    "set_back": set_back,
                    "declared": {k: getattr(declared, k) for k in revert if k != "ops"},
                    "found": message,
                    "example": steps,
                    "examples": examples,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            print(f"{engine} {set_back}: {message or 'no difference found'}", flush=True)
            for line in steps:
                if not line.startswith("state."):
                    print(f"    {line}", flush=True)
    command = "benchmarks/peers/differences.py " + " ".join(sys.argv[1:])
    if args.json and args.case and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as fh:
            old = json.load(fh)
        rows = [r for r in old["rows"] if r["engine"] not in args.case] + rows
        command = f"{old['command']}; then {command}"
    if args.json:
        doc = {
            "command": command,
            "examples": args.examples,
            "steps": args.steps,
            "seed": args.seed,
            "rows": rows,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(doc, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
