"""A failing engine step fails its own requests and nothing else; what a request asks of the
sampler (a vanishing temperature or top_p, min_tokens) is computed, never a step failure.

The failure is injected through a real code path: a forward pre-hook on the tiny model's
embedding layer raises when an input row holds the poison token twice in a row (a prefill
the test sends; a decode step's rows are one token each, so no generated token can trigger
it), so the real runner's real forward pass raises inside the engine's worker thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prefixflight.backends.torch import (  # noqa: E402
    AsyncEngine,
    EngineConfig,
    SamplingParams,
    StepFailedError,
)
from prefixflight.core import UsageError  # noqa: E402

from .conftest import PAGE, engine_for, greedy_reference, prompt_of, run  # noqa: E402
from .test_torch_engine_lifecycle import assert_nothing_held  # noqa: E402

pytestmark = pytest.mark.torch

POISON = 509
BAD = (*prompt_of(2, 6), POISON, POISON)


@contextlib.contextmanager
def poisoned(model: Any, token: int = POISON) -> Iterator[None]:
    """The model's forward pass raises whenever an input row holds ``token, token``."""

    def check(_module: Any, args: tuple[Any, ...]) -> None:
        ids = args[0]
        if bool(((ids[..., :-1] == token) & (ids[..., 1:] == token)).any()):
            raise RuntimeError(f"poisoned input (token {token})")

    handle = model.get_input_embeddings().register_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


async def collect(gen: Any) -> list[int]:
    return [tok async for tok in gen]


def test_a_failing_step_fails_its_request_and_a_queued_request_is_served(
    tiny_model: Any,
) -> None:
    clean = prompt_of(3, 11)
    expected = greedy_reference(tiny_model, clean, 5)

    async def main() -> None:
        # one running request at a time: the queued request is in no step with the bad one
        cfg = EngineConfig(num_pages=128, block_size=PAGE, max_batch_tokens=64, max_running=1)
        async with AsyncEngine.from_model(tiny_model, cfg, device="cpu") as engine:
            with poisoned(tiny_model):
                bad = engine.generate(BAD, SamplingParams(max_tokens=4))
                queued = engine.generate(clean, SamplingParams(max_tokens=5))
                with pytest.raises(StepFailedError, match="poisoned input") as info:
                    await collect(bad)
                assert isinstance(info.value.__cause__, RuntimeError)
                assert await collect(queued) == expected
                assert not engine.closed
                assert_nothing_held(engine)

    run(main)


def test_a_failing_step_fails_every_request_in_it_and_the_engine_serves_on(
    tiny_model: Any,
) -> None:
    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            with poisoned(tiny_model):
                steady = engine.generate(prompt_of(1, 10), SamplingParams(max_tokens=300))
                await anext(aiter(steady))  # decoding: its next step carries the bad prefill
                bad = engine.generate(BAD, SamplingParams(max_tokens=4))
                for gen in (bad, steady):
                    with pytest.raises(StepFailedError, match="poisoned input"):
                        await collect(gen)
                assert not engine.closed
                assert_nothing_held(engine)
                after = prompt_of(4, 9)
                out = await collect(engine.generate(after, SamplingParams(max_tokens=4)))
                assert out == greedy_reference(tiny_model, after, 4)
                assert engine.scheduler.stats.aborted == 2
                assert_nothing_held(engine)

    run(main)


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [(5e-324, 1.0), (1e-300, 1.0), (1e-38, 0.9), (1.0, 5e-324), (0.7, 1e-45), (1e-300, 5e-324)],
)
def test_a_vanishing_temperature_or_top_p_is_served_not_a_step_failure(
    tiny_model: Any, temperature: float, top_p: float
) -> None:
    prompt = prompt_of(6, 10)
    expected = greedy_reference(tiny_model, prompt, 4)

    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            sampling = SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, seed=1)
            assert await collect(engine.generate(prompt, sampling)) == expected
            assert not engine.closed

    run(main)


def test_min_tokens_holds_back_end_of_sequence_and_stop_tokens(tiny_model: Any) -> None:
    prompt = prompt_of(8, 12)
    free = greedy_reference(tiny_model, prompt, 1)[0]  # the greedy first token

    async def main() -> None:
        cfg = EngineConfig(num_pages=128, block_size=PAGE, max_batch_tokens=64, max_running=8)
        async with AsyncEngine.from_model(
            tiny_model, cfg, eos_token_ids=[free], device="cpu"
        ) as engine:
            # the first greedy token is the end of sequence: the answer is that one token
            assert await collect(engine.generate(prompt, SamplingParams(max_tokens=6))) == [free]
            for sampling in (
                SamplingParams(max_tokens=6, min_tokens=3),
                SamplingParams(max_tokens=6, min_tokens=3, ignore_eos=True, stop_token_ids=(free,)),
                SamplingParams(max_tokens=6, min_tokens=3, temperature=0.8, seed=2),
            ):
                out = await collect(engine.generate(prompt, sampling))
                assert len(out) >= 3 and free not in out[:3], (sampling, out)
            with pytest.raises(UsageError, match="stop token id 512"):
                engine.generate(prompt, SamplingParams(stop_token_ids=(512,)))

    run(main)


def test_validate_checks_a_prompt_without_submitting_it(tiny_model: Any) -> None:
    async def main() -> None:
        engine = engine_for(tiny_model)
        assert engine.validate([1, 2, 3]) == (1, 2, 3)
        context = engine.max_model_len
        assert context is not None and context == tiny_model.config.max_position_embeddings
        with pytest.raises(UsageError, match=f"maximum context length is {context}"):
            engine.validate([1] * context, SamplingParams(max_tokens=1))
        with pytest.raises(UsageError, match="empty prompt"):
            engine.validate([])
        with pytest.raises(UsageError, match="needs 129 pages"):
            engine.validate([1] * 500, SamplingParams(max_tokens=17))
        assert engine.scheduler.requests() == {} and not engine.scheduler.has_unfinished
        await engine.close()

    run(main)
