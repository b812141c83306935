"""The TTFT benchmark pipeline on a tiny model: the run plan interleaves strategies, the
report has the documented shape, and reuse counts follow from the page arithmetic. Timings
are only checked to be positive, never compared."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


def test_benchmark_pipeline_on_a_tiny_model(tiny_model: Any, tiny_tokenizer: Any) -> None:
    from prefixflight.backends.torch import TransformersRunner
    from prefixflight.cli import _bench as bench

    config = bench.TTFTBenchConfig(
        repetitions=2,
        output_tokens=4,
        warm_prompt_tokens=90,
        warm_cached_tokens=80,
        incremental_prompt_tokens=45,
        incremental_followers=(2,),
        flight_prompt_tokens=53,
        flight_concurrency=(3,),
        late_prompt_tokens=37,
        block_size=4,
        max_batch_tokens=64,
        max_running=8,
    )
    runner = TransformersRunner.for_model(
        tiny_model, num_pages=config.num_pages, block_size=4, device="cpu"
    )
    tok = tiny_tokenizer
    bench.warm_up(runner, tok, config)
    runs = bench.plan_runs(config)
    # interleaving: each repetition runs every strategy, starting from a rotated one
    assert len(runs) == 2 * (1 + 2 + 3 + 2)
    firsts = [r.policy for r in runs if r.experiment == "single_flight" and r.concurrency == 3]
    assert firsts[0] != firsts[3]
    results = [(run, bench.run_one(run, runner, tok, config)) for run in runs]
    report = bench.summarize(
        results, config, model="tiny", device="cpu", dtype="float32", threads=1
    )
    json.dumps(report)  # serialisable
    warm = report["warm_prefix"]
    assert warm["recovered_tokens"] == 80  # every full block of the shared document
    assert warm["warm_ttft"] > 0 and warm["cold_ttft"] > 0
    reusable = {45: (45 - 1) // 4 * 4, 53: (53 - 1) // 4 * 4, 37: (37 - 1) // 4 * 4}
    inc = {r["policy"]: r for r in report["incremental_publication"]}
    assert inc["publish_per_step"]["recovered_tokens_per_follower"] == reusable[45]
    assert inc["publish_on_completion"]["recovered_tokens_per_follower"] == 0
    flight = {r["policy"]: r for r in report["single_flight"]}
    assert flight["independent"]["recovered_tokens_per_follower"] == 0
    assert flight["on_completion"]["recovered_tokens_per_follower"] == reusable[53]
    assert flight["after_prefill"]["recovered_tokens_per_follower"] == reusable[53]
    late = {r["policy"]: r for r in report["late_arrival"]}
    assert set(late) == {"on_completion", "after_prefill"}
    assert all(r["recovered_tokens_per_follower"] == reusable[37] for r in late.values())
    for rows in (report["incremental_publication"], report["single_flight"]):
        for r in rows:
            assert {
                "policy",
                "concurrency",
                "prompt_tokens",
                "recovered_tokens_per_follower",
                "mean_ttft",
                "slowest_completion",
            } <= r.keys()
    text = bench.format_tables(report)
    assert "1. Warm document prefix" in text and "4. Late arrival" in text
    assert "after_prefill" in text
    # the demo's report has two of the four sections: they are numbered 1 and 2, no gap
    demo = {k: v for k, v in report.items() if k not in ("incremental_publication", "late_arrival")}
    demo_text = bench.format_tables(demo)
    assert "1. Warm document prefix" in demo_text
    heads = ("1. ", "2. ", "3. ", "4. ")
    numbered = [line[0] for line in demo_text.splitlines() if line.startswith(heads)]
    assert numbered == ["1", "2"] and "2. Single flight" in demo_text
