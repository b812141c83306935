"""TransformersRunner and PagedKVPool: reusing pages gives the logits of a full prefill.

Every expectation comes from the model itself: a plain full forward over the same tokens,
without any cache, is the reference.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefixflight.backends.torch import PagedKVPool, TransformersRunner  # noqa: E402
from prefixflight.core import (  # noqa: E402
    ConfigError,
    DecodeWork,
    PrefillWork,
    RequestId,
    StepPlan,
    UsageError,
)

pytestmark = pytest.mark.torch

ATOL = 1e-4
VOCAB = 512
FAST = settings(max_examples=25)


def full_logits(model: Any, tokens: tuple[int, ...]) -> Any:
    """The reference: last-position logits of one forward pass over all of ``tokens``."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def greedy_reference(model: Any, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy tokens, recomputing everything from scratch at every step (no cache at all)."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        tok = int(full_logits(model, tuple(seq)).argmax())
        out.append(tok)
        seq.append(tok)
    return out


def make_runner(model: Any, *, num_pages: int, block_size: int) -> TransformersRunner:
    return TransformersRunner.for_model(
        model, num_pages=num_pages, block_size=block_size, device="cpu"
    )


def page_table(rng: random.Random, free: list[int], n: int) -> tuple[int, ...]:
    """``n`` pages taken from ``free`` in random order (pages need not be contiguous)."""
    rng.shuffle(free)
    taken, free[:] = free[:n], free[n:]
    return tuple(taken)


def pages_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=70).map(tuple)


@FAST
@given(prompt=tokens_st, block_size=st.integers(1, 8), data=st.data())
def test_chunked_prefill_equals_full_prefill(
    tiny_model: Any, prompt: tuple[int, ...], block_size: int, data: st.DataObject
) -> None:
    cuts = (
        sorted(data.draw(st.sets(st.integers(1, len(prompt) - 1), max_size=3)))
        if len(prompt) > 1
        else []
    )
    bounds = [0, *cuts, len(prompt)]
    runner = make_runner(tiny_model, num_pages=32, block_size=block_size)
    pages = page_table(
        random.Random(len(prompt)),
        list(range(runner.pool.num_pages)),
        pages_for(len(prompt), block_size),
    )
    for step, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = b == len(prompt)
        work = PrefillWork(request_id="r", token_ids=prompt[a:b], start=a, pages=pages, sample=last)
        result = runner.execute(StepPlan(step=step, prefills=(work,)))
        assert [rid for rid, _ in result.sampled] == (["r"] if last else [])
    expected = full_logits(tiny_model, prompt)
    torch.testing.assert_close(runner.last_logits["r"], expected, atol=ATOL, rtol=0)
    assert result.sampled == (("r", int(expected.argmax())),)


@FAST
@given(
    shared=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=60).map(tuple),
    tail_a=tokens_st,
    tail_b=tokens_st,
    block_size=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_reusing_another_requests_pages_equals_full_prefill(
    tiny_model: Any,
    shared: tuple[int, ...],
    tail_a: tuple[int, ...],
    tail_b: tuple[int, ...],
    block_size: int,
    seed: int,
) -> None:
    """B reuses every full page A computed over their common prefix and prefills the rest."""
    a, b = shared + tail_a, shared + tail_b
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    reused_pages = min(common, len(b) - 1) // block_size  # always compute B's last token
    rng = random.Random(seed)
    runner = make_runner(tiny_model, num_pages=2 * 130 + 1, block_size=block_size)  # a, b, 1
    free = list(range(runner.pool.num_pages))
    pages_a = page_table(rng, free, pages_for(len(a), block_size))
    runner.execute(
        StepPlan(
            step=0,
            prefills=(
                PrefillWork(request_id="a", token_ids=a, start=0, pages=pages_a, sample=True),
            ),
        )
    )
    start = reused_pages * block_size
    pages_b = pages_a[:reused_pages] + page_table(
        rng, free, pages_for(len(b), block_size) - reused_pages
    )
    work = PrefillWork(request_id="b", token_ids=b[start:], start=start, pages=pages_b, sample=True)
    runner.execute(StepPlan(step=1, prefills=(work,)))
    torch.testing.assert_close(
        runner.last_logits["b"], full_logits(tiny_model, b), atol=ATOL, rtol=0
    )
    # A's pages are untouched by B: A still decodes as if alone.
    tok = int(runner.last_logits.get("a", full_logits(tiny_model, a)).argmax())
    runner.execute(
        StepPlan(
            step=2,
            decodes=(
                DecodeWork(
                    request_id="a",
                    token_id=tok,
                    position=len(a),
                    pages=pages_a + page_table(rng, free, 1),
                ),
            ),
        )
    )
    torch.testing.assert_close(
        runner.last_logits["a"], full_logits(tiny_model, (*a, tok)), atol=ATOL, rtol=0
    )


@FAST
@given(
    prompts=st.lists(tokens_st, min_size=1, max_size=4),
    block_size=st.integers(1, 8),
    steps=st.integers(1, 6),
    data=st.data(),
)
def test_batched_greedy_decode_matches_recomputation(
    tiny_model: Any,
    prompts: list[tuple[int, ...]],
    block_size: int,
    steps: int,
    data: st.DataObject,
) -> None:
    """Requests of different lengths decode together (padded batch) and each one's greedy
    tokens and logits equal a from-scratch recomputation of that request alone."""
    rng = random.Random(len(prompts) * 1000 + steps)
    runner = make_runner(tiny_model, num_pages=200, block_size=block_size)
    free = list(range(runner.pool.num_pages))
    tables = {}
    prefills = []
    for i, p in enumerate(prompts):
        tables[i] = page_table(rng, free, pages_for(len(p) + steps, block_size))
        prefills.append(
            PrefillWork(request_id=i, token_ids=p, start=0, pages=tables[i], sample=True)
        )
    result = runner.execute(StepPlan(step=0, prefills=tuple(prefills)))
    generated = {rid: [tok] for rid, tok in result.sampled}
    for step in range(1, steps):
        live = data.draw(
            st.sets(st.sampled_from(range(len(prompts))), min_size=1), label=f"batch {step}"
        )
        decodes = []
        for i in sorted(live):
            pos = len(prompts[i]) + len(generated[i]) - 1
            decodes.append(
                DecodeWork(request_id=i, token_id=generated[i][-1], position=pos, pages=tables[i])
            )
        result = runner.execute(StepPlan(step=step, decodes=tuple(decodes)))
        for rid, tok in result.sampled:
            seq = (*prompts[int(rid)], *generated[int(rid)])
            torch.testing.assert_close(
                runner.last_logits[rid], full_logits(tiny_model, seq), atol=ATOL, rtol=0
            )
            generated[int(rid)].append(tok)
    for i, p in enumerate(prompts):
        assert generated[i] == greedy_reference(tiny_model, p, len(generated[i]))


def test_mixed_step_prefill_and_decode(tiny_model: Any) -> None:
    """One plan with a prefill (over reused pages) and decodes returns prefills first."""
    g = torch.Generator().manual_seed(3)
    prompt = tuple(torch.randint(0, VOCAB, (40,), generator=g).tolist())
    runner = make_runner(tiny_model, num_pages=40, block_size=4)
    pages_a = tuple(range(12))
    first = runner.execute(
        StepPlan(
            step=0,
            prefills=(
                PrefillWork(request_id="a", token_ids=prompt, start=0, pages=pages_a, sample=True),
            ),
        )
    )
    tok = first.sampled[0][1]
    pages_b = (*pages_a[:9], 20, 21, 22)  # 36 tokens reused, 4 computed
    plan = StepPlan(
        step=1,
        prefills=(
            PrefillWork(
                request_id="b", token_ids=prompt[36:], start=36, pages=pages_b, sample=True
            ),
        ),
        decodes=(DecodeWork(request_id="a", token_id=tok, position=40, pages=pages_a),),
    )
    result = runner.execute(plan)
    assert [rid for rid, _ in result.sampled] == ["b", "a"]
    torch.testing.assert_close(
        runner.last_logits["b"], full_logits(tiny_model, prompt), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        runner.last_logits["a"], full_logits(tiny_model, (*prompt, tok)), atol=ATOL, rtol=0
    )
    assert result.sampled[0][1] == tok  # same prompt, same greedy first token


@pytest.mark.parametrize(
    ("work", "message"),
    [
        (
            PrefillWork(request_id="x", token_ids=(), start=0, pages=(0,), sample=True),
            "at least one token",
        ),
        (PrefillWork(request_id="x", token_ids=(1,), start=-1, pages=(0,), sample=True), "-1"),
        (
            PrefillWork(request_id="x", token_ids=(VOCAB,), start=0, pages=(0,), sample=True),
            str(VOCAB),
        ),
        (
            PrefillWork(request_id="x", token_ids=(1,) * 9, start=0, pages=(0, 1), sample=True),
            "need 9",
        ),
        (PrefillWork(request_id="x", token_ids=(1,), start=0, pages=(99,), sample=True), "page 99"),
        (DecodeWork(request_id="x", token_id=1, position=8, pages=(0, 1)), "need 9"),
        (DecodeWork(request_id="x", token_id=-3, position=0, pages=(0,)), "-3"),
        (DecodeWork(request_id="x", token_id=1, position=-2, pages=(0,)), "-2"),
    ],
)
def test_bad_plan_is_rejected_and_writes_nothing(tiny_model: Any, work: Any, message: str) -> None:
    runner = make_runner(tiny_model, num_pages=8, block_size=4)
    ok = PrefillWork(request_id="ok", token_ids=tuple(range(8)), start=0, pages=(2, 3), sample=True)
    runner.execute(StepPlan(step=0, prefills=(ok,)))
    before = [runner.pool.page_tensor(p) for p in range(8)]
    logits_before = dict(runner.last_logits)
    plan = StepPlan(
        step=1,
        prefills=(ok,) if isinstance(work, DecodeWork) else (ok, work),
        decodes=(work,) if isinstance(work, DecodeWork) else (),
    )
    with pytest.raises(UsageError, match=message):
        runner.execute(plan)
    assert all(torch.equal(b, runner.pool.page_tensor(p)) for p, b in enumerate(before))
    assert runner.last_logits.keys() == logits_before.keys()


def test_duplicate_request_in_one_plan_is_rejected(tiny_model: Any) -> None:
    runner = make_runner(tiny_model, num_pages=8, block_size=4)
    w = PrefillWork(request_id=7, token_ids=(1, 2), start=0, pages=(0,), sample=True)
    d = DecodeWork(request_id=7, token_id=1, position=2, pages=(0,))
    with pytest.raises(UsageError, match="request 7 appears twice"):
        runner.execute(StepPlan(step=0, prefills=(w,), decodes=(d,)))


def test_pool_shape_must_fit_the_model(tiny_factory: Any) -> None:
    model = tiny_factory("llama", 0)
    pool = PagedKVPool(num_layers=3, num_kv_heads=2, head_dim=16, num_pages=4, device="cpu")
    with pytest.raises(ConfigError, match=r"\(3, 2, 16\)"):
        TransformersRunner(model, pool)


def test_pool_write_and_gather_round_trip() -> None:
    pool = PagedKVPool(
        num_layers=2,
        num_kv_heads=3,
        head_dim=4,
        num_pages=5,
        block_size=4,
        device="cpu",
        dtype="float32",
    )
    assert pool.bytes_per_token == 2 * 2 * 3 * 4 * 4
    assert pool.nbytes == pool.bytes_per_token * 5 * 4
    pages = (4, 1, 3)
    slots = pool.slots(pages, 2, 11)
    assert slots.tolist() == [18, 19, 4, 5, 6, 7, 12, 13, 14]
    kv = torch.randn(2, 2, 9, 3, 4)
    pool.write(slots, kv)
    assert torch.equal(pool.gather(slots), kv)
    assert torch.equal(pool.page_tensor(1), kv[:, :, 2:6])


def test_default_dtype_is_bf16_where_the_cpu_has_it(tiny_factory: Any) -> None:
    """bf16 on a CPU with native bf16 (AVX512-BF16/AMX), fp32 elsewhere; a pool made for a
    model takes the model's dtype unless told otherwise."""
    from prefixflight.backends.torch._device import native_bf16

    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=2, device="cpu")
    assert pool.dtype == (torch.bfloat16 if native_bf16() else torch.float32)
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert native_bf16()
    model = tiny_factory("llama", 1).to(torch.bfloat16)
    assert TransformersRunner.for_model(model, num_pages=2, device="cpu").pool.dtype == (
        torch.bfloat16
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_pages": 0}, "num_pages must be >= 1, got 0"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"device": "tpu"}, "'tpu'"),
        ({"dtype": "int8"}, "'int8'"),
    ],
)
def test_pool_config_errors_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 2,
        "num_pages": 2,
    } | kwargs
    with pytest.raises(ConfigError, match=message):
        PagedKVPool(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_request_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=2, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reuse_on_cuda_matches_full_prefill(tiny_model: Any) -> None:
    model = tiny_model.to("cuda", torch.float32)
    try:
        runner = TransformersRunner.for_model(
            model, num_pages=32, block_size=4, device="cuda", dtype="fp32"
        )
        prompt = tuple(range(1, 51))
        runner.execute(
            StepPlan(
                step=0,
                prefills=(
                    PrefillWork(
                        request_id="a",
                        token_ids=prompt,
                        start=0,
                        pages=tuple(range(13)),
                        sample=True,
                    ),
                ),
            )
        )
        pages_b = (*tuple(range(10)), 20, 21, 22)
        runner.execute(
            StepPlan(
                step=1,
                prefills=(
                    PrefillWork(
                        request_id="b", token_ids=prompt[40:], start=40, pages=pages_b, sample=True
                    ),
                ),
            )
        )
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([prompt], device="cuda")).logits[0, -1]
        torch.testing.assert_close(runner.last_logits["b"], ref, atol=ATOL, rtol=0)
    finally:
        tiny_model.to("cpu")


@FAST
@given(
    prompts=st.lists(tokens_st, min_size=2, max_size=5),
    block_size=st.integers(1, 8),
    long_chunk=st.sampled_from([1, 8, 64, 10**6]),
    data=st.data(),
)
def test_one_plan_of_many_chunks_equals_full_prefills(
    tiny_model: Any,
    prompts: list[tuple[int, ...]],
    block_size: int,
    long_chunk: int,
    data: st.DataObject,
) -> None:
    """Several requests each resume at a random point in one plan: however the runner
    batches them (padded rows, cold rows with no context, long rows alone) every request's
    logits equal its own full prefill."""
    rng = random.Random(block_size * 7 + len(prompts))
    runner = TransformersRunner.for_model(
        tiny_model, num_pages=200, block_size=block_size, device="cpu", long_chunk=long_chunk
    )
    free = list(range(runner.pool.num_pages))
    tables, starts = [], []
    for i, p in enumerate(prompts):
        tables.append(page_table(rng, free, pages_for(len(p), block_size)))
        start = data.draw(st.integers(0, len(p) - 1), label=f"start {i}")
        starts.append(start)
        if start:
            work = PrefillWork(
                request_id=i, token_ids=p[:start], start=0, pages=tables[i], sample=False
            )
            runner.execute(StepPlan(step=0, prefills=(work,)))
    plan = StepPlan(
        step=1,
        prefills=tuple(
            PrefillWork(request_id=i, token_ids=p[s:], start=s, pages=t, sample=True)
            for i, (p, s, t) in enumerate(zip(prompts, starts, tables, strict=True))
        ),
    )
    result = runner.execute(plan)
    assert [rid for rid, _ in result.sampled] == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        torch.testing.assert_close(
            runner.last_logits[i], full_logits(tiny_model, p), atol=ATOL, rtol=0
        )


@given(lengths=st.lists(st.integers(1, 100), max_size=12), long_chunk=st.integers(1, 80))
def test_batches_cover_every_row_once_and_keep_long_chunks_alone(
    lengths: list[int], long_chunk: int
) -> None:
    from prefixflight.backends.torch._runner import _batches, _Row

    rows = [_Row(i, (0,) * n, 0, (), True) for i, n in enumerate(lengths)]
    groups = _batches(rows, long_chunk)
    assert sorted(r.request_id for g in groups for r in g) == list(range(len(rows)))
    for g in groups:
        assert g
        if any(len(r.tokens) >= long_chunk for r in g):
            assert len(g) == 1
        real = sum(len(r.tokens) for r in g)
        assert len(g) * max(len(r.tokens) for r in g) <= 2 * real


@FAST
@given(
    shared=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40).map(tuple),
    tails=st.lists(st.sampled_from([(1,), (2, 3), (1, 2, 3), (7,)]), min_size=1, max_size=6),
    block_size=st.integers(1, 8),
    deduplicate=st.booleans(),
)
def test_identical_rows_over_shared_pages_are_computed_once(
    tiny_model: Any,
    shared: tuple[int, ...],
    tails: list[tuple[int, ...]],
    block_size: int,
    deduplicate: bool,
) -> None:
    """Requests continuing from the same cached pages with the same tokens (a flight's
    followers) are one computation; each still gets its own KV pages and logits, and then
    decodes exactly as if computed alone."""
    rng = random.Random(len(shared) * 31 + len(tails))
    runner = TransformersRunner.for_model(
        tiny_model, num_pages=300, block_size=block_size, device="cpu", deduplicate=deduplicate
    )
    free = list(range(runner.pool.num_pages))
    reused = len(shared) // block_size
    start = reused * block_size
    cached = page_table(rng, free, max(reused, 1))[:reused]
    if start:
        work = PrefillWork(
            request_id="seed",
            token_ids=shared[:start],
            start=0,
            pages=cached + page_table(rng, free, 1),
            sample=False,
        )
        runner.execute(StepPlan(step=0, prefills=(work,)))
    prompts, tables, works = [], [], []
    for i, tail in enumerate(tails):
        prompt = shared + tail
        prompts.append(prompt)
        tables.append(
            cached + page_table(rng, free, pages_for(len(prompt) + 1, block_size) - reused)
        )
        works.append(
            PrefillWork(
                request_id=i, token_ids=prompt[start:], start=start, pages=tables[i], sample=True
            )
        )
    result = runner.execute(StepPlan(step=1, prefills=tuple(works)))
    distinct = len({prompt for prompt in prompts}) if start else len(prompts)
    assert runner.deduplicated_rows == ((len(prompts) - distinct) if deduplicate else 0)
    if deduplicate and start:
        computed = {prompt[start:] for prompt in prompts}
        skipped = sum(len(p) - start for p in prompts) - sum(len(t) for t in computed)
        assert runner.deduplicated_tokens == skipped
    else:
        assert runner.deduplicated_tokens == 0
    decodes = []
    for (rid, tok), prompt, table in zip(result.sampled, prompts, tables, strict=True):
        torch.testing.assert_close(
            runner.last_logits[rid], full_logits(tiny_model, prompt), atol=ATOL, rtol=0
        )
        decodes.append(DecodeWork(request_id=rid, token_id=tok, position=len(prompt), pages=table))
    runner.execute(StepPlan(step=2, decodes=tuple(decodes)))
    for d, prompt in zip(decodes, prompts, strict=True):
        expected = full_logits(tiny_model, (*prompt, d.token_id))
        torch.testing.assert_close(runner.last_logits[d.request_id], expected, atol=ATOL, rtol=0)


@FAST
@given(
    length=st.integers(1, 20),
    count=st.integers(1, 4),
    block_size=st.integers(1, 8),
    data=st.data(),
)
def test_decode_reuse_equals_gathering_every_step(
    tiny_model: Any, length: int, count: int, block_size: int, data: st.DataObject
) -> None:
    """Reusing a decode pass's cache gives exactly the reference path's logits and tokens.

    Two runners (``reuse_decode`` on and off) run the same plans: equal-length prompts
    decode together (the reusable case), while random steps drop requests from the batch,
    join a new request (a prefill writes the pool) or run a request alone.
    """
    g = torch.Generator().manual_seed(length * 10 + count)
    prompts = [tuple(torch.randint(0, VOCAB, (length,), generator=g).tolist()) for _ in range(5)]
    runners = [
        TransformersRunner.for_model(
            tiny_model,
            num_pages=160,
            block_size=block_size,
            device="cpu",
            reuse_decode=reuse,
            attention="gather",
        )
        for reuse in (True, False)
    ]
    steps = 6
    tables = {
        i: tuple(range(i * 32, i * 32 + pages_for(length + steps + 1, block_size)))
        for i in range(5)
    }
    generated: dict[int, list[int]] = {}

    def run(plan: StepPlan) -> None:
        results = [r.execute(plan) for r in runners]
        assert results[0] == results[1]
        for rid in runners[1].last_logits:
            assert torch.equal(runners[0].last_logits[rid], runners[1].last_logits[rid])
        for rid, tok in results[0].sampled:
            generated.setdefault(int(rid), []).append(tok)

    first = tuple(
        PrefillWork(request_id=i, token_ids=prompts[i], start=0, pages=tables[i], sample=True)
        for i in range(count)
    )
    run(StepPlan(step=0, prefills=first))
    live = list(range(count))
    for step in range(1, steps):
        action = data.draw(st.sampled_from(["same", "same", "drop", "join", "alone"]))
        batch = live
        prefills: tuple[PrefillWork, ...] = ()
        if action == "drop" and len(live) > 1:
            live = batch = live[1:]
        elif action == "join" and len(generated) < 5:
            new = len(generated)
            prefills = (
                PrefillWork(
                    request_id=new, token_ids=prompts[new], start=0, pages=tables[new], sample=True
                ),
            )
        elif action == "alone":
            batch = live[-1:]
        decodes = tuple(
            DecodeWork(
                request_id=i,
                token_id=generated[i][-1],
                position=length + len(generated[i]) - 1,
                pages=tables[i],
            )
            for i in batch
        )
        run(StepPlan(step=step, prefills=prefills, decodes=decodes))
        live = sorted({*live, *(int(p.request_id) for p in prefills)})
    assert runners[1].reused_passes == 0
    for i, toks in generated.items():
        assert toks == greedy_reference(tiny_model, prompts[i], len(toks))


def test_decode_reuse_happens_for_a_steady_batch(tiny_model: Any) -> None:
    """Equal-length requests decoding together reuse every pass after the first decode."""
    runner = TransformersRunner.for_model(
        tiny_model, num_pages=64, block_size=4, device="cpu", attention="gather"
    )
    prompts = [tuple(range(i, i + 10)) for i in range(3)]
    tables = {i: tuple(range(i * 8, i * 8 + 8)) for i in range(3)}
    result = runner.execute(
        StepPlan(
            step=0,
            prefills=tuple(
                PrefillWork(request_id=i, token_ids=p, start=0, pages=tables[i], sample=True)
                for i, p in enumerate(prompts)
            ),
        )
    )
    seqs = {int(i): [*prompts[int(i)], tok] for i, tok in result.sampled}
    for step in range(1, 6):
        plan = StepPlan(
            step=step,
            decodes=tuple(
                DecodeWork(request_id=i, token_id=s[-1], position=len(s) - 1, pages=tables[i])
                for i, s in seqs.items()
            ),
        )
        for rid, tok in runner.execute(plan).sampled:
            torch.testing.assert_close(
                runner.last_logits[rid],
                full_logits(tiny_model, tuple(seqs[int(rid)])),
                atol=ATOL,
                rtol=0,
            )
            seqs[int(rid)].append(tok)
    assert runner.reused_passes == 4  # the first decode gathers, the next four reuse
    # Anything written into the pool in between (here: a copy into an unused page) makes
    # the next pass gather again.
    pool = runner.pool
    spare = pool.slots((60,), 0, 1)
    pool.copy(pool.slots(tables[0], 0, 1), spare)
    plan = StepPlan(
        step=6,
        decodes=tuple(
            DecodeWork(request_id=i, token_id=s[-1], position=len(s) - 1, pages=tables[i])
            for i, s in seqs.items()
        ),
    )
    runner.execute(plan)
    assert runner.reused_passes == 4


@FAST
@given(
    shared=st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=40).map(tuple),
    tails=st.lists(st.sampled_from([(), (1,), (2, 3), (1, 2, 3), (7,) * 9]), max_size=8),
    first_chunk=st.integers(0, 40),
    block_size=st.integers(1, 8),
    attention=st.sampled_from(["paged", "gather"]),
    deduplicate=st.booleans(),
)
def test_a_row_reads_pages_its_writer_writes_in_the_same_step(
    tiny_model: Any,
    shared: tuple[int, ...],
    tails: list[tuple[int, ...]],
    first_chunk: int,
    block_size: int,
    attention: str,
    deduplicate: bool,
) -> None:
    """Same-step sharing: a writer finishes its prompt in one step (after an optional earlier
    chunk) and readers admitted in that step attend over the pages it writes there
    (``reads_from``). Every reader gets the logits of a full prefill, whatever the rows'
    lengths make of the forward passes (a short writer among shorter readers included),
    on both attention paths, with and without deduplication."""
    rng = random.Random(len(shared) * 97 + len(tails) * 7 + first_chunk)
    runner = TransformersRunner.for_model(
        tiny_model,
        num_pages=400,
        block_size=block_size,
        device="cpu",
        deduplicate=deduplicate,
        attention=attention,
        long_chunk=16,
    )
    free = list(range(runner.pool.num_pages))
    writer = (*shared, 5)
    w_pages = page_table(rng, free, pages_for(len(writer), block_size))
    cut = min(first_chunk, len(writer) - 1) // block_size * block_size
    if cut:
        work = PrefillWork(
            request_id="w", token_ids=writer[:cut], start=0, pages=w_pages, sample=False
        )
        runner.execute(StepPlan(step=0, prefills=(work,)))
    works = [
        PrefillWork(request_id="w", token_ids=writer[cut:], start=cut, pages=w_pages, sample=True)
    ]
    prompts: dict[RequestId, tuple[int, ...]] = {"w": writer}
    for i, tail in enumerate(tails):
        prompt = shared + tail
        if len(prompt) < 2:
            continue
        reused = min(len(shared), len(prompt) - 1) // block_size  # full blocks "w" writes
        start = reused * block_size
        pages = w_pages[:reused] + page_table(
            rng, free, pages_for(len(prompt), block_size) - reused
        )
        reads = ("w",) if start > cut else ()
        works.append(
            PrefillWork(
                request_id=i,
                token_ids=prompt[start:],
                start=start,
                pages=pages,
                sample=True,
                reads_from=reads,
            )
        )
        prompts[i] = prompt
    runner.execute(StepPlan(step=1, prefills=tuple(works)))
    for rid, prompt in prompts.items():
        torch.testing.assert_close(
            runner.last_logits[rid], full_logits(tiny_model, prompt), atol=ATOL, rtol=0
        )


def test_readers_run_after_their_writers_even_when_shorter() -> None:
    """The case the row grouping alone gets wrong: a 12-token writer and 2-token readers;
    sorted by length the readers would run in an earlier pass than the writer."""
    from prefixflight.backends.torch._runner import _batches, _levels, _Row

    writer = _Row("w", (0,) * 12, 8, (), True)
    readers = [_Row(i, (0,) * 2, 16, (), True, ("w",)) for i in range(8)]
    passes = [g for level in _levels([writer, *readers]) for g in _batches(level, 64)]
    order = {r.request_id: n for n, g in enumerate(passes) for r in g}
    assert all(order[i] > order["w"] for i in range(8))
    alone = {r.request_id: n for n, g in enumerate(_batches([writer, *readers], 64)) for r in g}
    assert min(alone[i] for i in range(8)) < alone["w"], "grouping alone runs a reader first"


def test_page_size_is_a_deprecated_name_of_block_size(tiny_factory: Any) -> None:
    shape: dict[str, Any] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "num_pages": 2}
    with pytest.warns(DeprecationWarning, match="PagedKVPool's page_size is now block_size"):
        pool = PagedKVPool(**shape, page_size=8, device="cpu")
    assert pool.block_size == 8
    with pytest.warns(DeprecationWarning, match="page_size is now block_size"):
        assert pool.page_size == 8
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="block_size=4"):
        PagedKVPool(**shape, block_size=4, page_size=8)
    model = tiny_factory("llama", 0)
    with pytest.warns(DeprecationWarning, match="TransformersRunner's page_size") as seen:
        runner = TransformersRunner.for_model(model, num_pages=2, page_size=8, device="cpu")
    assert seen[0].filename == __file__  # the warning points at the caller
    assert runner.pool.block_size == 8
