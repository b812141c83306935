"""vLLM's KV-event wire format as msgspec structs: typed events, both encodings, frames, hashes.

The schema is vLLM 0.32's ``vllm/distributed/kv_events.py`` (``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``): msgspec structs, tagged with their
class name, ``omit_defaults=True``. The batch is positional, ``[ts, events,
data_parallel_rank]`` (``array_like=True``). Two event encodings exist in the wild:

- ``"map"`` (vLLM since vLLM PR #42892, so 0.32): each event a map ``{"type": "BlockStored",
  "block_hashes": ..., ...}``; fields left at their default are omitted, the ones vLLM
  declares without a default (``lora_id``, ``medium``, ``lora_name``) are always present;
- ``"array"`` (every vLLM release before that PR, and llm-d's first decoders): each event
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``; an
  ``array_like`` struct carries every field its version declares, and releases appended
  fields, so a decoder takes any length from the required fields up.

`decode_batch` reads both (and the two-field batch of the first release, and a batch sent as
a map), `encode_batch` writes either, byte for byte as vLLM's own structs encode. The public
event types decode straight from vLLM 0.32's form; other forms go through private structs
of the same schema. No sockets here: the publisher and subscriber move the bytes.
"""

from __future__ import annotations

import re
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Final, Literal, TypeAlias, cast, final

import msgspec

from prefixflight.core import BlockHash, UsageError
from prefixflight.core.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixflight.core.validate import assert_never

__all__ = [
    "END_SEQ",
    "HashEncoding",
    "KVEventFormatError",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireEncoding",
    "WireEvent",
    "WireHash",
    "decode_batch",
    "encode_batch",
    "fold_hash",
    "kv_topic",
    "parse_live_frames",
    "parse_replay_frames",
    "parse_topic",
    "to_wire_hash",
    "wire_events",
]

WireHash: TypeAlias = int | bytes
"""A block hash as vLLM sends it: an int (its default) or the digest's bytes."""

WireEncoding: TypeAlias = Literal["map", "array"]
"""``"map"``: events as tagged maps in the positional batch (vLLM after PR #42892, so 0.32,
and the default); ``"array"``: positional events (vLLM before that PR, older llm-d)."""

HashEncoding: TypeAlias = Literal["int", "bytes"]
"""``"int"``: a 32-byte digest goes out as its last 8 bytes, big-endian (vLLM's default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); ``"bytes"``: the digest goes out whole."""

END_SEQ: Final = -1
"""The sequence number that ends a replay stream."""

_MASK64: Final = (1 << 64) - 1


class KVEventFormatError(UsageError):
    """A KV-event payload or frame that cannot be decoded; the message names the field."""


# -- the schema -------------------------------------------------------------------------------

_Hash: TypeAlias = int | Annotated[bytes, msgspec.Meta(min_length=1)]
_BlockSize: TypeAlias = Annotated[int, msgspec.Meta(ge=1)]
_Finite: TypeAlias = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
_ExtraKeys: TypeAlias = tuple[tuple[Any, ...] | None, ...] | None


def _tuples(struct: msgspec.Struct, *names: str) -> None:
    """Store the sequence fields ``names`` of a frozen struct as tuples (a decoded struct has
    tuples already): equal values compare and hash alike however they were built."""
    for name in names:
        value = getattr(struct, name)
        if type(value) is not tuple and value is not None:
            msgspec.structs.force_setattr(struct, name, tuple(value))


@final
class WireBlockStored(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag="BlockStored"):
    """vLLM's ``BlockStored``: blocks entered the cache, chained after ``parent_block_hash``.

    ``token_ids`` holds ``block_size`` tokens per block (empty when the publisher sends
    none); ``extra_keys`` holds one entry per block (vLLM's LoRA name, multimodal keys,
    cache salt); ``group_idx`` and ``kv_cache_spec_*`` describe the KV-cache group of a
    hybrid model; ``locality``, ``ownership`` and ``session_id`` come from vLLM's offloading
    connectors. Every field after ``block_size`` is optional.
    """

    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple[int, ...]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: _ExtraKeys = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        _tuples(self, "block_hashes", "token_ids", "extra_keys")


@final
class WireBlockRemoved(
    msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag="BlockRemoved"
):
    """vLLM's ``BlockRemoved``: blocks left ``medium`` (``None``: the GPU, as before vLLM
    sent the field)."""

    block_hashes: tuple[_Hash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        _tuples(self, "block_hashes")


@final
class WireAllBlocksCleared(
    msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"
):
    """vLLM's ``AllBlocksCleared``: the cache was emptied."""


WireEvent: TypeAlias = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


@final
class WireBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """vLLM's ``KVEventBatch``: the events of one engine step, in order."""

    ts: _Finite
    events: tuple[WireEvent, ...]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        _tuples(self, "events")


def _variant(
    cls: type[msgspec.Struct], *, array_like: bool, required: int, fields: int | None = None
) -> Any:
    """``cls``'s schema with other struct options: its first ``fields`` fields (all by
    default), the first ``required`` of them without a default."""
    declared = msgspec.structs.fields(cls)[:fields]
    return msgspec.defstruct(
        cls.__struct_config__.tag,  # type: ignore[arg-type]
        [
            (f.name, f.type) if i < required else (f.name, f.type, f.default)
            for i, f in enumerate(declared)
        ],
        array_like=array_like,
        omit_defaults=not array_like,
        gc=False,
        tag=cls.__struct_config__.tag,
        module=__name__,
    )


# The map form exactly as vLLM 0.32 declares it, to encode with: lora_id, medium and lora_name
# have no default there, so vLLM's decoder requires them and omit_defaults never drops them.
_MapStored: Final = _variant(WireBlockStored, array_like=False, required=7)
_MapRemoved: Final = _variant(WireBlockRemoved, array_like=False, required=2)
_MapCleared: Final = _variant(WireAllBlocksCleared, array_like=False, required=0)
# The positional form as the last release before vLLM PR #42892 declared it (up to
# kv_cache_spec_sliding_window), every field after the required ones optional (older releases
# sent fewer).
_ArrayStored: Final = _variant(WireBlockStored, array_like=True, required=4, fields=11)
_ArrayRemoved: Final = _variant(WireBlockRemoved, array_like=True, required=1, fields=3)
_ArrayCleared: Final = _variant(WireAllBlocksCleared, array_like=True, required=0)


_ArrayEvent: TypeAlias = Any  # an instance of one of the three above
_ARRAY_EVENT: Final = _ArrayStored | _ArrayRemoved | _ArrayCleared  # the type, to decode into
_ArrayBatch: Final = msgspec.defstruct(
    "_ArrayBatch",
    [
        ("ts", _Finite),
        ("events", cast(Any, tuple)[_ARRAY_EVENT, ...]),
        ("data_parallel_rank", int | None, None),
    ],
    array_like=True,
    gc=False,
    module=__name__,
)


_TAGS: Final = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
_PUBLIC: Final[dict[Any, type[WireEvent]]] = {
    _ArrayStored: WireBlockStored,
    _ArrayRemoved: WireBlockRemoved,
    _ArrayCleared: WireAllBlocksCleared,
}
_ARRAY_FIELDS: Final = {c.__struct_config__.tag: c.__struct_fields__ for c in _PUBLIC}


# -- hashes and topics ------------------------------------------------------------------------


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


# -- frames -----------------------------------------------------------------------------------

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


# -- encoding ---------------------------------------------------------------------------------

_encoder: Final = msgspec.msgpack.Encoder()
_MAP_CLEARED: Final = _MapCleared()
_ARRAY_CLEARED: Final = _ArrayCleared()


def _as_map(e: WireEvent) -> Any:
    if type(e) is WireBlockStored:
        return _MapStored(*msgspec.structs.astuple(e))
    if type(e) is WireBlockRemoved:
        return _MapRemoved(*msgspec.structs.astuple(e))
    if type(e) is WireAllBlocksCleared:
        return _MAP_CLEARED
    raise UsageError(f"expected a WireEvent, got {e!r}")


def _as_array(e: WireEvent) -> Any:
    if type(e) is WireBlockStored:
        return _ArrayStored(*msgspec.structs.astuple(e)[:11])
    if type(e) is WireBlockRemoved:
        return _ArrayRemoved(*msgspec.structs.astuple(e)[:3])
    if type(e) is WireAllBlocksCleared:
        return _ARRAY_CLEARED
    raise UsageError(f"expected a WireEvent, got {e!r}")


def _check_encoding(encoding: object) -> None:
    if encoding not in ("map", "array"):
        raise UsageError(f"encoding must be 'map' or 'array', got {encoding!r}")


def encode_batch(batch: WireBatch, *, encoding: WireEncoding = "map") -> bytes:
    """msgpack bytes of ``batch``, byte for byte as vLLM's structs encode it: ``"map"``
    (vLLM 0.32's form, the default) or ``"array"`` (positional, for older consumers; the
    fields vLLM appended after that form, ``locality`` and on, are left out)."""
    _check_encoding(encoding)
    convert = _as_map if encoding == "map" else _as_array
    events = [convert(e) for e in batch.events]
    return _encoder.encode((batch.ts, events, batch.data_parallel_rank))


# -- decoding ---------------------------------------------------------------------------------

_decode_map: Final = msgspec.msgpack.Decoder(WireBatch).decode  # vLLM 0.32's form
_decode_array: Final = msgspec.msgpack.Decoder(_ArrayBatch).decode
_decode_any: Final = msgspec.msgpack.Decoder().decode
_AT: Final = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)
_INDEX: Final = re.compile(r"^\[(\d+)\]")


def decode_batch(payload: bytes) -> WireBatch:
    """A `WireBatch` from msgpack bytes in any of vLLM's forms (see the module docstring).

    Raises `KVEventFormatError` naming the offending field (``batch.events[2].block_size:
    Expected `int` >= 1``), and for anything else msgpack or the schema refuses (truncated or
    trailing bytes, nesting too deep to decode).
    """
    try:
        return _decode(payload)
    except KVEventFormatError:
        raise
    except msgspec.MsgspecError as exc:
        raise KVEventFormatError(f"payload is not a KV-event batch: {exc}") from None
    except RecursionError:
        raise KVEventFormatError("payload is nested too deeply to decode") from None


def _decode(payload: bytes) -> WireBatch:
    try:
        return _decode_map(payload)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:
        raise KVEventFormatError(f"payload is not msgpack: {exc}") from None
    try:
        arr: Any = _decode_array(payload)
    except msgspec.ValidationError:
        return _decode_slowly(payload)  # mixed forms, a map batch, or an error to name
    return WireBatch(arr.ts, tuple(_public(e) for e in arr.events), arr.data_parallel_rank)


def _public(e: _ArrayEvent) -> WireEvent:
    return _PUBLIC[type(e)](*msgspec.structs.astuple(e))


def _decode_slowly(payload: bytes) -> WireBatch:
    """Field by field, so that an error names its field (and forms may mix)."""
    raw = _decode_any(payload)
    if isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events, rank = (*raw, None)[:3]
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise KVEventFormatError(f"batch: expected [ts, events, data_parallel_rank], got {raw!r}")
    ts = _convert(ts, _Finite, "batch.ts")
    rank = _convert(rank, int | None, "batch.data_parallel_rank")
    if not isinstance(events, list):
        raise KVEventFormatError(f"batch.events: expected an array, got {events!r}")
    return WireBatch(ts, tuple(_event(e, f"batch.events[{i}]") for i, e in enumerate(events)),
                     rank)  # fmt: skip


def _event(raw: object, where: str) -> WireEvent:
    tag: object = None
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    if not isinstance(tag, str):
        raise KVEventFormatError(f"{where}: expected an event tagged by its 'type', got {raw!r}")
    if tag not in _TAGS:
        raise KVEventFormatError(f"{where}: unknown event tag {tag!r}")
    if isinstance(raw, dict):
        event: WireEvent = _convert(raw, WireEvent, where)
        return event
    return _public(_convert(raw, _ARRAY_EVENT, where, _ARRAY_FIELDS[tag]))


def _convert(value: object, kind: Any, where: str, fields: tuple[str, ...] = ()) -> Any:
    """``msgspec.convert`` naming the field of an error (by name for a positional event)."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        message, path = _AT.match(str(exc)).groups()  # type: ignore[union-attr]
        path = path or ""
        index = _INDEX.match(path)
        if fields and index:  # $[k] of a positional event is field k-1 (k=0 is the tag)
            k = int(index[1])
            path = "." + (fields[k - 1] if 0 < k <= len(fields) else "type") + path[index.end() :]
        missing = re.match(r"Expected `array` of at least length (\d+)", message)
        if fields and missing and isinstance(value, list):
            names = fields[len(value) - 1 : int(missing[1]) - 1]
            message = f"{value[0]} is missing {', '.join(names)}"
        raise KVEventFormatError(f"{where}{path}: {message}") from None


# -- the core's events as vLLM's ---------------------------------------------------------------


def _folder(hash_encoding: HashEncoding) -> Callable[[BlockHash], WireHash]:
    """`to_wire_hash` for one encoding, with the common case (a sha256 digest) inlined."""
    if hash_encoding == "bytes":
        return lambda b: b if type(b) is bytes else fold_hash(b)
    return lambda b: int.from_bytes(b[-8:], "big") if type(b) is bytes and b else fold_hash(b)


_Family: TypeAlias = tuple[Callable[..., Any], Callable[..., Any], object]
_FAMILIES: Final[dict[str, _Family]] = {
    "public": (WireBlockStored, WireBlockRemoved, WireAllBlocksCleared()),
    "map": (_MapStored, _MapRemoved, _MAP_CLEARED),
    "array": (_ArrayStored, _ArrayRemoved, _ARRAY_CLEARED),
}


def wire_events(
    events: Iterable[KVEvent],
    *,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    hash_encoding: HashEncoding = "int",
    token_ids: bool = True,
) -> tuple[WireEvent, ...]:
    """The core's events as vLLM's, in order; consecutive stores that chain merge into one
    ``BlockStored``, as vLLM sends one per request and step. Parents always come before their
    children: a store whose block is the parent of the run before it (an engine publishing a
    request's blocks deepest first, as the scheduler does) is put in front of that run.
    ``token_ids=False`` sends every ``BlockStored`` without its tokens."""
    return tuple(_wire_events(events, "public", medium, lora_name, hash_encoding, token_ids))


def _wire_events(
    events: Iterable[KVEvent],
    family: str,
    medium: str | None,
    lora_name: str | None,
    hash_encoding: HashEncoding,
    with_token_ids: bool,
) -> list[Any]:
    """`wire_events` as the structs of ``family`` (the publisher encodes them directly)."""
    if hash_encoding not in ("int", "bytes"):
        raise UsageError(f"hash_encoding must be 'int' or 'bytes', got {hash_encoding!r}")
    stored_cls, removed_cls, cleared = _FAMILIES[family]
    fold = _folder(hash_encoding)
    out: list[Any] = []
    # the open run of chained stores: its core hashes and tokens in chain order (as deques of
    # per-event pieces, so a parent can be put in front), the parent of its first block, the
    # block size and whether it carries tokens
    pieces: deque[tuple[tuple[BlockHash, ...], tuple[int, ...]]] = deque()
    parent: BlockHash | None = None
    block_size = 0
    with_tokens = False

    def close_run() -> None:
        if not pieces:
            return
        hashes = [fold(h) for bh, _ in pieces for h in bh]
        tokens = [t for _, toks in pieces for t in toks] if with_token_ids else []
        out.append(
            stored_cls(
                block_hashes=hashes,
                parent_block_hash=None if parent is None else fold(parent),
                token_ids=tokens,
                block_size=block_size,
                lora_id=None,
                medium=medium,
                lora_name=lora_name,
            )
        )
        pieces.clear()

    for ev in events:
        match ev:
            case BlockStored():
                bh = ev.block_hashes
                same = bool(pieces) and ev.block_size == block_size
                same = same and bool(ev.token_ids) == with_tokens and bool(bh)
                if same and ev.parent_block_hash == pieces[-1][0][-1]:
                    pieces.append((bh, ev.token_ids))  # the run's child
                elif same and parent is not None and bh[-1] == parent:
                    pieces.appendleft((bh, ev.token_ids))  # the run's parent
                    parent = ev.parent_block_hash
                else:
                    close_run()
                    if bh:
                        pieces.append((bh, ev.token_ids))
                    parent = ev.parent_block_hash
                    block_size = ev.block_size
                    with_tokens = bool(ev.token_ids)
            case BlockRemoved():
                close_run()
                out.append(
                    removed_cls(block_hashes=list(map(fold, ev.block_hashes)), medium=medium)
                )
            case AllBlocksCleared():
                close_run()
                out.append(cleared)
            case _:
                assert_never(ev)
    close_run()
    return out


def _encode(ts: float, events: Sequence[Any], data_parallel_rank: int | None) -> bytes:
    """One batch of `_wire_events` structs (either family) as msgpack."""
    return _encoder.encode((ts, events, data_parallel_rank))
