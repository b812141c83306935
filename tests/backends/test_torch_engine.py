"""AsyncEngine: concurrent requests, single flight, cancellation and shutdown on a tiny model.

Expected tokens come from the model alone (a from-scratch greedy recomputation, or the same
request served alone); expected reuse comes from the page arithmetic of the prompt.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prefixflight.backends.torch import (  # noqa: E402
    AsyncEngine,
    EngineClosedError,
    EngineConfig,
    SamplingParams,
    StepFailedError,
    TransformersRunner,
)
from prefixflight.core import ConfigError, FinishReason, ReleasePolicy, UsageError  # noqa: E402
from prefixflight.core.flight import Role  # noqa: E402

from .conftest import PAGE, engine_for, greedy_reference, prompt_of, run  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("policy", list(ReleasePolicy))
def test_identical_requests_share_one_prefill_and_match_greedy(
    tiny_model: Any, policy: ReleasePolicy
) -> None:
    prompt = prompt_of(1, 30)
    expected = greedy_reference(tiny_model, prompt, 6)

    async def main() -> list[Any]:
        async with engine_for(tiny_model, release_policy=policy) as engine:
            gens = [engine.generate(prompt, SamplingParams(max_tokens=6)) for _ in range(4)]
            outputs = await asyncio.gather(*(collect(g) for g in gens))
            assert all(out == expected for out in outputs)
            usage = engine.scheduler.page_usage()
            assert usage.pinned == usage.private == 0  # everything released
            return [g.report for g in gens]

    reports = run(main)
    roles = sorted(r.role.name for r in reports)
    if policy is ReleasePolicy.INDEPENDENT:
        assert roles == ["INDEPENDENT"] * 4
    else:
        assert roles == ["FOLLOWER"] * 3 + ["LEADER"]
        reusable = (len(prompt) - 1) // PAGE * PAGE  # the last prompt token is recomputed
        for r in reports:
            assert r.cached_tokens == (0 if r.role is Role.LEADER else reusable)
    assert all(r.finish_reason is FinishReason.LENGTH and r.ttft is not None for r in reports)


async def collect(gen: Any) -> list[int]:
    return [tok async for tok in gen]


def test_followers_sample_like_requests_served_alone(tiny_model: Any) -> None:
    """Flights coordinate prefill, not answers: seeded followers produce exactly what each
    request produces when served alone on a fresh engine."""
    prompt = prompt_of(2, 25)
    params = [SamplingParams(max_tokens=5, temperature=1.2, top_p=0.9, seed=s) for s in range(4)]

    async def together() -> list[list[int]]:
        async with engine_for(tiny_model) as engine:
            return list(
                await asyncio.gather(*(collect(engine.generate(prompt, p)) for p in params))
            )

    async def alone(p: SamplingParams) -> list[int]:
        async with engine_for(tiny_model) as engine:
            return await collect(engine.generate(prompt, p))

    shared = run(together)
    assert shared == [run(lambda p=p: alone(p)) for p in params]  # type: ignore[misc]
    assert len({tuple(s) for s in shared}) > 1


def test_cancelled_leader_hands_over_and_releases_its_pages(tiny_model: Any) -> None:
    prompt = prompt_of(3, 33)
    expected = greedy_reference(tiny_model, prompt, 8)

    async def main() -> None:
        async with engine_for(tiny_model, release_policy=ReleasePolicy.ON_COMPLETION) as engine:
            leader = engine.generate(prompt, SamplingParams(max_tokens=50))
            followers = [engine.generate(prompt, SamplingParams(max_tokens=8)) for _ in range(2)]
            first = asyncio.get_running_loop().create_future()

            async def consume_leader() -> None:
                async for _ in leader:
                    if not first.done():
                        first.set_result(None)

            task = asyncio.create_task(consume_leader())
            await first
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert leader.report is not None
            assert leader.report.finish_reason is FinishReason.ABORTED
            outs = await asyncio.gather(*(collect(f) for f in followers))
            assert outs == [expected, expected]
            usage = engine.scheduler.page_usage()
            assert usage.pinned == usage.private == 0
            engine.scheduler.check_invariants()

    run(main)


def test_close_aborts_unfinished_requests_and_rejects_new_ones(tiny_model: Any) -> None:
    async def main() -> None:
        engine = engine_for(tiny_model)
        gen = engine.generate(prompt_of(4, 20), SamplingParams(max_tokens=100))
        got = [await gen.__anext__()]
        await engine.close()
        with pytest.raises(EngineClosedError):
            async for tok in gen:
                got.append(tok)
        assert gen.report is not None and gen.report.finish_reason is FinishReason.ABORTED
        assert engine.closed
        with pytest.raises(EngineClosedError):
            engine.generate([1, 2, 3])
        assert len(got) < 100

    run(main)


def test_model_step_runs_off_the_event_loop_thread(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: set[int] = set()
    original = TransformersRunner.execute

    def spy(self: TransformersRunner, plan: Any) -> Any:
        threads.add(threading.get_ident())
        return original(self, plan)

    monkeypatch.setattr(TransformersRunner, "execute", spy)

    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            await collect(engine.generate(prompt_of(5, 10), SamplingParams(max_tokens=3)))

    run(main)
    assert threads and threading.get_ident() not in threads


def test_a_backend_failure_fails_the_requests_of_its_step_and_the_engine_serves_on(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = TransformersRunner.execute
    broken = True

    def boom(self: TransformersRunner, plan: Any) -> Any:
        if broken:
            raise RuntimeError("device lost")
        return original(self, plan)

    monkeypatch.setattr(TransformersRunner, "execute", boom)

    async def main() -> None:
        nonlocal broken
        async with engine_for(tiny_model) as engine:
            gens = [engine.generate(prompt_of(i, 9)) for i in range(3)]
            for g in gens:
                with pytest.raises(StepFailedError, match="device lost") as info:
                    await collect(g)
                assert isinstance(info.value.__cause__, RuntimeError)
            assert not engine.closed
            # the failed step registered the prompts' blocks for same-step sharing: they
            # never got their KV, so they left the cache with the step
            assert len(engine.scheduler.cache) == 0
            usage = engine.scheduler.page_usage()
            assert usage.free == usage.total
            broken = False
            for prompt in (prompt_of(7, 9), prompt_of(0, 9)):  # a new one, a failed one again
                gen = engine.generate(prompt, SamplingParams(max_tokens=3))
                assert await collect(gen) == greedy_reference(tiny_model, prompt, 3)
                assert gen.report is not None and gen.report.cached_tokens == 0

    run(main)


def test_bad_requests_are_rejected_and_change_nothing(tiny_model: Any) -> None:
    async def main() -> None:
        async with engine_for(tiny_model) as engine:
            engine.generate([1, 2, 3], request_id="a")
            before = engine.scheduler.requests()
            with pytest.raises(UsageError, match="duplicate request id 'a'"):
                engine.generate([4, 5], request_id="a")
            with pytest.raises(UsageError, match="tokenizer"):
                engine.generate("hello")
            with pytest.raises(UsageError, match="empty prompt"):
                engine.generate([])
            with pytest.raises(UsageError, match="needs"):
                engine.generate([1] * 1000, SamplingParams(max_tokens=1))
            with pytest.raises(UsageError, match="99999"):
                engine.generate([5, 99999])
            assert engine.scheduler.requests() == before
            # the engine still serves the request it had
            report = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2)).result()
            assert len(report.output_token_ids) == 2

    run(main)


def test_text_prompts_use_the_tokenizer(tiny_model: Any) -> None:
    def tokenizer(text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 512 for c in text]}

    async def main() -> list[int]:
        cfg = EngineConfig(num_pages=64, block_size=PAGE, max_batch_tokens=64, max_running=4)
        runner = TransformersRunner.for_model(tiny_model, num_pages=64, block_size=PAGE)
        async with AsyncEngine(runner, cfg, tokenizer=tokenizer) as engine:
            return await collect(engine.generate("hi there", SamplingParams(max_tokens=3)))

    assert run(main) == greedy_reference(tiny_model, [ord(c) % 512 for c in "hi there"], 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"release_policy": "after_prefill"}, "release_policy must be a ReleasePolicy"),
        ({"eviction": "fifo"}, "'fifo'"),
        ({"max_wait": -1.0}, "-1.0"),
        ({"num_pages": 0}, "num_pages must be >= 1, got 0"),
        ({"max_running": 8, "max_batch_tokens": 4}, r"max_batch_tokens \(4\)"),
    ],
)
def test_engine_config_errors_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_must_fit_the_pool(tiny_model: Any) -> None:
    runner = TransformersRunner.for_model(tiny_model, num_pages=8, block_size=PAGE)
    with pytest.raises(ConfigError, match="block_size 16"):
        AsyncEngine(runner, EngineConfig(num_pages=8, block_size=16))
    with pytest.raises(ConfigError, match="num_pages 9"):
        AsyncEngine(runner, EngineConfig(num_pages=9, block_size=PAGE))


def test_engine_config_page_size_is_a_deprecated_name_of_block_size() -> None:
    with pytest.warns(DeprecationWarning, match="page_size is now block_size"):
        old = EngineConfig(num_pages=8, page_size=PAGE)  # type: ignore[call-arg]  # hidden from type checkers
    assert old == EngineConfig(num_pages=8, block_size=PAGE)
    with pytest.warns(DeprecationWarning, match="page_size is now block_size"):
        assert old.page_size == PAGE  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="page_size"):
        EngineConfig(page_size=8, block_size=PAGE)  # type: ignore[call-arg]


def test_an_engine_closed_before_it_started_stays_closed(tiny_model: Any) -> None:
    async def main() -> None:
        engine = engine_for(tiny_model)
        await engine.close()
        assert engine.closed
        with pytest.raises(EngineClosedError):
            engine.generate([1, 2, 3])

    run(main)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_matches_the_cpu_greedy_reference(tiny_factory: Any) -> None:
    model = tiny_factory("llama", 0)
    prompt = prompt_of(6, 30)
    expected = greedy_reference(model, prompt, 6)

    async def main() -> list[list[int]]:
        cfg = EngineConfig(num_pages=64, block_size=PAGE, max_batch_tokens=64, max_running=4)
        engine = AsyncEngine.from_model(model, cfg, device="cuda", dtype="float32")
        async with engine:
            gens = [engine.generate(prompt, SamplingParams(max_tokens=6)) for _ in range(3)]
            return list(await asyncio.gather(*(collect(g) for g in gens)))

    assert run(main) == [expected] * 3


_BURST_PAGE = 16
_REFERENCE: dict[int, list[int]] = {}


@pytest.mark.parametrize("arrival", ["together", "spread", "warm"])
@pytest.mark.parametrize("policy", [ReleasePolicy.INDEPENDENT, ReleasePolicy.AFTER_PREFILL])
@pytest.mark.parametrize("n", [4, 8])
def test_a_burst_never_recomputes_the_shared_prompt(
    tiny_factory: Any, n: int, policy: ReleasePolicy, arrival: str
) -> None:
    """The single-flight study's bursts on the real engine: 4 or 8 identical 532-token
    prompts, 128 tokens out, arriving together, spread over the first steps, or after the
    prompt was warmed; a step budget of 256 (below the prompt). Coordinated or not, the
    prompt's full blocks are computed once and every other request reuses all 528 of its
    tokens (pages of 16), and every answer is the model's greedy one."""
    model = tiny_factory("llama", 0)
    prompt = prompt_of(500 + n, 532)
    if n not in _REFERENCE:
        _REFERENCE[n] = greedy_reference(model, prompt, 128)
    config = EngineConfig(
        release_policy=policy,
        num_pages=256,
        block_size=_BURST_PAGE,
        max_batch_tokens=256,
        max_running=8,
    )
    sampling = SamplingParams(max_tokens=128, ignore_eos=True)

    async def main() -> tuple[list[Any], Any, Any]:
        async with AsyncEngine.from_model(model, config, device="cpu") as engine:
            if arrival == "warm":
                await engine.generate(prompt, sampling).result()
            before = engine.scheduler.stats
            gens = []
            for _ in range(n):
                gens.append(engine.generate(prompt, sampling))
                if arrival == "spread":
                    await asyncio.sleep(0.01)  # arrivals land while steps run
            outputs = await asyncio.gather(*(collect(g) for g in gens))
            assert all(out == _REFERENCE[n] for out in outputs)
            return [g.report for g in gens], before, engine.scheduler.stats

    reports, before, after = run(main)
    reuse = (532 - 1) // _BURST_PAGE * _BURST_PAGE
    computers = 0 if arrival == "warm" else 1
    assert sorted(r.cached_tokens for r in reports) == [0] * computers + [reuse] * (n - computers)
    computed = after.prefill_tokens - before.prefill_tokens
    assert computed == 532 * computers + (532 - reuse) * (n - computers)
