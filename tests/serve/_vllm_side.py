"""vLLM's side of the interoperability tests: runs in the vLLM venv, never in ours.

tests/serve/test_vllm_interop.py starts ``<vllm venv>/bin/python _vllm_side.py`` once and talks
to it in JSON lines on stdin/stdout, so vLLM's own classes (``vllm.distributed.kv_events``)
decode our frames, encode theirs, and publish with vLLM's ``ZmqEventPublisher``:

- ``{"op": "decode", "payloads": [hex, ...]}``: each payload through
  ``msgspec.msgpack.Decoder(type=KVEventBatch)``; ``{"results": [{"ok": builtins} |
  {"error": message}]}``.
- ``{"op": "samples"}``: batches that use every field vLLM 0.32 declares, encoded by vLLM;
  ``{"payloads": [hex, ...]}``.
- ``{"op": "publish", "endpoint", "replay_endpoint", "topic"}``: a ``ZmqEventPublisher``
  (vLLM's bind-or-connect rule applies) publishes a fixed run of batches and waits until its
  thread has sent them; ``{"published": n, "resident": [hash, ...]}``, the hashes the run
  leaves resident, computed here from vLLM's event objects. The publisher stays up (for
  replay) until ``{"op": "stop_publisher"}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import vllm  # type: ignore[import-not-found]
from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def _stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> Any:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=32,
        lora_id=kw.pop("lora_id", None),
        medium=kw.pop("medium", "GPU"),
        lora_name=kw.pop("lora_name", None),
        **kw,
    )


def samples() -> list[Any]:
    full = _stored(
        [b"\x01" * 32, b"\x02" * 32],
        b"\x00" * 32,
        list(range(64)),
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("adapter", ("mm", "image-0", 0), "salt"), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        ownership="tier-2",
        session_id="s-1",
    )
    removed = BlockRemoved(
        block_hashes=[2**64 - 1], medium="CPU", group_idx=1, locality="REMOTE", ownership="x"
    )
    return [
        KVEventBatch(
            ts=1.5, events=[_stored([2**64 - 1, 7], None, list(range(64)))], data_parallel_rank=0
        ),
        KVEventBatch(ts=2.0, events=[full, removed, AllBlocksCleared()], data_parallel_rank=3),
        KVEventBatch(ts=3.0, events=[BlockRemoved(block_hashes=[7], medium=None)]),
        KVEventBatch(ts=4.0, events=[]),
    ]


def run_plan() -> tuple[list[Any], list[int]]:
    """Batches a real engine could send (stores chained by parent, removals, a clear), and
    the hashes they leave resident."""
    batches: list[Any] = []
    resident: set[int] = set()
    for step in range(30):
        events: list[Any] = []
        base = 1000 * (step + 1)
        hashes = [base + 1, base + 2]
        events.append(_stored(hashes, None, [step] * 64))
        resident.update(hashes)
        if step % 3 == 2:
            events.append(BlockRemoved(block_hashes=[base + 2], medium="GPU"))
            resident.discard(base + 2)
        if step == 14:
            events.append(AllBlocksCleared())
            resident.clear()
        batches.append(KVEventBatch(ts=float(step), events=events))
    return batches, sorted(resident)


def main() -> None:
    publisher = None
    print(json.dumps({"ready": vllm.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any]
        if op == "decode":
            results: list[dict[str, Any]] = []
            for payload in cmd["payloads"]:
                try:
                    batch = DECODER.decode(bytes.fromhex(payload))
                except msgspec.ValidationError as exc:
                    results.append({"error": str(exc)})
                else:
                    results.append({"ok": msgspec.to_builtins(batch)})
            reply = {"results": results}
        elif op == "samples":
            reply = {"payloads": [ENCODER.encode(b).hex() for b in samples()]}
        elif op == "publish":
            publisher = ZmqEventPublisher(
                data_parallel_rank=0,
                endpoint=cmd["endpoint"],
                replay_endpoint=cmd["replay_endpoint"],
                topic=cmd["topic"],
            )
            batches, resident = run_plan()
            for batch in batches:
                publisher.publish(batch)
            publisher._event_queue.join()  # every batch sent by its thread
            reply = {"published": len(batches), "resident": resident}
        elif op == "stop_publisher":
            if publisher is not None:
                publisher.shutdown()
                publisher = None
            reply = {"stopped": True}
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), flush=True)
    if publisher is not None:
        publisher.shutdown()


if __name__ == "__main__":
    main()
