"""benchmarks/flight/duplicate_prefill.py's yardstick: what an ideal prefix cache computes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "flight" / "duplicate_prefill.py"
_spec = importlib.util.spec_from_file_location("duplicate_prefill", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["duplicate_prefill"] = bench
_spec.loader.exec_module(bench)


def test_an_ideal_cache_computes_a_burst_once_plus_one_tail_per_follower() -> None:
    prompt = list(range(532))
    assert bench.ideal_computed([prompt] * 8, 16) == 532 + 7 * 4
    assert bench.ideal_computed([prompt] * 8, 128) == 532 + 7 * 20
    # a block-aligned prompt: the last token is computed, so the last block is too
    assert bench.ideal_computed([prompt[:512]] * 2, 16) == 512 + 16


def test_prompts_sharing_a_document_reuse_its_full_blocks() -> None:
    doc = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16
    prompts = [doc + [i] * 10 for i in range(3)]
    assert bench.ideal_computed(prompts, 16) == 110 + 2 * (110 - 96)


def test_workloads_have_the_shapes_the_docs_describe() -> None:
    warm = bench.workload("burst_warm_4", 0, 4000, 1.0)
    assert [measured for *_, measured in warm] == [False, True, True, True, True]
    assert all(len(p) == 532 and out == 128 for _, p, out, _ in warm)
    late = bench.workload("doc_late_4", 0, 4000, 1.5)
    assert [d for d, *_ in late] == [0.0, 1.5, 1.5, 1.5]
    tails = bench.workload("doc_tails_4", 0, 4000, 1.0)
    assert len({tuple(p[:3936]) for _, p, _, _ in tails}) == 1
    assert len({tuple(p[3936:]) for _, p, _, _ in tails}) == 4
