"""API keys and tenants: 401 without a valid key (as vLLM's server); with a keys file the
key's tenant is the hashing namespace, so one tenant can never reuse, or time, another
tenant's cached blocks or flights (the prefix-cache timing side channel of
CVE-2025-46570), and a client's ``cache_salt`` only divides its own tenant's namespace.
Every isolation check has its positive control (the same tenant's repeat IS cached), so the
test cannot pass with caching off.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from .test_http import MODEL, PAGE, WAIT, metrics, unique_text, until, value  # noqa: E402

pytestmark = pytest.mark.torch

KEYS = {"key-alice": "alice", "key-bob": "bob", "key-anyone": None}


@pytest.fixture(scope="module")
def keyed(tiny: Any) -> Any:
    from .conftest import start_tiny_server

    srv = start_tiny_server(tiny, api_keys=KEYS)
    yield srv
    srv.stop()


def as_(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def test_requests_without_a_valid_key_get_401(keyed: Any) -> None:
    url = keyed.base_url
    body = {"prompt": "x", "max_tokens": 1}
    for key in (None, "nope", "key-alicex", "KEY-ALICE"):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            r = httpx.request(method, url + path, json=body, headers=as_(key), timeout=WAIT)
            assert r.status_code == 401, (key, path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(url + "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Basic x"})
    assert r.status_code == 401
    # the probes need no key
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    # a body is never read without a key: a huge declared body still gets 401
    r = httpx.post(url + "/v1/completions", content=b"x" * 10, headers={"content-length": "10"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key="key-alice", max_retries=0)
    assert [m.id for m in good.models.list()] == [MODEL]


def cached(srv: Any, key: str, prompt: str, **extra: Any) -> int:
    r = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra},
        headers=as_(key),
        timeout=WAIT,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_never_reuses_another_tenants_cache(keyed: Any) -> None:
    prompt = unique_text(30)
    reusable = (30 - 1) // PAGE * PAGE
    assert cached(keyed, "key-alice", prompt) == 0
    assert cached(keyed, "key-alice", prompt) == reusable  # the positive control
    assert cached(keyed, "key-bob", prompt) == 0
    # a client-sent cache_salt or user never reaches another tenant's namespace...
    assert cached(keyed, "key-bob", prompt, cache_salt="alice") == 0
    assert cached(keyed, "key-bob", prompt, user="alice") == 0
    assert cached(keyed, "key-anyone", prompt) == 0
    # ... and divides the tenant's own
    assert cached(keyed, "key-alice", prompt, cache_salt="s") == 0
    assert cached(keyed, "key-alice", prompt, cache_salt="s") == reusable
    assert cached(keyed, "key-bob", prompt) == reusable


def test_a_tenant_never_shares_another_tenants_prefill(keyed: Any, step_gate: Any) -> None:
    """Two identical prompts that arrive together share one prefill within a tenant (as a
    flight's follower, or reading the leader's pages as they are written in the same step),
    and never across tenants: joining a flight, or reading a page written in the same step,
    leaks the same timing signal as a cache hit."""
    followers = "prefixflight:flight_followers_total"

    def burst(keys: tuple[str, str]) -> tuple[float, list[int]]:
        before = value(metrics(keyed), followers)
        # longer than a step's budget (128 tokens): the leader's flight stays open until its
        # last chunk is planned, so the second request arrives while it is open
        prompt = unique_text(300)
        step_gate.hold_after(0)  # nothing runs until both requests are in
        reused: list[int] = []

        def send(key: str) -> None:
            reused.append(cached(keyed, key, prompt))

        threads = [threading.Thread(target=send, args=(k,)) for k in keys]
        for t in threads:
            t.start()

        async def waiting() -> int:
            return len(keyed.server.config.app.state.server.engine.scheduler.requests())

        until(lambda: keyed.call(waiting()) == 2, "both requests to arrive")
        step_gate.release()
        for t in threads:
            t.join(WAIT)
        assert len(reused) == 2
        return value(metrics(keyed), followers) - before, sorted(reused)

    joined, reused = burst(("key-alice", "key-alice"))
    assert joined == 1 or reused[1] > 0  # the positive control: the prefill was shared
    assert burst(("key-alice", "key-bob")) == (0, [0, 0])
