"""vLLM's priority-preemption finding on a real engine: greedy fp32 output changes, and the
plugin's checked mode flags it.

Under ``--scheduling-policy priority`` with a long-prefill threshold, a request preempted in
the ``schedule()`` call that has just scheduled it leaves the block it registered for that
step in the prefix cache, though no step computes that block's last positions
(benchmarks/peers/repro/vllm_priority_preempt_uncomputed.py shows it on the scheduler
alone). When the request resumes, its prefix lookup hits that block and it attends to KV
nobody wrote.

The scenario at vLLM CPU's 32-token blocks: a pool of 5 blocks, 48-token steps, a 32-token
threshold, 2 sequences. A (104 tokens, priority 1) computes positions 0-47; then B, the same
prompt at priority 0, arrives. Step 2: A computes 48-79, B hits A's first two blocks and
computes 64-79. Step 3: A is scheduled for 80-103, which registers its third block (64-95);
B then needs a block, and the priority policy preempts A, which leaves the step. A's third
block stays cached with positions 80-95 never computed; A resumes with 96 cached tokens.
The prompt puts a fact in positions 80-95 ("the secret number is 4817") and asks for it in
the last 8 tokens, so the answer depends on exactly the KV that was never written.

Four runs through vLLM's real engine (in-process so the scheduler can be read; greedy,
fp32, 8 tokens each):

- ``plugin``: prefix caching on, ``prefixflight.vllm.Scheduler`` in checked mode (``"lru"``,
  stock vLLM's eviction order), which uncaches such blocks when vLLM preempts;
- ``plugin_without_its_fix``: the same with vLLM's own preemption: what checked mode logs;
- ``stock``: prefix caching on, vLLM's scheduler;
- ``no_prefix_caching``: the reference.

Prints one JSON object (with the decoded outputs) and exits 1 when stock vLLM's output
differs from the reference (reproduced), 0 when not. Run it with the vLLM venv's Python
(benchmarks/vllm/setup.sh):

    .venv-vllm/bin/python benchmarks/vllm/vllm_priority_preempt_live.py MODEL_DIR [JSON]

MODEL_DIR: a Llama folder with its tokenizer; SmolLM2-135M-Instruct (`load_smollm2`'s
converted folder) answers 4817 without prefix caching.
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
FILLER = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told "
    "long stories about the weather, the boats, the market, the children, and the gulls that "
    "followed him every morning along the shore."
)
FACT = " Remember this: the secret number is 4817."
QUESTION = "\nThe secret number is"


def prompt(model: str) -> list[int]:
    """104 tokens: 80 of filler, the fact in positions 80-95 (the block's uncomputed part),
    the question in the last 8."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    filler = ids(FILLER) * 3
    fact = ids(FACT) + ids(" Okay.") * 8
    question = ids("\n") * 8 + ids(QUESTION)
    tokens = filler[:80] + fact[:16] + question[-8:]
    assert len(tokens) == 104
    return tokens


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def unfixed_scheduler() -> type:
    """prefixflight.vllm's sync scheduler (checked mode) with vLLM's own preemption: what
    checked mode sees where the plugin does not step in."""
    from vllm.v1.core.sched.scheduler import Scheduler as VLLMScheduler

    from prefixflight.vllm import SyncScheduler

    class Unfixed(SyncScheduler):
        _preempt_request = VLLMScheduler._preempt_request

    return Unfixed


def run(
    model: str, tokens: list[int], *, caching: bool, scheduler: str | type | None
) -> dict[str, Any]:
    from vllm import EngineArgs, LLMEngine, SamplingParams

    handler = _Lines()
    logging.getLogger("prefixflight.vllm").addHandler(handler)
    extra: dict[str, Any] = {}
    if scheduler is not None:
        extra = {
            "scheduler_cls": scheduler,
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
    core = engine.engine_core.engine_core.scheduler  # in-process (no multiprocessing)
    schedule = core.schedule
    preempted: list[str] = []  # "step N: ids", for each step that preempted a request

    def watched_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        if out.preempted_req_ids:
            ids = sorted(rid.split("-")[0] for rid in out.preempted_req_ids)
            preempted.append(f"step {steps + 1}: {', '.join(ids)}")
        return out

    core.schedule = watched_schedule
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("A", {"prompt_token_ids": tokens}, params, priority=1)
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() and steps < 200:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 1:
            engine.add_request("B", {"prompt_token_ids": tokens}, params, priority=0)
    logging.getLogger("prefixflight.vllm").removeHandler(handler)
    violations = [line for line in handler.lines if "invariant violation" in line]
    del engine
    return {"outputs": outputs, "steps": steps, "violations": violations, "preempted": preempted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="a Llama folder (SmolLM2-135M's converted folder)")
    ap.add_argument("json", nargs="?", default=None, help="also write the report here")
    args = ap.parse_args()
    model = args.model_dir
    tokens = prompt(model)
    runs = {
        "plugin": run(model, tokens, caching=True, scheduler="prefixflight.vllm.Scheduler"),
        "plugin_without_its_fix": run(model, tokens, caching=True, scheduler=unfixed_scheduler()),
        "stock": run(model, tokens, caching=True, scheduler=None),
        "no_prefix_caching": run(model, tokens, caching=False, scheduler=None),
    }
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    reference = runs["no_prefix_caching"]["outputs"]
    report: dict[str, Any] = {
        "prompt_positions_80_95": tok.decode(tokens[80:96]),
        "prompt_last_8": tok.decode(tokens[96:]),
    }
    for name, r in runs.items():
        report[name] = {
            "text": {rid: tok.decode(ids) for rid, ids in sorted(r["outputs"].items())},
            "differs_from_no_prefix_caching": r["outputs"] != reference,
            "preempted": r["preempted"],
            "checked_mode_violations": r["violations"],
            "steps": r["steps"],
            "outputs": r["outputs"],
        }
    if args.json is not None:
        harness.write_json(args.json, report)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 1 if report["stock"]["differs_from_no_prefix_caching"] else 0


if __name__ == "__main__":
    sys.exit(main())
