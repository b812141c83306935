"""Per-request sampling: greedy by default, seeded and independent of the batch."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefixflight.backends.torch import Sampler, SamplingParams, TransformersRunner  # noqa: E402
from prefixflight.core import (  # noqa: E402
    ConfigError,
    DecodeWork,
    PrefillWork,
    RequestId,
    StepPlan,
)

pytestmark = pytest.mark.torch

logits_st = st.lists(
    st.floats(-20, 20, allow_nan=False, allow_infinity=False), min_size=2, max_size=40
).map(lambda xs: torch.tensor(xs))


@settings(max_examples=50)
@given(logits=logits_st, seed=st.integers(0, 2**32))
def test_top_k_one_and_tiny_top_p_are_greedy(logits: Any, seed: int) -> None:
    best = int(torch.argmax(logits))
    if (logits == logits[best]).sum() > 1:
        return  # a tie: any of the maximal tokens is right
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed)).sample(logits) == best
    assert Sampler(SamplingParams(temperature=0.7, top_p=1e-9, seed=seed)).sample(logits) == best
    assert Sampler(SamplingParams()).sample(logits) == best


@settings(max_examples=50)
@given(logits=logits_st, k=st.integers(1, 5), p=st.floats(0.05, 1.0), seed=st.integers(0, 2**32))
def test_samples_stay_inside_top_k_and_top_p(logits: Any, k: int, p: float, seed: int) -> None:
    sampler = Sampler(SamplingParams(temperature=1.3, top_k=k, top_p=p, seed=seed))
    probs = torch.softmax(logits / 1.3, dim=-1)
    kth = torch.topk(logits, min(k, logits.numel())).values[-1]
    for _ in range(5):
        tok = sampler.sample(logits)
        assert logits[tok] >= kth
        # tokens strictly more likely than tok fall short of top_p (else tok would be cut)
        assert float(probs[probs > probs[tok]].sum()) < p + 1e-6


def test_same_seed_same_tokens_and_different_seeds_differ() -> None:
    logits = torch.zeros(1000)  # uniform: every draw is a coin toss
    s1 = Sampler(SamplingParams(temperature=1.0, seed=1))
    s2 = Sampler(SamplingParams(temperature=1.0, seed=1))
    a = [s1.sample(logits) for _ in range(20)]
    assert a == [s2.sample(logits) for _ in range(20)]
    s3 = Sampler(SamplingParams(temperature=1.0, seed=2))
    assert a != [s3.sample(logits) for _ in range(20)]


def test_followers_sample_their_own_tokens_whatever_the_batch(tiny_model: Any) -> None:
    """Three requests share a prompt's pages; each samples with its own seed. A request's
    tokens are the same whether it decodes alone or batched with the others."""
    prompt = tuple(range(3, 43))
    params = {
        "greedy": SamplingParams(),
        "hot": SamplingParams(temperature=1.5, seed=11),
        "nucleus": SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=12),
    }

    def run(batched: bool) -> dict[RequestId, list[int]]:
        runner = TransformersRunner.for_model(tiny_model, num_pages=64, block_size=4, device="cpu")
        for rid, sp in params.items():
            runner.set_sampling(rid, sp)
        shared = tuple(range(10))  # 40 prompt tokens = 10 pages, computed once
        tables = {
            rid: shared + tuple(range(10 + 8 * i, 18 + 8 * i)) for i, rid in enumerate(params)
        }
        # the leader prefills everything; followers recompute only the last prompt token
        runner.execute(
            StepPlan(
                step=0,
                prefills=(
                    PrefillWork(
                        request_id="greedy",
                        token_ids=prompt,
                        start=0,
                        pages=tables["greedy"],
                        sample=True,
                    ),
                ),
            )
        )
        first = dict(
            runner.execute(
                StepPlan(
                    step=0,
                    prefills=(
                        PrefillWork(
                            request_id="greedy",
                            token_ids=prompt[39:],
                            start=39,
                            pages=tables["greedy"],
                            sample=True,
                        ),
                    ),
                )
            ).sampled
        )
        for rid in ("hot", "nucleus"):
            w = PrefillWork(
                request_id=rid,
                token_ids=prompt[36:],
                start=36,
                pages=shared[:9] + tables[rid][10:],
                sample=True,
            )
            first.update(runner.execute(StepPlan(step=1, prefills=(w,))).sampled)
        out = {rid: [tok] for rid, tok in first.items()}
        groups = [list(params)] if batched else [[rid] for rid in params]
        for step in range(2, 8):
            for group in groups:
                decodes = tuple(
                    DecodeWork(
                        request_id=rid,
                        token_id=out[rid][-1],
                        position=len(prompt) + len(out[rid]) - 1,
                        pages=(shared[:9] + tables[rid][10:]) if rid != "greedy" else tables[rid],
                    )
                    for rid in group
                )
                for done, tok in runner.execute(StepPlan(step=step, decodes=decodes)).sampled:
                    out[done].append(tok)
        return out

    alone, together = run(batched=False), run(batched=True)
    assert alone == together
    assert alone["hot"] != alone["greedy"]  # a temperature-1.5 draw over 512 tokens differs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be a number >= 0, got -1.0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "got 1.5"),
        ({"top_k": -1}, "top_k must be an int >= 0, got -1"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ({"seed": -5}, "seed must be an int >= 0, got -5"),
        ({"stop_token_ids": (1, -2)}, "got -2"),
        ({"temperature": True}, "got True"),
    ],
)
def test_bad_sampling_params_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-38, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9, 30.0, 29.9])
    for seed in range(5):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
        assert sampler.sample(logits) == 4


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-46, 1e-300])
def test_a_top_p_below_float32_keeps_the_most_likely_token(top_p: float) -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for seed in range(5):
        assert Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=seed)).sample(logits) == 1


@settings(max_examples=100)
@given(
    logits=logits_st,
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(0, 50),
    seed=st.integers(0, 2**32),
)
def test_every_accepted_sampling_value_samples_a_token(
    logits: Any, temperature: float, top_p: float, top_k: int, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    assert 0 <= Sampler(params).sample(logits) < logits.numel()


def test_min_tokens_leaves_out_stop_tokens_until_reached() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])  # token 1 is the most likely
    sampler = Sampler(SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(1, 3)))
    assert [sampler.sample(logits) for _ in range(3)] == [2, 2, 1]
    # a stop set that covers the whole vocabulary leaves something to sample
    every = Sampler(SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=range(4)))
    assert every.sample(logits) == 1
    with pytest.raises(ConfigError, match=r"min_tokens \(6\) must be <= max_tokens \(5\)"):
        SamplingParams(max_tokens=5, min_tokens=6)
