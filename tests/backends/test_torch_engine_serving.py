"""AsyncEngine features a server needs: stop at the tokenizer's EOS, ``n`` answers through
one flight, tenant namespaces, reused-token reports, and a KV event sink.

Expected tokens come from a from-scratch greedy recomputation with the model alone;
expected reuse from the page arithmetic of the prompt.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prefixflight.backends.torch import (  # noqa: E402
    AsyncEngine,
    EngineConfig,
    SamplingParams,
    TransformersRunner,
)
from prefixflight.core import ConfigError, FinishReason, ReleasePolicy, UsageError  # noqa: E402
from prefixflight.core.cache import BlockStored, KVEvent  # noqa: E402
from prefixflight.core.flight import Role  # noqa: E402

from .conftest import PAGE, greedy_reference, prompt_of, run  # noqa: E402

pytestmark = pytest.mark.torch


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(num_pages=128, block_size=PAGE, max_batch_tokens=64, max_running=8, **kw)


class EosTokenizer:
    """A tokenizer object that only declares its end-of-sequence id."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 500 + 1 for c in text]}


def test_generation_stops_at_the_tokenizer_eos_unless_ignored(tiny_model: Any) -> None:
    prompt = prompt_of(1, 12)
    ref = greedy_reference(tiny_model, prompt, 12)
    eos = ref[4]
    cut = ref.index(eos) + 1  # the EOS is emitted, then the request ends

    async def main() -> None:
        engine = AsyncEngine.from_model(tiny_model, config(), tokenizer=EosTokenizer(eos))
        async with engine:
            assert engine.eos_token_ids == {eos}
            stopped = await engine.generate(prompt, SamplingParams(max_tokens=12)).result()
            assert list(stopped.output_token_ids) == ref[:cut]
            assert stopped.finish_reason is FinishReason.STOP
            full = await engine.generate(
                prompt, SamplingParams(max_tokens=12, ignore_eos=True)
            ).result()
            assert list(full.output_token_ids) == ref
            assert full.finish_reason is FinishReason.LENGTH
        # an explicit list replaces the tokenizer's (empty: never stop early)
        plain = AsyncEngine.from_model(
            tiny_model, config(), tokenizer=EosTokenizer(eos), eos_token_ids=()
        )
        async with plain:
            out = await plain.generate(prompt, SamplingParams(max_tokens=12)).result()
            assert list(out.output_token_ids) == ref

    run(main)


def test_engine_rejects_an_eos_outside_the_vocabulary(tiny_model: Any) -> None:
    runner = TransformersRunner.for_model(tiny_model, num_pages=16, block_size=PAGE)
    with pytest.raises(ConfigError, match="eos token id 512 "):
        AsyncEngine(runner, EngineConfig(num_pages=16, block_size=PAGE), eos_token_ids=[512])
    with pytest.raises(ConfigError, match="ignore_eos must be a bool, got 'no'"):
        SamplingParams(ignore_eos="no")  # type: ignore[arg-type]


def test_n_answers_share_one_prefill(tiny_model: Any) -> None:
    prompt = prompt_of(2, 30)
    ref = greedy_reference(tiny_model, prompt, 5)
    reusable = (len(prompt) - 1) // PAGE * PAGE

    async def main() -> None:
        async with AsyncEngine.from_model(tiny_model, config()) as engine:
            gens = engine.generate_n(prompt, SamplingParams(max_tokens=5), 3)
            reports = [await g.result() for g in gens]
            assert [list(r.output_token_ids) for r in reports] == [ref] * 3
            assert sorted(r.role.name for r in reports) == ["FOLLOWER", "FOLLOWER", "LEADER"]
            for r in reports:
                assert r.cached_tokens == (0 if r.role is Role.LEADER else reusable)
            # one full prefill, and each follower computes only past the shared pages
            stats = engine.scheduler.stats
            assert stats.prefill_tokens == len(prompt) + 2 * (len(prompt) - reusable)
            assert engine.scheduler.coordinator.stats.flights_opened == 1

    run(main)


def test_n_sampled_answers_use_seed_plus_index(tiny_model: Any) -> None:
    prompt = prompt_of(3, 21)
    base = SamplingParams(max_tokens=6, temperature=1.5, seed=40)

    async def together() -> list[list[int]]:
        async with AsyncEngine.from_model(tiny_model, config()) as engine:
            gens = engine.generate_n(prompt, base, 3, request_ids=["a", "b", "c"])
            assert [g.request_id for g in gens] == ["a", "b", "c"]
            return [list((await g.result()).output_token_ids) for g in gens]

    async def alone(seed: int) -> list[int]:
        async with AsyncEngine.from_model(tiny_model, config()) as engine:
            params = SamplingParams(max_tokens=6, temperature=1.5, seed=seed)
            return list((await engine.generate(prompt, params).result()).output_token_ids)

    answers = run(together)
    assert answers == [run(lambda s=s: alone(s)) for s in (40, 41, 42)]  # type: ignore[misc]
    assert len({tuple(a) for a in answers}) > 1


def test_generate_n_rejects_bad_arguments_and_adds_nothing(tiny_model: Any) -> None:
    async def main() -> None:
        async with AsyncEngine.from_model(tiny_model, config()) as engine:
            with pytest.raises(ConfigError, match="n must be >= 1, got 0"):
                engine.generate_n([1, 2, 3], None, 0)
            with pytest.raises(UsageError, match="2 distinct ids"):
                engine.generate_n([1, 2, 3], None, 2, request_ids=["x", "x"])
            engine.generate([4, 5], request_id="taken")
            with pytest.raises(UsageError, match="duplicate request id 'taken'"):
                engine.generate_n([1, 2, 3], None, 2, request_ids=["free", "taken"])
            assert set(engine.scheduler.requests()) == {"taken"}

    run(main)


def test_namespaces_never_share_blocks_or_flights(tiny_model: Any) -> None:
    prompt = prompt_of(4, 26)
    reusable = (len(prompt) - 1) // PAGE * PAGE

    async def main() -> None:
        async with AsyncEngine.from_model(tiny_model, config()) as engine:
            one = SamplingParams(max_tokens=2)
            first = await engine.generate(prompt, one, namespace="tenant-a").result()
            other = await engine.generate(prompt, one, namespace="tenant-b").result()
            again = await engine.generate(prompt, one, namespace="tenant-a").result()
            assert (first.cached_tokens, other.cached_tokens) == (0, 0)
            assert again.cached_tokens == reusable
            # arriving together in two namespaces: no flight is shared, so neither request
            # led anyone (a lead nobody joined reports itself as independent)
            gens = [engine.generate(prompt_of(5, 26), one, namespace=ns) for ns in "xy"]
            roles = [(await g.result()).role for g in gens]
            assert roles == [Role.INDEPENDENT, Role.INDEPENDENT]

    run(main)


def test_event_sink_receives_the_cache_events(tiny_model: Any) -> None:
    events: list[KVEvent] = []
    prompt = prompt_of(6, 17)

    async def main() -> None:
        engine = AsyncEngine.from_model(
            tiny_model,
            config(release_policy=ReleasePolicy.INDEPENDENT),
            event_sink=events.append,
        )
        async with engine:
            await engine.generate(prompt, SamplingParams(max_tokens=1)).result()

    run(main)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == len(prompt) // PAGE


def test_min_shared_blocks_lets_a_shared_prefix_follow_an_open_flight(tiny_model: Any) -> None:
    shared = prompt_of(7, 3 * PAGE)
    first, second = [*shared, *prompt_of(8, 5)], [*shared, *prompt_of(9, 6)]
    ref = greedy_reference(tiny_model, second, 3)

    async def main() -> None:
        engine = AsyncEngine.from_model(tiny_model, config(min_shared_blocks=2))
        async with engine:
            one = SamplingParams(max_tokens=3)
            a, b = engine.generate(first, one), engine.generate(second, one)
            ra, rb = await a.result(), await b.result()
            assert (ra.role, rb.role) == (Role.LEADER, Role.FOLLOWER)
            assert rb.cached_tokens == len(shared)  # the three shared blocks, reused
            assert list(rb.output_token_ids) == ref
            assert engine.scheduler.coordinator.stats.partial_followers == 1

    run(main)
    with pytest.raises(ConfigError, match="min_shared_blocks must be >= 1, got 0"):
        config(min_shared_blocks=0)
