"""The OpenAPI schema (``GET /openapi.json``) says what the server does: every status a
route answers is documented with its body and content type (``text/event-stream`` for
streams, ``text/plain`` for ``/metrics``, a JSON body for ``/health``), FastAPI's 422 (never
sent) is gone, 401 is documented where keys are required, and a wrong method gets 405 with
``Allow``. Each response below is checked against the schema's own description of it.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from .test_http import WAIT, long_completion  # noqa: E402

pytestmark = pytest.mark.torch


def schema_of(srv: Any) -> dict[str, Any]:
    r = httpx.get(srv.base_url + "/openapi.json")
    assert r.status_code == 200
    schema: dict[str, Any] = r.json()
    return schema


def model_of(schema: dict[str, Any], path: str, method: str, status: int, media: str) -> Any:
    """The pydantic model the schema names for this response (None for a plain string)."""
    from prefixflight.serve import _protocol

    response = schema["paths"][path][method]["responses"][str(status)]
    body = response["content"][media]["schema"]
    ref = body.get("$ref")
    return None if ref is None else getattr(_protocol, ref.rsplit("/", 1)[-1])


def check(schema: dict[str, Any], path: str, method: str, r: Any) -> None:
    """``r`` is a response the schema documents: status, content type and body."""
    op = schema["paths"][path][method]
    assert str(r.status_code) in op["responses"], (path, r.status_code, list(op["responses"]))
    media = r.headers["content-type"].split(";")[0].strip()
    content = op["responses"][str(r.status_code)].get("content", {})
    assert media in content, (path, r.status_code, media, list(content))
    model = model_of(schema, path, method, r.status_code, media)
    if model is not None:
        model.model_validate(r.json())


def test_the_schema_documents_every_status_and_no_422(server: Any) -> None:
    schema = schema_of(server)
    text = str(schema)
    assert "422" not in schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "408", "413", "429", "500", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in responses["429"]["headers"]
        event = responses["200"]["content"]["text/event-stream"]["schema"]  # one event
        assert event["type"] == "object" and event["required"] == ["data"]
        chunk = "ChatChunk" if "chat" in path else "CompletionChunk"
        done, payload = event["properties"]["data"]["anyOf"]  # the last event is [DONE]
        assert done == {"const": "[DONE]"}
        refs = payload["contentSchema"]["anyOf"]
        assert {r["$ref"].rsplit("/", 1)[1] for r in refs} == {chunk, "ErrorResponse"}
        assert chunk in schema["components"]["schemas"]
    for path in ("/tokenize", "/detokenize"):
        assert {"200", "400", "404", "413"} <= set(schema["paths"][path]["post"]["responses"])
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    health = schema["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"} and "application/json" in health["200"]["content"]
    assert "security" not in str(schema) and "401" not in str(schema["paths"])


def test_responses_match_the_schema(server: Any, start_server: Any) -> None:
    schema = schema_of(server)
    url = server.base_url
    cases: list[tuple[str, str, Any]] = [
        ("/health", "get", httpx.get(url + "/health")),
        ("/v1/models", "get", httpx.get(url + "/v1/models")),
        ("/metrics", "get", httpx.get(url + "/metrics")),
    ]
    posts: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream": True}),
        ("/v1/completions", {"prompt": "abc", "max_tokens": "2"}),
        ("/v1/completions", {"model": "other", "prompt": "abc"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
        ("/v1/chat/completions", {"messages": []}),
        ("/tokenize", {"prompt": "abc"}),
        ("/tokenize", {}),
        ("/detokenize", {"tokens": [70, 71]}),
        ("/detokenize", {"tokens": [99999]}),
    ]
    for path, body in posts:
        cases.append((path, "post", httpx.post(url + path, json=body, timeout=WAIT)))
    small = start_server(max_body_bytes=100)
    big = {"prompt": "x" * 200}
    cases.append(
        ("/v1/completions", "post", httpx.post(small.base_url + "/v1/completions", json=big))
    )
    seen = set()
    for path, method, r in cases:
        check(schema, path, method, r)
        seen.add(r.status_code)
    assert {200, 400, 404, 413} <= seen


def test_a_wrong_method_gets_405_with_allow(server: Any) -> None:
    for method, path, allow in (
        ("TRACE", "/health", "GET"),
        ("POST", "/health", "GET"),
        ("DELETE", "/v1/completions", "POST"),
        ("GET", "/tokenize", "POST"),
    ):
        r = httpx.request(method, server.base_url + path)
        assert r.status_code == 405, (method, path, r.text)
        assert r.headers["allow"] == allow
        assert r.json()["error"]["code"] == 405


def test_with_keys_the_schema_documents_401_and_the_scheme(start_server: Any) -> None:
    keyed = start_server(api_keys={"k": None})
    schema = schema_of(keyed)
    assert schema["components"]["securitySchemes"] == {
        "apiKey": {"type": "http", "scheme": "bearer"}
    }
    completions = schema["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"apiKey": []}] and "401" in completions["responses"]
    assert "security" not in schema["paths"]["/health"]["get"]
    r = httpx.post(keyed.base_url + "/v1/completions", json=long_completion(3, stream=False))
    check(schema, "/v1/completions", "post", r)
    assert r.status_code == 401
