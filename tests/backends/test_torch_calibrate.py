"""The calibration pipeline on a tiny model: the plans it times are valid for the runner,
every case is repeated and interleaved, and the report's fit and predictions agree with
`CostModel`. Timings are only checked to be positive, never compared."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


def test_calibration_report_on_a_tiny_model(tiny_model: Any, tiny_tokenizer: Any) -> None:
    from prefixflight.backends.torch import TransformersRunner
    from prefixflight.cli import _calibrate as cal
    from prefixflight.sim import CostModel

    config = cal.CalibrationConfig(
        prefill_lengths=(4, 8, 21),
        decode_batches=(1, 3),
        context=22,
        reused=16,
        suffix=5,
        repetitions=3,
        block_size=4,
    )
    runner = TransformersRunner.for_model(
        tiny_model, num_pages=cal.num_pages(config), block_size=4, device="cpu", deduplicate=False
    )
    seen: list[int] = []

    def progress(reps: Any) -> Any:
        for r in reps:
            seen.append(r)
            yield r

    report = cal.calibrate(runner, tiny_tokenizer, config, progress=progress)
    json.dumps(report)
    assert seen == [0, 1, 2]
    names = [r["case"] for r in report["cases"]]
    assert names == [
        "prefill 4",
        "prefill 8",
        "prefill 21",
        "suffix 5 over 16",
        "decode x1",
        "decode x3",
    ]
    p = report["model_parameters"]
    cost = CostModel(**p)
    for row in report["cases"]:
        assert len(row["samples"]) == 3 and min(row["samples"]) > 0
        assert row["min"] == min(row["samples"])
        assert row["predicted"] == pytest.approx(cost.time(row["prefill_tokens"], row["decodes"]))
        assert row["fitted"] == (not row["case"].startswith("suffix"))
    # the suffix continues from reused pages; decodes attend to whole context pages
    suffix = report["cases"][3]
    assert (suffix["prefill_tokens"], suffix["cached_context"]) == (5, 16)
    assert report["cases"][4]["cached_context"] == 20
    # the fit is the best fit of the medians, and the calibration flags reproduce it
    medians = [
        (r["prefill_tokens"], r["decodes"], r["median"]) for r in report["cases"] if r["fitted"]
    ]
    assert cost == CostModel.fit(medians)
    again = CostModel.calibrated(**report["calibration"])
    for name, value in p.items():
        assert getattr(again, name) == pytest.approx(value, abs=1e-12)
    text = cal.format_report({**report, **cal.describe(runner), "model": "tiny"})
    assert "fitted cost model" in text and "suffix 5 over 16 (not fitted)" in text


def test_a_too_small_pool_is_rejected(tiny_model: Any, tiny_tokenizer: Any) -> None:
    from prefixflight.backends.torch import TransformersRunner
    from prefixflight.cli import _calibrate as cal
    from prefixflight.core import ConfigError

    config = cal.CalibrationConfig(
        prefill_lengths=(4, 8),
        decode_batches=(1, 2),
        context=12,
        reused=8,
        suffix=2,
        repetitions=1,
        block_size=4,
    )
    runner = TransformersRunner.for_model(tiny_model, num_pages=4, block_size=4, device="cpu")
    with pytest.raises(ConfigError, match="pages"):
        cal.calibrate(runner, tiny_tokenizer, config)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefill_lengths": (8, 8)}, "prefill_lengths"),
        ({"decode_batches": (0, 1)}, "decode_batches"),
        ({"reused": 20}, "reused"),
        ({"repetitions": 0}, "repetitions"),
    ],
)
def test_config_is_validated(kwargs: dict[str, Any], match: str) -> None:
    from prefixflight.cli import _calibrate as cal
    from prefixflight.core import ConfigError

    with pytest.raises(ConfigError, match=match):
        cal.CalibrationConfig(**kwargs)
