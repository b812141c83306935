"""Run every shipped state machine with fresh random seeds for a fixed time budget.

CI's pytest run is derandomised (the same examples every run, so it never flakes); this
second step explores new ground on every run. Each machine gets an equal share of the budget
and runs batches of examples, each batch under a new random seed, printed before it starts.
A failure prints the machine, the seed and the command that replays it, and Hypothesis
prints the reproducing blob (``print_blob``); the explain phase is off so a failure reports
at once. Exit status 1 if any machine failed.

    python tests/specs/fresh_seeds.py [--budget 75] [--machine NAME] [--seed N]
        [--examples 25] [--steps 50]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
import traceback
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from prefixflight.specs import (
    BurstRouterConformance,
    CacheConformance,
    FlightCoordinatorMachine,
    KVIndexConformance,
    LRUConformance,
    LRUCurveConformance,
    PrefixEngineConformance,
    S3FIFOConformance,
    SchedulerConformance,
    SchedulerMachine,
)

MACHINES: dict[str, type[RuleBasedStateMachine]] = {
    "s3fifo": S3FIFOConformance,
    "lru": LRUConformance,
    "cache": CacheConformance,
    "engine": PrefixEngineConformance,
    "curve": LRUCurveConformance,
    "flight": FlightCoordinatorMachine,
    "scheduler": SchedulerMachine,
    "sched-conformance": SchedulerConformance,
    "router": BurstRouterConformance,
    "index": KVIndexConformance,
}


def run_batch(
    machine: type[RuleBasedStateMachine], batch_seed: int, examples: int, steps: int
) -> None:
    """One batch of ``examples`` examples under ``batch_seed``; raises on a failure."""
    seeded = seed(batch_seed)(type(machine.__name__, (machine,), {}))
    run_state_machine_as_test(
        seeded,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=False,
            print_blob=True,
            report_multiple_bugs=False,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
        ),
    )


def main(argv: list[str] | None = None, *, clock: Callable[[], float] = time.monotonic) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--budget", type=float, default=75.0, help="seconds for all machines")
    p.add_argument("--machine", choices=sorted(MACHINES), action="append", help="repeatable")
    p.add_argument("--seed", type=int, help="run one batch under this seed (replay)")
    p.add_argument("--examples", type=int, default=25, help="examples per batch")
    p.add_argument("--steps", type=int, default=50, help="steps per example at most")
    args = p.parse_args(argv)
    names = args.machine or list(MACHINES)
    share = args.budget / len(names)
    failed: list[str] = []
    for name in names:
        machine = MACHINES[name]
        end = clock() + share
        batches = 0
        while True:
            batch_seed = args.seed if args.seed is not None else secrets.randbits(64)
            print(f"{name}: batch {batches + 1}, seed {batch_seed}", flush=True)
            try:
                run_batch(machine, batch_seed, args.examples, args.steps)
            except Exception as exc:
                traceback.print_exc(file=sys.stdout)
                if sys.version_info < (3, 11):  # older tracebacks do not print notes
                    for line in getattr(exc, "__notes__", ()):
                        print(line)
                replay = (
                    f"python tests/specs/fresh_seeds.py --machine {name} --seed {batch_seed} "
                    f"--examples {args.examples} --steps {args.steps}"
                )
                print(f"FAILED {name} under seed {batch_seed}; replay: {replay}", flush=True)
                failed.append(name)
                break
            batches += 1
            if args.seed is not None or clock() >= end:
                break
        print(f"{name}: {batches} batches of {args.examples} examples passed", flush=True)
    if failed:
        print(f"fresh seeds: FAILED {', '.join(failed)}", flush=True)
        return 1
    print(f"fresh seeds: every machine passed ({', '.join(names)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
