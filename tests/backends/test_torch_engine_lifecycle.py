"""AsyncEngine's lifecycle (cases found by outside probing): closing the engine during a
step or after a model failure must leave every page free and nothing unfinished; closing a
request's stream (``break``, ``aclose()``, garbage collection) must abort it; a one-shot
iterator prompt is read once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prefixflight.backends.torch import (  # noqa: E402
    AsyncEngine,
    EngineClosedError,
    SamplingParams,
    StepFailedError,
    TransformersRunner,
)
from prefixflight.core import FinishReason  # noqa: E402

from .conftest import engine_for, prompt_of, run  # noqa: E402

pytestmark = pytest.mark.torch

WAIT = 30.0  # seconds: the bound on every wait for a real condition


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for ``condition`` to hold while the engine runs."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def assert_nothing_held(engine: AsyncEngine) -> None:
    sched = engine.scheduler
    usage = sched.page_usage()
    assert (usage.pinned, usage.private) == (0, 0), usage
    assert usage.free + usage.cached == usage.total  # every cached page is evictable
    assert not sched.has_unfinished
    assert sched.outstanding is None
    assert sched.requests() == {}
    sched.check_invariants()


class Gate:
    """Holds the model step inside the worker thread once armed, until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail: bool = False) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.opened = threading.Event()
        original = TransformersRunner.execute
        gate = self

        def execute(runner: TransformersRunner, plan: Any) -> Any:
            if gate.armed:
                gate.entered.set()
                if fail:
                    raise RuntimeError("device lost")
                assert gate.opened.wait(WAIT), "the test never opened the gate"
            return original(runner, plan)

        monkeypatch.setattr(TransformersRunner, "execute", execute)


def test_close_during_a_step_frees_every_page(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 9 #6: requests aborted by `close` inside a step released their pins and pages."""
    gate = Gate(monkeypatch)
    prefix = prompt_of(1, 24)

    async def main() -> None:
        engine = engine_for(tiny_model)
        await engine.generate(prefix, SamplingParams(max_tokens=2)).result()
        gate.armed = True
        # a cache hit (pinned pages) and a flight (a leader and its follower)
        gens = [engine.generate([*prefix, 7, 8, 9], SamplingParams(max_tokens=40)) for _ in (0, 1)]
        assert await asyncio.to_thread(gate.entered.wait, WAIT)
        assert engine.scheduler.outstanding is not None
        closing = asyncio.create_task(engine.close())
        await until(lambda: engine.closed, "close to start")
        gate.opened.set()
        await closing
        for gen in gens:
            with pytest.raises(EngineClosedError):
                await gen.result()
        assert_nothing_held(engine)

    run(main)


def test_close_after_a_model_exception_frees_every_page(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 9 #6: a failed step left its requests running and their pages held."""
    gate = Gate(monkeypatch, fail=True)
    prefix = prompt_of(2, 24)

    async def main() -> None:
        engine = engine_for(tiny_model)
        await engine.generate(prefix, SamplingParams(max_tokens=2)).result()
        gate.armed = True
        gens = [engine.generate([*prefix, 5, 6], SamplingParams(max_tokens=40)) for _ in range(3)]
        for gen in gens:
            with pytest.raises(StepFailedError, match="device lost"):
                await gen.result()
        assert not engine.closed  # a failed step fails its requests, not the engine
        assert_nothing_held(engine)  # already after the failure, before close
        await engine.close()
        assert_nothing_held(engine)

    run(main)


def test_break_out_of_async_for_aborts_the_request(tiny_model: Any) -> None:
    """Issue 9 #7: ``break`` left the request decoding to its end."""

    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            got = []
            async for tok in engine.generate(prompt_of(3, 10), SamplingParams(max_tokens=100)):
                got.append(tok)
                if len(got) == 2:
                    break
            await until(lambda: not engine.scheduler.has_unfinished, "the request to end")
            stats = engine.scheduler.stats
            assert (stats.aborted, stats.finished) == (1, 0)
            assert stats.decode_tokens < 99
            assert_nothing_held(engine)

    run(main)


def test_aclose_aborts_the_request(tiny_model: Any) -> None:
    """Issue 9 #7: a Generation closes like an async generator (``aclose``, `aclosing`)."""

    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            gen = engine.generate(prompt_of(4, 10), SamplingParams(max_tokens=100))
            first = await gen.__anext__()
            assert isinstance(first, int)
            await gen.aclose()
            assert gen.report is not None and gen.report.finish_reason is FinishReason.ABORTED
            assert [tok async for tok in gen] == []  # closed: nothing more, like a generator
            await gen.aclose()  # idempotent
            async with contextlib.aclosing(
                engine.generate(prompt_of(5, 10), SamplingParams(max_tokens=100))
            ) as stream:
                async for _ in stream:
                    break
            await until(lambda: not engine.scheduler.has_unfinished, "the requests to end")
            assert engine.scheduler.stats.aborted == 2
            assert_nothing_held(engine)

    run(main)


def test_a_garbage_collected_generation_aborts_the_request(tiny_model: Any) -> None:
    """Issue 9 #7: a dropped, unfinished Generation decoded to its end."""

    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            gen = engine.generate(prompt_of(6, 10), SamplingParams(max_tokens=100))
            await gen.__anext__()
            del gen
            gc.collect()
            await until(lambda: not engine.scheduler.has_unfinished, "the request to end")
            stats = engine.scheduler.stats
            assert (stats.aborted, stats.finished) == (1, 0)
            assert_nothing_held(engine)

    run(main)


def test_an_iterator_prompt_is_read_once(tiny_model: Any) -> None:
    """Issue 9 #12: a one-shot iterator prompt was consumed by validation, then empty."""
    prompt = prompt_of(7, 13)

    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            from_list = await engine.generate(prompt, SamplingParams(max_tokens=3)).result()
            from_iter = await engine.generate(iter(prompt), SamplingParams(max_tokens=3)).result()
            gen_expr = await engine.generate(
                (t for t in prompt), SamplingParams(max_tokens=3)
            ).result()
            assert from_iter.prompt_tokens == gen_expr.prompt_tokens == len(prompt)
            assert from_iter.output_token_ids == from_list.output_token_ids
            assert gen_expr.output_token_ids == from_list.output_token_ids

    run(main)
