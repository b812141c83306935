"""Run in the peers environment: replay the scheduler machine's minimal example of vLLM's
priority-preemption finding through the machine's own checks (and the same sequence under
FCFS as the control), then run its standalone reproduction; prints one JSON object.

    python vllm_findings.py
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import attrs

from prefixflight.specs import SchedulerConformance, SchedulerLimits
from prefixflight.specs._adapter import chunk_tokens
from prefixflight.specs.adapters import VLLMSchedulerAdapter

REPRO = Path(__file__).parents[2] / "benchmarks/peers/repro/vllm_priority_preempt_uncomputed.py"


def replay(policy: str) -> str | None:
    """The shrunk example: a.a.a+1a at priority 1 runs a step; the same prompt arrives at
    priority 0; two steps. Returns the machine's failure, or None."""
    sem = attrs.evolve(VLLMSchedulerAdapter.semantics, policies={policy}, chunking="any")
    factory = functools.partial(VLLMSchedulerAdapter, long_prefill_token_threshold=4)
    machine = SchedulerConformance.for_adapter(factory, semantics=sem)()
    machine._begin(
        SchedulerLimits(block_size=4, pages=5, max_running=2, max_batch_tokens=6, policy=policy)
    )
    prompt = [*chunk_tokens(0, 4) * 3, chunk_tokens(0, 4)[0]]
    try:
        machine._add(prompt, 1, False, 1)
        machine._schedule()
        machine._complete()
        machine.check_pages()
        machine._add(prompt, 1, False, 0)
        for _ in range(3):
            machine._schedule()
            machine.check_pages()
            if machine.rows is not None:
                machine._complete()
                machine.check_pages()
        machine.drain(0)
    except AssertionError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    repro = subprocess.run([sys.executable, str(REPRO)], capture_output=True, text=True)
    found = {
        "priority": replay("priority"),
        "fcfs": replay("fcfs"),
        "repro": {"returncode": repro.returncode, "stdout": repro.stdout},
    }
    sys.stdout.write(json.dumps(found) + "\n")
