"""The OpenAI-compatible server, for real: uvicorn on a free loopback port, driven by the
``openai`` client (streaming and not) and by ``httpx`` for raw framing and errors.

Expected text comes from the model alone (a from-scratch greedy recomputation, decoded by
the test codec); expected reuse from the page arithmetic of the prompt (pages of 4 tokens,
the last prompt token always computed).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from .conftest import openai_client  # noqa: E402

pytestmark = pytest.mark.torch

MODEL = "tiny-llama"
PAGE = 4
WAIT = 30.0


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def unique_text(n: int) -> str:
    """A prompt nobody sent before (so its first request hits nothing in the cache)."""
    return (uuid.uuid4().hex * (n // 32 + 1))[:n]


def client(server: Any, **kw: Any) -> Any:
    return openai_client(server.base_url, **kw)


def sse_events(raw: str) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, checking the framing."""
    assert raw.endswith("\n\n"), raw[-40:]
    events = raw[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        out.append(event.removeprefix("data: "))
    return out


def metrics(server: Any) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``sample name -> labels -> value``, parsed with prometheus_client's parser."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(scraped: dict[str, Any], name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    return float(scraped[name][tuple(sorted(want.items()))])


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def page_state(server: Any) -> tuple[int, int, bool]:
    async def read() -> tuple[int, int, bool]:
        engine = server.server.config.app.state.server.engine
        usage = engine.scheduler.page_usage()
        return usage.pinned, usage.private, engine.scheduler.has_unfinished

    state: tuple[int, int, bool] = server.call(read())
    return state


# -- the happy paths ---------------------------------------------------------------------------
def test_models_health_and_tokenize(server: Any, codec: Any) -> None:
    assert [m.id for m in client(server).models.list()] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200
    got = httpx.post(server.base_url + "/tokenize", json={"prompt": "héllo"}).json()
    assert got == {"count": 5, "tokens": codec.encode("héllo")}
    messages = [{"role": "user", "content": "hi"}]
    got = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()
    assert got["tokens"] == codec.chat(messages)
    got = httpx.post(server.base_url + "/detokenize", json={"tokens": codec.encode("abc")})
    assert got.json() == {"prompt": codec.decode(codec.encode("abc"))}


def test_completion_is_the_models_greedy_answer(server: Any, tiny: Any, codec: Any) -> None:
    prompt = unique_text(22)
    expected = greedy(tiny, codec.encode(prompt), 8)
    out = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.text == codec.decode(expected)
    eos = codec.EOS
    ids = expected[: expected.index(eos) + 1] if eos in expected else expected
    assert choice.finish_reason == ("stop" if eos in expected else "length")
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (22, len(ids))
    # token-id prompts are accepted as well, and give the same answer
    again = client(server).completions.create(
        model=MODEL, prompt=codec.encode(prompt), max_tokens=8, temperature=0
    )
    assert again.choices[0].text == choice.text


def test_streamed_completion_sse_framing_and_usage(server: Any, codec: Any) -> None:
    prompt = unique_text(18)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    plain = httpx.post(server.base_url + "/v1/completions", json=body, timeout=WAIT).json()
    streamed = httpx.post(
        server.base_url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=WAIT,
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *deltas, usage = chunks
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in deltas)
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in deltas) == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == plain["choices"][0][
        "finish_reason"
    ]
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(
        plain["choices"][0]["text"]
    ) + (1 if plain["choices"][0]["finish_reason"] == "stop" else 0)
    # without include_usage: no usage chunk, no usage key
    bare = httpx.post(
        server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=WAIT
    )
    bare_chunks = [json.loads(e) for e in sse_events(bare.text)[:-1]]
    assert all("usage" not in c and len(c["choices"]) == 1 for c in bare_chunks)


def test_chat_with_the_openai_client_stream_and_not(server: Any, tiny: Any, codec: Any) -> None:
    messages = [{"role": "user", "content": unique_text(12)}]
    expected = codec.decode(greedy(tiny, codec.chat(messages), 9))
    oa = client(server)
    out = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert expected.startswith(out.choices[0].message.content or "")
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert out.usage is not None
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_cached_tokens_for_a_repeated_prompt(server: Any) -> None:
    prompt = unique_text(41)
    reusable = (41 - 1) // PAGE * PAGE
    oa = client(server)
    before = metrics(server)
    cached = []
    for _ in range(2):
        out = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, reusable]
    after = metrics(server)
    name = "vllm:prefix_cache_queries_total"
    assert value(after, name) - value(before, name) == 2 * 41
    name = "vllm:prefix_cache_hits_total"
    assert value(after, name) - value(before, name) == reusable


def test_tenants_never_share_cached_blocks(server: Any) -> None:
    prompt = unique_text(30)
    reusable = (30 - 1) // PAGE * PAGE

    def cached(**extra: Any) -> int:
        out = client(server).completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, **extra
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return int(out.usage.prompt_tokens_details.cached_tokens or 0)

    assert cached(user="alice") == 0
    assert cached(user="bob") == 0
    assert cached(extra_body={"cache_salt": "s1"}) == 0
    assert cached() == 0
    assert cached(user="alice") == reusable
    assert cached(extra_body={"cache_salt": "s1"}) == reusable


def test_n_choices_share_one_prefill(server: Any) -> None:
    prompt = unique_text(33)
    before = metrics(server)
    out = client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, n=3
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 1  # greedy: one answer, three times
    after = metrics(server)
    opened = "prefixflight:flights_opened_total"
    assert value(after, opened) - value(before, opened) == 1
    followers = "prefixflight:flight_followers_total"
    assert value(after, followers) - value(before, followers) == 2
    assert out.usage is not None and out.usage.prompt_tokens == 33
    # sampled with a seed: choice i uses seed + i, so the answers are reproducible
    sampled = [
        client(server).completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=1.5, n=2, seed=7
        )
        for _ in range(2)
    ]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]


@pytest.mark.parametrize("policy", ["independent", "after_prefill"])
def test_a_burst_over_http_never_recomputes_the_shared_prompt(
    start_server: Any, policy: str
) -> None:
    """The single-flight study's bursts over HTTP, as its clients send them: a warmed
    prompt, then 4 and 8 identical cold 532-token prompts at once, 128 tokens out each,
    against a step budget of 256 and pages of 16. However the arrivals fall on the steps,
    every request but the first reuses all 528 full-block tokens, and the prompt tokens
    the model computed are one prompt plus a 4-token tail per follower."""
    from concurrent.futures import ThreadPoolExecutor

    from prefixflight.core import ReleasePolicy

    srv = start_server(
        release_policy=ReleasePolicy(policy), block_size=16, max_batch_tokens=256, num_pages=512
    )
    oa = client(srv)

    def ask(prompt: str) -> int:
        out = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=128, temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        assert out.usage.prompt_tokens == 532
        return int(out.usage.prompt_tokens_details.cached_tokens or 0)

    name = "prefixflight:computed_prompt_tokens_total"
    for warm, n in ((True, 4), (False, 4), (False, 8)):
        prompt = unique_text(532)
        if warm:
            assert ask(prompt) == 0
        before = value(metrics(srv), name)
        with ThreadPoolExecutor(n) as pool:
            cached = sorted(pool.map(ask, [prompt] * n))
        computers = 0 if warm else 1
        assert cached == [0] * computers + [528] * (n - computers), (warm, n, cached)
        until(lambda: not page_state(srv)[2], "the burst to end")
        computed = value(metrics(srv), name) - before
        assert computed == 532 * computers + 4 * (n - computers), (warm, n, computed)


def test_stop_strings_end_the_answer_before_them(server: Any) -> None:
    prompt = unique_text(15)
    oa = client(server)
    full = (
        oa.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[5:7]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(
                oa.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=12,
                    temperature=0,
                    stop=[stop, "\x00"],
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got = oa.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stop=stop,
                extra_body={"ignore_eos": True},
            ).choices[0]
            text, reason = got.text, got.finish_reason
        assert (text, reason) == (cut, "stop")
    until(lambda: page_state(server) == (0, 0, False), "the stopped requests to free pages")


# -- disconnects, errors, overload -------------------------------------------------------------
def long_completion(words: int, *, stream: bool) -> dict[str, Any]:
    """A completion request that runs (300 tokens, no end of sequence) until a test stops it."""
    return {
        "model": MODEL,
        "prompt": unique_text(words),
        "max_tokens": 300,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }


def aborted(server: Any) -> float:
    return value(metrics(server), "vllm:request_success_total", finished_reason="abort")


def test_a_disconnected_stream_aborts_and_frees_its_pages(server: Any, step_gate: Any) -> None:
    before = aborted(server)
    body = long_completion(20, stream=True)
    step_gate.hold_after(3)  # the request runs until the test lets it go on
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=WAIT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping a half-read iterator closes the connection
        next(lines)  # the first event arrived: the request is running
        _pinned, private, busy = page_state(server)
        assert busy and private > 0
    # the client is gone: the server aborts the request ...
    until(lambda: aborted(server) == before + 1, "the server to abort the request")
    step_gate.release()
    # ... and once the step it was in completes, its pages are back
    until(lambda: page_state(server) == (0, 0, False), "the aborted request to free its pages")
    after = metrics(server)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_a_disconnected_plain_request_aborts(server: Any, step_gate: Any) -> None:
    before = aborted(server)
    body = long_completion(20, stream=False)
    step_gate.hold_after(3)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(
            server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(WAIT, read=0.5)
        )
    until(lambda: aborted(server) == before + 1, "the abandoned request to be aborted")
    step_gate.release()
    until(lambda: page_state(server) == (0, 0, False), "its pages to be free")


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt must not be empty"),
        ("/v1/completions", {"prompt": [5, 99999]}, 400, "99999"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "needs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "'logprobs' is not supported"),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "only text",
        ),
        ("/tokenize", {}, 400, "exactly one"),
        ("/nowhere", {}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: Any, path: str, body: Any, status: int, needle: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        server.base_url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=WAIT,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    assert "Traceback" not in r.text
    assert page_state(server) == (0, 0, False)


def test_openai_client_raises_typed_errors(server: Any) -> None:
    oa = client(server, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oa.completions.create(model=MODEL, prompt="x", temperature=7)
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x")


def test_overload_gets_429_and_a_closed_engine_503(start_server: Any, step_gate: Any) -> None:
    small = start_server(max_running=1, max_waiting=1)
    body = long_completion(8, stream=True)
    url = small.base_url + "/v1/completions"
    step_gate.hold_after(3)  # the first request stays in progress
    with httpx.stream("POST", url, json=body, timeout=WAIT) as first:
        lines = first.iter_lines()  # held: dropping it would close the connection
        next(lines)  # running: 1 of 1 + 1 in progress
        r = httpx.post(url, json={**body, "stream": False, "n": 2}, timeout=WAIT)
        assert r.status_code == 429, r.text
        assert "overloaded" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError, match="limit is 2"):
            client(small, max_retries=0).completions.create(
                model=MODEL, prompt="x", max_tokens=1, n=2
            )
    step_gate.release()
    scraped = metrics(small)
    assert value(scraped, "prefixflight:requests_rejected_total", reason="overloaded") == 2

    async def close() -> None:
        await small.server.config.app.state.server.engine.close()

    small.call(close())
    r = httpx.post(url, json={**body, "stream": False}, timeout=WAIT)
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    assert httpx.get(small.base_url + "/health").status_code == 503


def test_metrics_use_vllm_names_labelled_by_model(server: Any) -> None:
    client(server).completions.create(model=MODEL, prompt=unique_text(9), max_tokens=3)
    scraped = metrics(server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "prefixflight:flights_opened_total",
        "prefixflight:flight_followers_total",
        "prefixflight:followers_released_total",
        "prefixflight:tokens_not_recomputed_total",
    ):
        value(scraped, name)  # present, labelled by model_name
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert value(scraped, name + "_count") >= 1
    assert value(scraped, "prefixflight:evicted_blocks_total", policy="lru") >= 0
    pages = {
        s: value(scraped, "prefixflight:kv_pages", state=s)
        for s in ("free", "cached", "pinned", "private")
    }
    assert pages["free"] + pages["cached"] + pages["private"] == 1024


def test_server_config_errors_name_the_value() -> None:
    from prefixflight.core import ConfigError
    from prefixflight.serve.http import ServerConfig

    with pytest.raises(ConfigError, match="max_waiting must be an int >= 0, got -1"):
        ServerConfig(model_name="m", max_waiting=-1)
    with pytest.raises(ConfigError, match="chat_max_tokens must be an int >= 1, got True"):
        ServerConfig(model_name="m", chat_max_tokens=True)
    with pytest.raises(ConfigError, match="model_name must be a non-empty str, got ''"):
        ServerConfig(model_name="")
