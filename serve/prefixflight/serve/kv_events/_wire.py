"""vLLM's KV-event wire format, pure: typed events, msgpack encode and decode, topics, hashes.

The schema is vLLM's ``vllm/distributed/kv_events.py`` (``EventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``; read at vllm-project/vllm commit 0181ea31, and at
b4e69e0a for the older positional form). A batch is ``[ts, events, data_parallel_rank]``;
each event is tagged by its class name and carries vLLM's fields in vLLM's order. Two
encodings exist in the wild and both decode here:

- positional (msgspec ``array_like=True``, every vLLM release before vLLM PR #42892):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, ...]``;
- named (after that PR): ``{"type": "BlockStored", "block_hashes": ..., ...}``; the batch
  itself may be positional (as captured from vLLM 0.26) or a map (as the struct is declared
  at 0181ea31).

vLLM's structs use ``omit_defaults=True``, which drops defaulted fields from a map but not
from an array (an ``array_like`` struct always carries every field its version declares),
and every vLLM release appended fields, so a decoder takes any length from the required
fields up and ignores fields it does not know. No sockets here:
`prefixflight.serve.kv_events` moves the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final, Literal, TypeAlias

import attrs
import msgspec

from prefixflight.core import BlockHash, UsageError

__all__ = [
    "END_SEQ",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireEncoding",
    "WireEvent",
    "WireHash",
    "HashEncoding",
    "KVEventFormatError",
    "decode_batch",
    "encode_batch",
    "fold_hash",
    "kv_topic",
    "parse_live_frames",
    "parse_replay_frames",
    "parse_topic",
    "to_wire_hash",
]

WireHash: TypeAlias = int | bytes
"""A block hash as vLLM sends it: an int (its default) or the digest's bytes."""

WireEncoding: TypeAlias = Literal["array", "map"]
"""``"array"``: positional events (vLLM before PR #42892, read by every llm-d release);
``"map"``: events as tagged maps in a positional batch (vLLM after that PR)."""

HashEncoding: TypeAlias = Literal["int", "bytes"]
"""``"int"``: a 32-byte digest goes out as its last 8 bytes, big-endian (vLLM's default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); ``"bytes"``: the digest goes out whole."""

END_SEQ: Final = -1
"""The sequence number that ends a replay stream."""

_MASK64: Final = (1 << 64) - 1


class KVEventFormatError(UsageError):
    """A KV-event payload or frame that cannot be decoded; the message names the field."""


def fold_hash(h: object) -> int:
    """A block hash as a 64-bit key, the way vLLM and llm-d's indexer fold it.

    Bytes (a sha256 digest from `BlockHasher` or vLLM) keep their last 8 bytes, read
    big-endian (shorter ones are left-padded with zeros); ints are taken modulo 2**64 (old
    vLLM releases sent signed Python ``hash()`` values; llm-d reads them as uint64).
    """
    if isinstance(h, bytes):
        if not h:
            raise KVEventFormatError("a block hash cannot be empty bytes")
        return int.from_bytes(h[-8:], "big")
    if isinstance(h, int) and not isinstance(h, bool):
        return h & _MASK64
    raise KVEventFormatError(f"a block hash must be an int or bytes, got {h!r}")


def to_wire_hash(h: BlockHash, encoding: HashEncoding) -> WireHash:
    """Our block hash as it goes on the wire (see `HashEncoding`)."""
    if isinstance(h, bytes) and encoding == "bytes":
        return h
    return fold_hash(h)


def kv_topic(pod: str, model: str) -> str:
    """``kv@<pod>@<model>``: the topic llm-d's indexer parses for the pod and the model."""
    for name, value in (("pod", pod), ("model", model)):
        if not isinstance(value, str) or not value or "@" in value:
            raise UsageError(f"{name} must be a non-empty str without '@', got {value!r}")
    return f"kv@{pod}@{model}"


def parse_topic(topic: str) -> tuple[str, str]:
    """``(pod, model)`` from ``kv@<pod>@<model>``; ``(topic, "")`` for any other topic,
    as llm-d's indexer reads it."""
    parts = topic.split("@")
    if len(parts) == 3:
        return parts[1], parts[2]
    return topic, ""


_SEQ_BYTES: Final = 8


def parse_live_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """``(topic, seq, payload)`` from a PUB message ``[topic, seq, payload]``."""
    if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
        raise KVEventFormatError(f"expected [topic, 8-byte seq, payload], got {list(frames)!r}")
    topic, seq, payload = frames
    return topic.decode("utf-8", "replace"), int.from_bytes(seq, "big"), payload


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[str | None, int, bytes]:
    """``(topic, seq, payload)`` from one replay reply as a DEALER receives it.

    vLLM's current layout is ``[b"", topic, seq, payload]`` (its end marker ``[b"", b"",
    -1, b""]``); older releases send ``[b"", seq, payload]``, read with topic ``None``. The
    seq is signed: `END_SEQ` (-1) ends the stream.
    """
    body = list(frames[1:]) if frames and frames[0] == b"" else list(frames)
    topic: str | None = None
    if len(body) == 3:
        topic = body[0].decode("utf-8", "replace") if body[0] else None
        body = body[1:]
    if len(body) != 2 or len(body[0]) != _SEQ_BYTES:
        raise KVEventFormatError(f"expected a replay reply, got {list(frames)!r}")
    return topic, int.from_bytes(body[0], "big", signed=True), body[1]


def _hashes(value: Sequence[WireHash]) -> tuple[WireHash, ...]:
    return tuple(value)


def _ints(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class WireBlockStored:
    """vLLM's ``BlockStored``: blocks entered the cache, chained after ``parent_block_hash``."""

    block_hashes: tuple[WireHash, ...] = attrs.field(converter=_hashes)
    parent_block_hash: WireHash | None
    token_ids: tuple[int, ...] = attrs.field(converter=_ints)
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None


@attrs.frozen(kw_only=True)
class WireBlockRemoved:
    """vLLM's ``BlockRemoved``."""

    block_hashes: tuple[WireHash, ...] = attrs.field(converter=_hashes)
    medium: str | None = None
    group_idx: int | None = None


@attrs.frozen
class WireAllBlocksCleared:
    """vLLM's ``AllBlocksCleared``."""


WireEvent: TypeAlias = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


def _events(value: Sequence[WireEvent]) -> tuple[WireEvent, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class WireBatch:
    """vLLM's ``EventBatch``: the events of one engine step, in order."""

    ts: float
    events: tuple[WireEvent, ...] = attrs.field(converter=_events)
    data_parallel_rank: int | None = None


# -- encoding ---------------------------------------------------------------------------------

_encoder: Final = msgspec.msgpack.Encoder()


def _event_fields(event: WireEvent) -> tuple[str, list[tuple[str, object, bool]]]:
    """The tag and ``(name, value, has_default)`` in vLLM's declaration order."""
    if isinstance(event, WireBlockStored):
        return "BlockStored", [
            ("block_hashes", list(event.block_hashes), False),
            ("parent_block_hash", event.parent_block_hash, False),
            ("token_ids", list(event.token_ids), False),
            ("block_size", event.block_size, False),
            ("lora_id", event.lora_id, False),
            ("medium", event.medium, False),
            ("lora_name", event.lora_name, False),
            ("extra_keys", None, True),
            ("group_idx", event.group_idx, True),
            ("kv_cache_spec_kind", None, True),
            ("kv_cache_spec_sliding_window", None, True),
        ]
    if isinstance(event, WireBlockRemoved):
        return "BlockRemoved", [
            ("block_hashes", list(event.block_hashes), False),
            ("medium", event.medium, False),
            ("group_idx", event.group_idx, True),
        ]
    return "AllBlocksCleared", []


def _encode_event(event: WireEvent, encoding: WireEncoding) -> object:
    tag, fields = _event_fields(event)
    # msgspec's omit_defaults drops a field left at its default (None here) from a map; an
    # array_like struct always carries every field.
    if encoding == "map":
        out: dict[str, object] = {"type": tag}
        for name, value, has_default in fields:
            if not (has_default and value is None):
                out[name] = value
        return out
    return [tag, *(value for _, value, _ in fields)]


def encode_batch(batch: WireBatch, *, encoding: WireEncoding = "array") -> bytes:
    """msgpack bytes of ``batch``, byte for byte as vLLM's msgspec structs encode it."""
    if encoding not in ("array", "map"):
        raise UsageError(f"encoding must be 'array' or 'map', got {encoding!r}")
    events = [_encode_event(e, encoding) for e in batch.events]
    return _encoder.encode([float(batch.ts), events, batch.data_parallel_rank])


# -- decoding ---------------------------------------------------------------------------------

_decoder: Final = msgspec.msgpack.Decoder()

_STORED_ORDER: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_ORDER: Final = ("block_hashes", "medium", "group_idx")
_REQUIRED: Final = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _bad(where: str, message: str) -> KVEventFormatError:
    return KVEventFormatError(f"{where}: {message}")


def _hash(value: object, where: str) -> WireHash:
    if isinstance(value, bytes) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _bad(where, f"expected an int or non-empty bytes block hash, got {value!r}")


def _hash_list(value: object, where: str) -> tuple[WireHash, ...]:
    if not isinstance(value, list):
        raise _bad(where, f"expected an array of block hashes, got {value!r}")
    return tuple(_hash(h, f"{where}[{i}]") for i, h in enumerate(value))


def _opt_int(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _bad(where, f"expected an int or nil, got {value!r}")


def _opt_str(value: object, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _bad(where, f"expected a str or nil, got {value!r}")


def _named(raw: object, where: str) -> tuple[str, dict[str, object]]:
    """An event in either form as its tag and a field-name -> value dict."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise _bad(where, f"expected a tagged event, got {raw!r}")
        tag = raw[0]
        order = {"BlockStored": _STORED_ORDER, "BlockRemoved": _REMOVED_ORDER}.get(tag, ())
        return tag, dict(zip(order, raw[1:], strict=False))
    if isinstance(raw, dict):
        named = raw.get("type")
        if not isinstance(named, str):
            raise _bad(where, f"expected a 'type' tag, got {raw!r}")
        return named, {str(k): v for k, v in raw.items() if k != "type"}
    raise _bad(where, f"expected an array or a map, got {raw!r}")


def _decode_event(raw: object, where: str) -> WireEvent:
    tag, f = _named(raw, where)
    if tag not in _REQUIRED:
        raise _bad(where, f"unknown event tag {tag!r}")
    order = _STORED_ORDER if tag == "BlockStored" else _REMOVED_ORDER
    missing = [n for n in order[: _REQUIRED[tag]] if n not in f]
    if missing:
        raise _bad(where, f"{tag} is missing {', '.join(missing)}")
    if tag == "AllBlocksCleared":
        return WireAllBlocksCleared()
    hashes = _hash_list(f["block_hashes"], f"{where}.block_hashes")
    medium = _opt_str(f.get("medium"), f"{where}.medium")
    group = _opt_int(f.get("group_idx"), f"{where}.group_idx")
    if tag == "BlockRemoved":
        return WireBlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)
    parent_raw = f["parent_block_hash"]
    parent = None if parent_raw is None else _hash(parent_raw, f"{where}.parent_block_hash")
    tokens = f["token_ids"]
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise _bad(f"{where}.token_ids", f"expected an array of ints, got {tokens!r}")
    block_size = _opt_int(f["block_size"], f"{where}.block_size")
    if block_size is None or block_size < 1:
        raise _bad(f"{where}.block_size", f"expected an int >= 1, got {f['block_size']!r}")
    return WireBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), f"{where}.lora_id"),
        medium=medium,
        lora_name=_opt_str(f.get("lora_name"), f"{where}.lora_name"),
        group_idx=group,
    )


def decode_batch(payload: bytes) -> WireBatch:
    """A `WireBatch` from msgpack bytes in any of vLLM's forms (see the module docstring).

    Raises `KVEventFormatError` naming the offending field.
    """
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventFormatError(f"payload is not msgpack: {exc}") from None
    fields: Mapping[str, object]
    if isinstance(raw, list):
        if len(raw) < 2:
            raise _bad("batch", f"expected [ts, events, data_parallel_rank?], got {raw!r}")
        fields = dict(zip(("ts", "events", "data_parallel_rank"), raw, strict=False))
    elif isinstance(raw, dict):
        fields = {str(k): v for k, v in raw.items()}
    else:
        raise _bad("batch", f"expected an array or a map, got {raw!r}")
    ts = fields.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise _bad("batch.ts", f"expected a finite number, got {ts!r}")
    events = fields.get("events")
    if not isinstance(events, list):
        raise _bad("batch.events", f"expected an array, got {events!r}")
    return WireBatch(
        ts=float(ts),
        events=tuple(_decode_event(e, f"batch.events[{i}]") for i, e in enumerate(events)),
        data_parallel_rank=_opt_int(fields.get("data_parallel_rank"), "batch.data_parallel_rank"),
    )
