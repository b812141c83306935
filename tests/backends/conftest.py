"""Fixtures for the torch backend tests: tiny random-weight Llama and Qwen2 models, and the
real SmolLM2 model converted once per test session.

torch and transformers are imported inside the fixtures, so collecting this folder without
them installed works; the test modules skip themselves with ``pytest.importorskip``. Where
torch must be there (the torch tox env and CI set PREFIXFLIGHT_REQUIRE_TORCH=1), the root
conftest turns those skips into failures and this module imports both at once, so a broken
install fails the run instead of skipping every torch test.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see the backend docs)

if os.environ.get("PREFIXFLIGHT_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401  # an ImportError here fails the run: torch is required
    import transformers  # noqa: F401

if TYPE_CHECKING:
    from prefixflight.backends.torch import AsyncEngine

TINY_FAMILIES = ("llama", "qwen2")
PAGE = 4
"""The page size of the engine tests' pools."""
T = TypeVar("T")


def make_tiny_model(family: Literal["llama", "qwen2"], seed: int = 0) -> Any:
    """A 2-layer random-weight causal LM (`prefixflight.backends.TINY_LLAMA`)."""
    from prefixflight.backends.torch import tiny_model

    return tiny_model(family, seed)


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_model(request: pytest.FixtureRequest) -> Any:
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_factory() -> Callable[[Literal["llama", "qwen2"], int], Any]:
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

    return load_smollm2(device="cpu", dtype="float32")


# -- shared by the engine tests ---------------------------------------------------------------
def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """Run one coroutine function on a fresh event loop."""

    async def main() -> T:
        return await coro_fn()

    return asyncio.run(main())


def greedy_reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, recomputed from scratch by the model alone."""
    import torch

    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def engine_for(model: Any, **config: Any) -> AsyncEngine:
    """An `AsyncEngine` over ``model`` with small pools of `PAGE`-token pages."""
    from prefixflight.backends.torch import AsyncEngine, EngineConfig

    cfg = EngineConfig(num_pages=128, block_size=PAGE, max_batch_tokens=64, max_running=8, **config)
    return AsyncEngine.from_model(model, cfg, device="cpu")


def prompt_of(seed: int, n: int) -> list[int]:
    """``n`` random token ids below the tiny models' vocabulary, from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 512, (n,), generator=g)]
