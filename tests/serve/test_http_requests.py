"""What the server does with requests that outside probing and schemathesis sent it: each
gets a 400 naming its field, or is served, and none of them disturbs another request, the
admission count or the engine. A real uvicorn server on a loopback port, real clients.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from .test_http import (  # noqa: E402
    WAIT,
    greedy,
    long_completion,
    metrics,
    page_state,
    sse_events,
    unique_text,
    until,
    value,
)

pytestmark = pytest.mark.torch


def post(server: Any, path: str, body: Any) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.base_url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=WAIT,
    )


def assert_400_naming(r: Any, field: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"], error
    assert error["code"] == 400 and error["type"] == "invalid_request_error"


# -- defect 1: a vanishing temperature or top_p -------------------------------------------------
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 5e-324}, {"top_p": 1e-46}],
)
def test_a_vanishing_temperature_or_top_p_is_answered_and_cuts_no_other_stream(
    server: Any, step_gate: Any, sampling: dict[str, float]
) -> None:
    url = server.base_url + "/v1/completions"
    step_gate.hold_after(2)
    with httpx.stream("POST", url, json=long_completion(12, stream=True), timeout=WAIT) as other:
        lines = other.iter_lines()
        next(lines)  # the other stream is running
        step_gate.release()
        r = post(server, "/v1/completions", {"prompt": unique_text(9), "max_tokens": 3, **sampling})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        rest = "\n".join(lines)
    assert rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest
    assert httpx.get(server.base_url + "/health").status_code == 200


# -- a step that fails ------------------------------------------------------------------------
POISON = 509


@contextlib.contextmanager
def poisoned(model: Any) -> Iterator[None]:
    """The model's forward raises for an input row holding ``POISON, POISON`` (a prompt the
    test sends; decode rows are one token, so no generated token can trigger it)."""

    def check(_module: Any, args: tuple[Any, ...]) -> None:
        ids = args[0]
        if bool(((ids[..., :-1] == POISON) & (ids[..., 1:] == POISON)).any()):
            raise RuntimeError("poisoned input")

    handle = model.get_input_embeddings().register_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


def test_a_failing_step_ends_its_requests_with_errors_and_the_server_serves_on(
    server: Any, tiny: Any, codec: Any
) -> None:
    bad = {"prompt": [5, 6, POISON, POISON], "max_tokens": 4}
    with poisoned(tiny):
        plain = post(server, "/v1/completions", bad)
        assert plain.status_code == 500, plain.text
        assert "poisoned input" in plain.json()["error"]["message"]
        streamed = post(server, "/v1/completions", {**bad, "stream": True})
        assert streamed.status_code == 200
        *_, error, done = sse_events(streamed.text)
        assert done == "[DONE]" and json.loads(error)["error"]["code"] == 500
        assert httpx.get(server.base_url + "/health").status_code == 200
        prompt = unique_text(10)
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == codec.decode(greedy(tiny, codec.encode(prompt), 4))
    until(lambda: page_state(server) == (0, 0, False), "the failed requests to free pages")


# -- defect 2: the in-progress count ----------------------------------------------------------
def test_a_rejected_batch_reserves_nothing_and_counts_no_abort(
    start_server: Any, step_gate: Any
) -> None:
    small = start_server(max_running=1, max_waiting=1)  # at most 2 choices in progress
    aborts = value(metrics(small), "vllm:request_success_total", finished_reason="abort")
    batch = {"prompt": [[5, 6], [7, 8], [9, 99999]], "max_tokens": 2}  # the last is invalid
    for _ in range(5):
        r = post(small, "/v1/completions", batch)
        assert_400_naming(r, "prompt[2]")
    scraped = metrics(small)
    assert value(scraped, "prefixflight:requests_in_progress") == 0
    assert value(scraped, "vllm:request_success_total", finished_reason="abort") == aborts
    url = small.base_url + "/v1/completions"
    step_gate.hold_after(2)
    with httpx.stream("POST", url, json=long_completion(8, stream=True), timeout=WAIT) as first:
        lines = first.iter_lines()
        next(lines)
        assert value(metrics(small), "prefixflight:requests_in_progress") == 1
        r = post(small, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 2})
        assert r.status_code == 429, r.text  # 1 in progress + 2 > 2
        step_gate.release()
    until(lambda: value(metrics(small), "prefixflight:requests_in_progress") == 0, "idle")


# -- defect 5: context length and n past the limit -------------------------------------------
def test_a_prompt_past_the_models_context_is_a_400(server: Any, tiny: Any) -> None:
    context = tiny.config.max_position_embeddings
    r = post(server, "/v1/completions", {"prompt": [7] * (context + 1), "max_tokens": 1})
    assert_400_naming(r, f"maximum context length is {context}")
    r = post(server, "/v1/completions", {"prompt": [7] * (context - 2), "max_tokens": 5})
    assert_400_naming(r, f"maximum context length is {context}")
    # without max_tokens the default is cut to what the context has left
    r = post(server, "/v1/completions", {"prompt": [7] * (context - 2), "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert page_state(server) == (0, 0, False)


def test_n_past_the_in_progress_limit_is_a_400_not_a_429(start_server: Any) -> None:
    small = start_server(max_running=2, max_waiting=1)
    r = post(small, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 4})
    assert_400_naming(r, "more than the server ever runs (3")
    assert "retry-after" not in r.headers
    r = post(small, "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 1, "n": 2})
    assert_400_naming(r, "needs 4 choices")


# -- defect 4: lone surrogates ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        ("/v1/completions", b'{"prompt": "ab\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["\\ud800"]}', "stop[0]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}',
            "messages[0].content",
        ),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        (
            "/tokenize",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages[0].content",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    server: Any, path: str, raw: bytes, field: str
) -> None:
    r = post(server, path, raw)
    assert_400_naming(r, field)
    assert "lone surrogate U+D" in r.json()["error"]["message"]


# -- defect 8: strict types, vLLM's sampling parameters --------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "max_tokens": "2"}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "n": 2.0}, "n"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [[1, 2], [3, True]]}, "prompt"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "stop_token_ids": [1, True]}, "stop_token_ids[1]"),
        ({"prompt": "x", "stop_token_ids": [99999]}, "stop token id 99999"),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
        ({"prompt": "x", "repetition_penalty": 1.2}, "'repetition_penalty' is not supported"),
        ({"prompt": "x", "min_p": 0.1}, "'min_p' is not supported"),
        ({"prompt": "x", "use_beam_search": True}, "'use_beam_search' is not supported"),
        ({"prompt": "x", "guided_json": {"type": "object"}}, "'guided_json' is not supported"),
    ],
)
def test_lax_types_and_unsupported_parameters_are_400s_naming_them(
    server: Any, body: dict[str, Any], field: str
) -> None:
    assert_400_naming(post(server, "/v1/completions", body), field)
    assert page_state(server) == (0, 0, False)


def test_nan_and_infinity_are_no_numbers(server: Any) -> None:
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
        r = post(server, "/v1/completions", raw)
        assert r.status_code == 400, r.text


def test_neutral_values_of_unsupported_parameters_are_accepted(server: Any) -> None:
    body = {
        "prompt": unique_text(5),
        "max_tokens": 1,
        "repetition_penalty": 1.0,
        "min_p": 0,
        "logprobs": None,
        "use_beam_search": False,
        "skip_special_tokens": True,
        "best_of": 1,
    }
    assert post(server, "/v1/completions", body).status_code == 200


def test_vllm_sampling_parameters_are_honoured(server: Any, tiny: Any, codec: Any) -> None:
    prompt = unique_text(14)
    ids = greedy(tiny, codec.encode(prompt), 8)
    base = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}

    def answer(**extra: Any) -> tuple[str, str, int]:
        r = post(server, "/v1/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        return choice["text"], choice["finish_reason"], body["usage"]["completion_tokens"]

    greedy_text = codec.decode(ids)
    # top_k 1 samples the most likely token: greedy, whatever the temperature
    assert answer(temperature=1.8, top_k=1, seed=3)[0] == greedy_text
    # stop_token_ids: the answer ends at (and includes) the first one
    stop_at = ids[3]
    cut = ids[: ids.index(stop_at) + 1]
    assert answer(temperature=0, stop_token_ids=[stop_at]) == (codec.decode(cut), "stop", len(cut))
    # min_tokens holds the stop token back for that many tokens
    assert answer(temperature=0, stop_token_ids=[ids[0]])[2] == 1
    assert answer(temperature=0, stop_token_ids=[ids[0]], min_tokens=3)[2] >= 3


class RefusingCodec:
    """A codec whose chat template raises on a conversation, as Jinja templates do
    (``raise_exception('Conversation roles must alternate')``)."""

    def __init__(self) -> None:
        from .conftest import CharCodec

        self.inner = CharCodec()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: Any) -> str:
        return self.inner.decode(ids)

    def chat(self, messages: Any) -> list[int]:
        if len(messages) > 1:
            raise ValueError("Conversation roles must alternate user/assistant")
        return self.inner.chat(messages)


def test_a_conversation_the_chat_template_refuses_is_a_400(start_server: Any) -> None:
    srv = start_server(codec=RefusingCodec())
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for path, body in (
        ("/tokenize", {"messages": two}),
        ("/v1/chat/completions", {"messages": two}),
    ):
        assert_400_naming(post(srv, path, body), "roles must alternate")
    # no messages at all: a 400 from the schema (schemathesis found a 500 here)
    assert_400_naming(post(srv, "/tokenize", {"messages": [], "model": None}), "messages")
