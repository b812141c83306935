"""The paged attention path against the gather path (the reference).

Two runners over two pools run the same plans on the same model: ``attention="paged"``
(keys and values written and read inside each attention layer, no ``DynamicCache``; the
runner's fused forward, or with ``fused=False`` the model's own modules) and
``attention="gather"`` (each row's context gathered into a ``DynamicCache`` first, the
model's own forward). Every step's sampled tokens must be identical and every sampled row's
logits within 1e-4 (fp32).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefixflight.backends.torch import TransformersRunner  # noqa: E402
from prefixflight.backends.torch._paged import PagedStep  # noqa: E402
from prefixflight.core import ConfigError, DecodeWork, PrefillWork, StepPlan  # noqa: E402

from .conftest import run  # noqa: E402

pytestmark = pytest.mark.torch

ATOL = 1e-4
VOCAB = 512


def runners(
    model: Any,
    *,
    num_pages: int,
    block_size: int,
    long_chunk: int = 64,
    device: str = "cpu",
    fused: bool = True,
    attention: str = "paged",
    vllm_library: Any = None,
) -> tuple[TransformersRunner, TransformersRunner]:
    """(``attention``, gather) runners with pools of their own, fp32."""
    paged, gather = (
        TransformersRunner.for_model(
            model,
            num_pages=num_pages,
            block_size=block_size,
            device=device,
            dtype="float32",
            long_chunk=long_chunk,
            attention=name,
            fused=fused,
            vllm_library=library,
        )
        for name, library in ((attention, vllm_library), ("gather", None))
    )
    assert paged.fused == fused
    return paged, gather


def run_mixed(
    model: Any,
    prompts: list[tuple[int, ...]],
    *,
    block_size: int,
    long_chunk: int,
    new_tokens: int,
    rng: random.Random,
    device: str = "cpu",
    fused: bool = True,
    leaders: int = 1,
    attention: str = "paged",
    vllm_library: Any = None,
) -> dict[int, list[int]]:
    """Run ``attention`` and the gather path over the same mixed plans; return the greedy
    tokens per request.

    The first ``leaders`` requests are prefilled alone first, one step each. Every other
    request reuses the full pages of the leader it shares the longest prefix with (the
    groups of a GRPO burst, with ``leaders`` groups) and prefills the rest in random chunks,
    in the same plans as the decodes of the requests already running (so rows of different
    context lengths, chunk sizes and cached prefixes share passes). Asserts equality at
    every step.
    """
    ps = block_size
    per = -(-(max(map(len, prompts)) + new_tokens) // ps)
    paged, gather = runners(
        model,
        num_pages=per * len(prompts) + 1,
        block_size=ps,
        long_chunk=long_chunk,
        device=device,
        fused=fused,
        attention=attention,
        vllm_library=vllm_library,
    )
    free = list(range(1, per * len(prompts) + 1))
    rng.shuffle(free)
    tables: dict[int, tuple[int, ...]] = {}
    done: dict[int, int] = {}  # prompt tokens computed so far
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i in range(leaders):
        tables[i] = tuple(free[:per])
        del free[:per]

    def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for i, p in enumerate(prompts[leaders:], start=leaders):
        lead = max(range(leaders), key=lambda j: common(p, prompts[j]))
        reused = min(common(p, prompts[lead]), len(p) - 1) // ps
        tables[i] = tables[lead][:reused] + tuple(free[: per - reused])
        del free[: per - reused]
        done[i] = reused * ps

    def step(n: int, prefills: list[PrefillWork], decodes: list[DecodeWork]) -> None:
        plan = StepPlan(step=n, prefills=tuple(prefills), decodes=tuple(decodes))
        a, b = paged.execute(plan), gather.execute(plan)
        assert a == b
        assert a.sampled  # every step samples something
        for rid, _ in a.sampled:
            torch.testing.assert_close(
                paged.last_logits[rid], gather.last_logits[rid], atol=ATOL, rtol=0
            )
        for rid, tok in a.sampled:
            out[int(rid)].append(tok)

    for i in range(leaders):
        first = PrefillWork(
            request_id=i, token_ids=prompts[i], start=0, pages=tables[i], sample=True
        )
        step(i, [first], [])
    n = leaders
    while any(len(toks) < new_tokens for toks in out.values()):
        prefills, decodes = [], []
        for i, p in enumerate(prompts):
            if i in done and done[i] < len(p):
                size = rng.randint(1, len(p) - done[i])
                end = done[i] + size
                prefills.append(
                    PrefillWork(
                        request_id=i,
                        token_ids=p[done[i] : end],
                        start=done[i],
                        pages=tables[i],
                        sample=end == len(p),
                    )
                )
                done[i] = end
            elif out[i] and len(out[i]) < new_tokens:
                pos = len(p) + len(out[i]) - 1
                decodes.append(
                    DecodeWork(request_id=i, token_id=out[i][-1], position=pos, pages=tables[i])
                )
        if not any(pf.sample for pf in prefills) and not decodes:
            # only unfinished chunks this step: still run them (nothing sampled), then go on
            plan = StepPlan(step=n, prefills=tuple(prefills))
            assert paged.execute(plan) == gather.execute(plan)
        else:
            step(n, prefills, decodes)
        n += 1
    return out


prompt_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40).map(tuple)


@settings(max_examples=30, deadline=None)
@given(
    shared=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40).map(tuple),
    tails=st.lists(prompt_st, min_size=1, max_size=4),
    block_size=st.integers(1, 8),
    long_chunk=st.integers(1, 24),
    new_tokens=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    fused=st.booleans(),
)
def test_paged_equals_gather_on_mixed_steps(
    tiny_model: Any,
    shared: tuple[int, ...],
    tails: list[tuple[int, ...]],
    block_size: int,
    long_chunk: int,
    new_tokens: int,
    seed: int,
    fused: bool,
) -> None:
    prompts = [shared + t for t in tails]
    out = run_mixed(
        tiny_model,
        prompts,
        block_size=block_size,
        long_chunk=long_chunk,
        new_tokens=new_tokens,
        rng=random.Random(seed),
        fused=fused,
    )
    assert all(len(toks) == new_tokens for toks in out.values())


@settings(max_examples=30, deadline=None)
@given(
    prefixes=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30).map(tuple),
        min_size=2,
        max_size=4,
    ),
    tails=st.lists(st.lists(prompt_st, min_size=1, max_size=3), min_size=4, max_size=4),
    block_size=st.integers(1, 8),
    new_tokens=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_groups_of_rows_over_their_own_shared_pages_equal_gather(
    tiny_model: Any,
    prefixes: list[tuple[int, ...]],
    tails: list[list[tuple[int, ...]]],
    block_size: int,
    new_tokens: int,
    seed: int,
) -> None:
    """Several groups of rows, each over its own leader's pages (a GRPO burst): decodes
    and short chunks attend together, each group's shared pages read once for the group,
    and every step equals the gather reference."""
    leaders = [prefix + tails[g][0] for g, prefix in enumerate(prefixes)]
    rest = [prefix + tail for g, prefix in enumerate(prefixes) for tail in tails[g][1:]]
    out = run_mixed(
        tiny_model,
        leaders + rest,
        block_size=block_size,
        long_chunk=64,
        new_tokens=new_tokens,
        rng=random.Random(seed),
        leaders=len(leaders),
    )
    assert all(len(toks) == new_tokens for toks in out.values())


def test_paged_is_the_default_and_the_choice_is_checked(tiny_model: Any) -> None:
    runner = TransformersRunner.for_model(tiny_model, num_pages=4, device="cpu")
    assert runner.attention == "paged"
    with pytest.raises(ConfigError, match="'flash'"):
        TransformersRunner(tiny_model, runner.pool, attention="flash")


def test_plain_forward_on_a_paged_model_is_plain_sdpa(tiny_factory: Any) -> None:
    """Registering the paged function leaves the model usable with its own cache."""
    plain, paged = tiny_factory("llama", 3), tiny_factory("llama", 3)
    # the model's own modules with paged attention: switches its attention implementation
    TransformersRunner.for_model(paged, num_pages=4, device="cpu", fused=False)
    assert paged.config._attn_implementation != plain.config._attn_implementation
    ids = torch.tensor([[5, 9, 13, 2, 7, 7, 1]])
    with torch.inference_mode():
        a = plain(input_ids=ids[:, :4], use_cache=True)
        b = paged(input_ids=ids[:, :4], use_cache=True)
        la = plain(input_ids=ids[:, 4:], cache=a.cache).logits
        lb = paged(input_ids=ids[:, 4:], cache=b.cache).logits
    assert torch.equal(la, lb)


def test_paged_writes_the_same_kv_as_gather(tiny_model: Any) -> None:
    """The pages hold the same keys and values after a prefill and a decode on both paths."""
    paged, gather = runners(tiny_model, num_pages=8, block_size=4)
    prompt = tuple(range(3, 16))
    pages = (5, 2, 7, 0)
    for r in (paged, gather):
        r.execute(
            StepPlan(
                step=0,
                prefills=(
                    PrefillWork(
                        request_id="a", token_ids=prompt, start=0, pages=pages, sample=True
                    ),
                ),
            )
        )
        r.execute(
            StepPlan(
                step=1, decodes=(DecodeWork(request_id="a", token_id=4, position=13, pages=pages),)
            )
        )
    for page in pages:
        torch.testing.assert_close(
            paged.pool.page_tensor(page), gather.pool.page_tensor(page), atol=1e-5, rtol=0
        )


@pytest.mark.realmodel
def test_smollm2_paged_equals_gather(smollm2: Any) -> None:
    """SmolLM2: three chat prompts sharing a system prompt, mixed chunks and decodes."""
    tok = smollm2.tokenizer
    system = "You are a careful assistant. Answer briefly and precisely. " * 6
    prompts = [
        tuple(
            tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
            )["input_ids"]
        )
        for q in ("What is 2 + 2?", "Name a colour.", "Where is Paris?")
    ]
    out = run_mixed(
        smollm2.model,
        prompts,
        block_size=16,
        long_chunk=64,
        new_tokens=6,
        rng=random.Random(0),
    )
    assert all(len(toks) == 6 for toks in out.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=10, deadline=None)
@given(
    tails=st.lists(prompt_st, min_size=1, max_size=4),
    block_size=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_gather_on_cuda(
    tiny_model: Any, tails: list[tuple[int, ...]], block_size: int, seed: int
) -> None:
    shared = tuple(range(1, 30))
    model = tiny_model.to("cuda", torch.float32)
    try:
        run_mixed(
            model,
            [shared + t for t in tails],
            block_size=block_size,
            long_chunk=8,
            new_tokens=3,
            rng=random.Random(seed),
            device="cuda",
        )
    finally:
        tiny_model.to("cpu")


def teacher_forced_logits(
    runner: TransformersRunner, prompts: list[tuple[int, ...]], forced: list[int], block_size: int
) -> list[Any]:
    """Every sampled row's logits over: request 0 prefilled alone, the others reusing its
    first page and prefilled together, then decode steps of all of them fed ``forced``."""
    per = -(-(max(map(len, prompts)) + len(forced)) // block_size)
    tables = [tuple(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    tables = [tables[0]] + [tables[0][:1] + t[1:] for t in tables[1:]]
    out: list[Any] = []

    def step(n: int, prefills: list[PrefillWork], decodes: list[DecodeWork]) -> None:
        res = runner.execute(StepPlan(step=n, prefills=tuple(prefills), decodes=tuple(decodes)))
        out.extend(runner.last_logits[rid].float() for rid, _ in res.sampled)

    def prefill(i: int, start: int) -> PrefillWork:
        return PrefillWork(
            request_id=i, token_ids=prompts[i][start:], start=start, pages=tables[i], sample=True
        )

    def decode(i: int, tok: int, pos: int) -> DecodeWork:
        return DecodeWork(request_id=i, token_id=tok, position=pos, pages=tables[i])

    step(0, [prefill(0, 0)], [])
    step(
        1,
        [prefill(i, block_size) for i in range(1, len(prompts))],
        [decode(0, forced[0], len(prompts[0]))],
    )
    for k, tok in enumerate(forced[1:], start=1):
        # request 0 decoded once more than the others (in step 1)
        decodes = [decode(i, tok, len(p) + k - (i > 0)) for i, p in enumerate(prompts)]
        step(1 + k, [], decodes)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_logits_within_tolerance_per_dtype(tiny_factory: Any, dtype: str) -> None:
    """The same plans in fp32 and bf16: the fused paged forward's logits stay within each
    dtype's rounding of the gather path's (bf16: a few bf16 steps of the logit scale)."""
    for family in ("llama", "qwen2"):
        model = tiny_factory(family, 5)
        rng = random.Random(3)
        shared = tuple(rng.randrange(VOCAB) for _ in range(8))
        prompts = [shared + tuple(rng.randrange(VOCAB) for _ in range(n)) for n in (9, 3, 14)]
        got = []
        for attention in ("paged", "gather"):
            runner = TransformersRunner.for_model(
                model, num_pages=64, block_size=4, device="cpu", dtype=dtype, attention=attention
            )
            assert runner.fused == (attention == "paged")
            got.append(teacher_forced_logits(runner, prompts, [7, 300, 12, 5], 4))
        scale = max(float(x.abs().max()) for x in got[1])
        tol = ATOL if dtype == "float32" else 0.05 * scale
        for a, b in zip(*got, strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=0)


@pytest.mark.realmodel
def test_smollm2_bf16_paged_close_to_gather(smollm2: Any) -> None:
    """SmolLM2 in bf16 (the CPU default where bf16 is native): the fused paged forward and
    the model's own forward over gathered pages agree to bf16 rounding and pick the same
    greedy token almost everywhere."""
    import copy

    model = copy.deepcopy(smollm2.model).to(torch.bfloat16)
    tok = smollm2.tokenizer
    text = "The harbour city kept its records in a long stone hall near the water. " * 5
    base = tuple(tok(text)["input_ids"])
    prompts = [base + tuple(tok(q)["input_ids"]) for q in (" Why?", " Who kept them?")]
    got = []
    for attention in ("paged", "gather"):
        runner = TransformersRunner.for_model(
            model, num_pages=64, block_size=16, device="cpu", attention=attention
        )
        got.append(teacher_forced_logits(runner, prompts, [330, 2342, 28, 3], 16))
    same = 0
    for a, b in zip(*got, strict=True):
        assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())
        same += int(a.argmax() == b.argmax())
    assert same >= len(got[0]) - 1


@pytest.mark.realmodel
def test_smollm2_bf16_engine_answers_as_transformers_does(smollm2: Any) -> None:
    """Greedy in bf16, the engine's fused forward answers what transformers' own generate
    answers. The fused norm once rounded differently from transformers' (once instead of
    twice), and on a CPU with native bf16 SmolLM2 answered "L'Étoile, la Marseillaise"."""
    import copy

    from prefixflight.backends.torch import AsyncEngine, EngineConfig, SamplingParams

    model = copy.deepcopy(smollm2.model).to(torch.bfloat16)
    tok = smollm2.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    ids = list(getattr(ids, "input_ids", ids))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    want_ids = want[0, len(ids) :].tolist()

    async def ours() -> list[int]:
        engine = AsyncEngine.from_model(
            model, EngineConfig(num_pages=64), device="cpu", eos_token_ids=[eos]
        )
        async with engine:
            return [t async for t in engine.generate(ids, SamplingParams(max_tokens=12))]

    got = run(ours)
    assert tok.decode(got) == tok.decode(want_ids[: len(got)]), (tok.decode(got), want_ids)
    assert "Paris" in tok.decode(got)


def test_unsupported_architecture_runs_its_own_modules(tiny_factory: Any) -> None:
    """A model the fused forward does not know (here Mistral, whose sliding window it does
    not implement) runs its own modules with paged attention, and matches the gather path."""
    import transformers

    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model: Any = transformers.MistralForCausalLM(config)
    model.eval()
    paged, gather = runners(model, num_pages=64, block_size=4, fused=False)
    assert not TransformersRunner.for_model(model, num_pages=4, device="cpu").fused
    prompts = [tuple(range(3, 20)), (*range(3, 11), 40, 41)]
    a = teacher_forced_logits(paged, prompts, [9, 8, 7], 4)
    b = teacher_forced_logits(gather, prompts, [9, 8, 7], 4)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


# -- a lone row's attention: torch's fused CPU kernel against the blocked products ---------
def reference_attention(query: Any, keys: Any, values: Any, start: int, scale: float) -> Any:
    """fp64 causal attention of ``query [n, H, D]`` at positions ``start ..`` over
    ``keys``/``values [G, start + n, D]`` (grouped-query heads: H // G per KV head)."""
    n, heads, _ = query.shape
    group = heads // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # [H, K, D]
    v = values.double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hkd->hnk", query.double() * scale, k)
    seen = torch.arange(keys.shape[1]).view(1, -1) <= torch.arange(start, start + n).view(-1, 1)
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hnk,hkd->nhd", torch.softmax(scores, dim=-1), v)


def lone_row(
    dtype: Any, heads: int, kv_heads: int, n: int, cached: int, block_size: int, seed: int
) -> tuple[Any, list[int], Any, Any, Any]:
    """A pool whose first ``cached`` positions hold random keys and values under a shuffled
    page table, and a new chunk's ``n`` queries, keys and values."""
    from prefixflight.backends.torch import PagedKVPool

    pages = -(-(cached + n) // block_size)
    pool = PagedKVPool(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=16,
        num_pages=pages + 2,
        block_size=block_size,
        device="cpu",
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    for view in pool.layer_views(0):
        view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    table = list(range(2, pages + 2))
    random.Random(seed).shuffle(table)
    q = torch.randn((n, heads, 16), generator=gen).to(dtype)
    k = torch.randn((n, kv_heads, 16), generator=gen).to(dtype)
    v = torch.randn((n, kv_heads, 16), generator=gen).to(dtype)
    return pool, table, q, k, v


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16"]),
    shape=st.sampled_from([(4, 2), (14, 2), (9, 3), (4, 4)]),
    n=st.integers(2, 90),
    cached=st.integers(0, 70),
    block_size=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_lone_row_kernel_matches_products_and_reference(
    dtype: str, shape: tuple[int, int], n: int, cached: int, block_size: int, seed: int
) -> None:
    """A lone row, with and without a cached prefix on scattered pages: the fused kernel
    (causal, or prefix + causal merged by log-sum-exp) and the blocked products both match
    an fp64 reference within the dtype's rounding, and they are the paths taken."""
    from prefixflight.backends.torch import _paged

    dt = getattr(torch, dtype)
    heads, kv_heads = shape
    pool, table, q, k, v = lone_row(dt, heads, kv_heads, n, cached, block_size, seed)
    calls = 0
    real = _paged._FLASH

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    outs = {}
    saved = dict(_paged.FLASH_MIN)
    try:
        _paged._FLASH = counted
        for name, least in (("kernel", 0), ("products", None)):
            _paged.FLASH_MIN.clear()
            if least is not None:
                _paged.FLASH_MIN[dt] = least
            before = calls
            with torch.inference_mode():
                step = PagedStep(pool, [(cached, n, table)], alone=64)
                outs[name] = step.attend(0, q, k, v, 0.25)
            assert calls - before == (0 if least is None else 1 if not cached else 2)
            # the new keys and values are in the pool, where the reference reads them
            keys, values = (
                _paged._gather(view, torch.tensor(table), block_size)[:, : cached + n]
                for view in pool.layer_views(0)
            )
    finally:
        _paged._FLASH = real
        _paged.FLASH_MIN.clear()
        _paged.FLASH_MIN.update(saved)
    want = reference_attention(q, keys, values, cached, 0.25)
    tol = 2e-6 if dtype == "float32" else 4e-2  # bf16: 0.019 the worst of 300 random rows
    for name, out in outs.items():
        assert out.shape == (n, heads, 16) and out.dtype == dt, name
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=0, msg=name)


def test_kernel_choice_follows_dtype_and_keys() -> None:
    """fp32 lone rows take the fused kernel (one causal call without a cached prefix, two
    with one); bf16 rows the products, at any length, and so does a lone decode (one
    query)."""
    from prefixflight.backends.torch import _paged

    calls = []
    real = _paged._FLASH

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].shape[2])  # the keys of each call
        return real(*args, **kwargs)

    cases = [
        ("float32", 0, 5, [5]),
        ("float32", 7, 5, [7, 5]),
        ("float32", 11, 1, []),
        ("bfloat16", 0, 40, []),
        ("bfloat16", 9000, 8, []),
    ]
    try:
        _paged._FLASH = counted
        for dtype, cached, n, want in cases:
            dt = getattr(torch, dtype)
            pool, table, q, k, v = lone_row(dt, 4, 2, n, cached, 16, 0)
            calls.clear()
            with torch.inference_mode():
                PagedStep(pool, [(cached, n, table)]).attend(0, q, k, v, 0.25)
            assert calls == want, (dtype, cached, n)
    finally:
        _paged._FLASH = real


@settings(max_examples=15, deadline=None)
@given(
    shared=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40).map(tuple),
    tails=st.lists(prompt_st, min_size=2, max_size=4),
    block_size=st.integers(1, 8),
    long_chunk=st.integers(2, 24),
    seed=st.integers(0, 2**16),
)
def test_rows_one_by_one_through_the_kernel_equal_gather(
    tiny_model: Any,
    shared: tuple[int, ...],
    tails: list[tuple[int, ...]],
    block_size: int,
    long_chunk: int,
    seed: int,
) -> None:
    """With `PER_ROW_MIN` at 0 for fp32, the rows a step would attend together (decodes,
    short chunks) each run alone through the fused kernel: still the gather path's tokens
    and logits, and the kernel is what ran them."""
    from prefixflight.backends.torch import _paged

    calls = 0
    real = _paged._FLASH

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    saved = dict(_paged.PER_ROW_MIN)
    try:
        _paged._FLASH = counted
        _paged.PER_ROW_MIN[torch.float32] = 0
        run_mixed(
            tiny_model,
            [shared + t for t in tails],
            block_size=block_size,
            long_chunk=long_chunk,
            new_tokens=3,
            rng=random.Random(seed),
        )
    finally:
        _paged._FLASH = real
        _paged.PER_ROW_MIN.clear()
        _paged.PER_ROW_MIN.update(saved)
    assert calls


def test_batched_rows_go_one_by_one_from_per_row_min_keys() -> None:
    """fp32 decode rows over fewer than `PER_ROW_MIN` keys past their shared pages are
    attended together (no kernel call); from that many on, one kernel call each (a decode:
    one call, no mask); bf16 rows always together."""
    from prefixflight.backends.torch import PagedKVPool, _paged

    calls = []
    real = _paged._FLASH

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("is_causal", False))
        return real(*args, **kwargs)

    least = _paged.PER_ROW_MIN[torch.float32]
    try:
        _paged._FLASH = counted
        for dtype, context, want in (
            ("float32", least - 40, []),
            ("float32", least, [False, False, False]),
            ("bfloat16", least + 500, []),
        ):
            dt = getattr(torch, dtype)
            pages = -(-(context + 1) // 16)
            pool = PagedKVPool(
                num_layers=1,
                num_kv_heads=2,
                head_dim=16,
                num_pages=3 * pages,
                block_size=16,
                device="cpu",
                dtype=dt,
            )
            tables = [list(range(r * pages, (r + 1) * pages)) for r in range(3)]
            q = torch.randn((3, 4, 16)).to(dt)
            k, v = torch.randn((3, 2, 16)).to(dt), torch.randn((3, 2, 16)).to(dt)
            calls.clear()
            with torch.inference_mode():
                step = PagedStep(pool, [(context - r, 1, tables[r]) for r in range(3)])
                out = step.attend(0, q, k, v, 0.25)
            assert calls == want, (dtype, context)
            saved = dict(_paged.PER_ROW_MIN)
            _paged.PER_ROW_MIN.clear()  # the same rows together: the same attention
            try:
                with torch.inference_mode():
                    step = PagedStep(pool, [(context - r, 1, tables[r]) for r in range(3)])
                    together = step.attend(0, q, k, v, 0.25)
            finally:
                _paged.PER_ROW_MIN.update(saved)
            tol = 1e-5 if dtype == "float32" else 0.0
            torch.testing.assert_close(out, together, atol=tol, rtol=0)
    finally:
        _paged._FLASH = real
