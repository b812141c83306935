"""Fixtures for the torch backend tests: tiny random-weight Llama and Qwen2 models, and the
real SmolLM2 model converted once per test session.

torch and transformers are imported inside the fixtures, so collecting this folder without
them installed works; the test modules skip themselves with ``pytest.importorskip``. Where
torch must be there (the torch tox env and CI set PREFIXFLIGHT_REQUIRE_TORCH=1), the root
conftest turns those skips into failures and this module imports both at once, so a broken
install fails the run instead of skipping every torch test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see the backend docs)

if os.environ.get("PREFIXFLIGHT_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401  # an ImportError here fails the run: torch is required
    import transformers  # noqa: F401

TINY_FAMILIES = ("llama", "qwen2")


def make_tiny_model(family: str, seed: int = 0) -> Any:
    """A 2-layer random-weight causal LM (vocab 512, 4 query heads, 2 KV heads of 16)."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_model(request: pytest.FixtureRequest) -> Any:
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_factory() -> Callable[[str, int], Any]:
    return make_tiny_model


class TinyTokenizer:
    """Characters -> ids below the tiny models' vocabulary."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 500 + 1 for c in text]}


@pytest.fixture(scope="session")
def tiny_tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The real model, converted once into the cache root ($PREFIXFLIGHT_CACHE or
    ~/.cache/prefixflight) and loaded from there afterwards."""
    from prefixflight.backends.torch import load_smollm2

    return load_smollm2(device="cpu")
