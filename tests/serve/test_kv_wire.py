"""vLLM's KV-event wire format: golden bytes, both encodings, round trips, bad payloads.

The golden schema (vllm-project/vllm, ``vllm/distributed/kv_events.py``), three versions:

- ``V032*``: vLLM 0.32's structs, as released (tagged maps with ``omit_defaults=True``;
  ``lora_id``, ``medium`` and ``lora_name`` without a default) inside the positional
  ``EventBatch``. tests/serve/test_vllm_interop.py checks the same against vLLM's own classes
  in the vLLM venv.
- ``Positional*``: the field list at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34
  (``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, then extra_keys / group_idx / kv_cache_spec_kind /
  kv_cache_spec_sliding_window defaulting to None; ``BlockRemoved``: block_hashes, medium,
  group_idx=None) with ``array_like=True``: the positional form vLLM sent until vLLM PR
  #42892 removed ``array_like`` from the events.
- ``Legacy*``: the file at commit b4e69e0af33f4698e157a262cc787fe61983cd3d (the first
  release of KV events): ``EventBatch(ts, events)``, ``BlockStored(block_hashes,
  parent_block_hash, token_ids, block_size, lora_id)``, ``BlockRemoved(block_hashes)``, all
  ``array_like=True, omit_defaults=True, tag=True``.

msgspec tags a struct with its class name; the classes below set ``tag=`` to vLLM's class
names explicitly because three schema versions share this module.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflight.core import BlockHasher, UsageError
from prefixflight.serve.kv_events import (
    KVEventFormatError,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    encode_batch,
    fold_hash,
    kv_topic,
    parse_topic,
)
from prefixflight.serve.kv_events._wire import (
    END_SEQ,
    parse_live_frames,
    parse_replay_frames,
    to_wire_hash,
)

# -- vLLM's schema, three versions (see the module docstring) --------------------------------


class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class LegacyStored(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"
):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class LegacyRemoved(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"
):
    block_hashes: list[int]


class LegacyCleared(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"
):
    pass


class PositionalBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class PositionalStored(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"
):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class PositionalRemoved(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"
):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class PositionalCleared(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"
):
    pass


class NamedBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V032Stored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class V032Removed(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class V032Cleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


TS = 1700000000.25
BIG = 2**64 - 5  # a uint64 hash, as vLLM's default int hashes are
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
TOKEN_TUPLE = tuple(TOKENS)

OURS = WireBatch(
    ts=TS,
    events=(
        WireBlockStored(
            block_hashes=(BIG, 7),
            parent_block_hash=None,
            token_ids=TOKEN_TUPLE,
            block_size=4,
            medium="GPU",
        ),
        WireBlockRemoved(block_hashes=(7,), medium="GPU"),
        WireAllBlocksCleared(),
    ),
    data_parallel_rank=0,
)

# The positional batch above, byte for byte (msgpack): fixarray(3) [float64 ts,
# fixarray(3) [["BlockStored", [uint64, 7], nil, [1..8], 4, nil, "GPU", nil, nil, nil, nil,
# nil], ["BlockRemoved", [7], "GPU", nil], ["AllBlocksCleared"]], 0]. An array_like struct
# carries every declared field, defaults included (omit_defaults only thins maps).
GOLDEN_ARRAY = bytes.fromhex(
    "93cb41d954fc40100000939cab426c6f636b53746f72656492cffffffffffffffffb07c0980102030405"
    "06070804c0a3475055c0c0c0c0c094ac426c6f636b52656d6f7665649107a3475055c091b0416c6c426c"
    "6f636b73436c656172656400"
)


def _positional() -> bytes:
    return msgspec.msgpack.encode(
        PositionalBatch(
            ts=TS,
            events=[
                PositionalStored(
                    block_hashes=[BIG, 7],
                    parent_block_hash=None,
                    token_ids=TOKENS,
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                PositionalRemoved(block_hashes=[7], medium="GPU"),
                PositionalCleared(),
            ],
            data_parallel_rank=0,
        )
    )


def _v032_events() -> list[Any]:
    return [
        V032Stored(
            block_hashes=[BIG, 7],
            parent_block_hash=None,
            token_ids=TOKENS,
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        V032Removed(block_hashes=[7], medium="GPU"),
        V032Cleared(),
    ]


def test_the_default_encoding_is_vllm_032s_byte_for_byte() -> None:
    golden = msgspec.msgpack.encode(PositionalBatch(TS, _v032_events(), data_parallel_rank=0))
    assert encode_batch(OURS) == encode_batch(OURS, encoding="map") == golden
    decoded = decode_batch(golden)
    assert decoded == OURS
    assert [type(e) for e in decoded.events] == [type(e) for e in OURS.events]


def test_positional_golden_bytes_match_vllms_schema_and_ours() -> None:
    assert _positional() == GOLDEN_ARRAY
    assert encode_batch(OURS, encoding="array") == GOLDEN_ARRAY
    assert decode_batch(GOLDEN_ARRAY) == OURS


def test_a_named_batch_decodes() -> None:
    golden = msgspec.msgpack.encode(NamedBatch(ts=TS, events=_v032_events(), data_parallel_rank=0))
    assert golden[0] & 0xF0 == 0x80  # a map, not an array
    assert decode_batch(golden) == OURS


def test_both_event_forms_may_mix_in_one_batch() -> None:
    stored, _, cleared = _v032_events()
    mixed = [stored, PositionalRemoved(block_hashes=[7], medium="GPU"), cleared]
    assert decode_batch(msgspec.msgpack.encode([TS, mixed, 0])) == OURS


def test_the_legacy_two_field_batch_decodes() -> None:
    golden = msgspec.msgpack.encode(
        LegacyBatch(
            ts=TS,
            events=[
                LegacyStored(
                    block_hashes=[-3, 9],  # early vLLM sent Python hash() values: signed
                    parent_block_hash=5,
                    token_ids=[1, 2],
                    block_size=1,
                    lora_id=None,
                ),
                LegacyRemoved(block_hashes=[9]),
                LegacyCleared(),
            ],
        )
    )
    batch = decode_batch(golden)
    assert batch.data_parallel_rank is None
    assert batch.events == (
        WireBlockStored(block_hashes=(-3, 9), parent_block_hash=5, token_ids=(1, 2), block_size=1),
        WireBlockRemoved(block_hashes=(9,)),
        WireAllBlocksCleared(),
    )
    assert fold_hash(-3) == 2**64 - 3  # read as uint64, as llm-d's indexer reads it


FULL = WireBlockStored(
    block_hashes=(b"\x01" * 32,),
    parent_block_hash=b"\x02" * 32,
    token_ids=(4, 5),
    block_size=2,
    lora_id=3,
    medium="CPU",
    lora_name="adapter",
    extra_keys=(("adapter", "salt"),),
    group_idx=1,
    kv_cache_spec_kind="full_attention",
    kv_cache_spec_sliding_window=128,
    locality="LOCAL",
    ownership="tier-2",
    session_id="s-1",
)


def test_every_optional_field_vllm_declares_is_kept() -> None:
    named = V032Stored(**msgspec.structs.asdict(FULL))
    assert decode_batch(msgspec.msgpack.encode([1.0, [named]])).events == (FULL,)
    assert encode_batch(WireBatch(1.0, (FULL,))) == msgspec.msgpack.encode((1.0, [named], None))
    # the positional form ends at kv_cache_spec_sliding_window, as vLLM's last one did
    fields = msgspec.structs.asdict(FULL)
    positional = PositionalStored(**{k: fields[k] for k in PositionalStored.__struct_fields__})
    assert decode_batch(msgspec.msgpack.encode(PositionalBatch(1.0, [positional]))).events == (
        msgspec.structs.replace(FULL, locality=None, ownership=None, session_id=None),
    )


def test_fields_a_later_vllm_may_add_are_ignored() -> None:
    named = {**msgspec.to_builtins(V032Removed(block_hashes=[7], medium="GPU")), "future": [1]}
    positional = ["BlockRemoved", [7], "GPU", None, "future", 1]
    for event in (named, positional):
        payload = msgspec.msgpack.encode([1.0, [event], 0])
        assert decode_batch(payload).events == (WireBlockRemoved(block_hashes=(7,), medium="GPU"),)


def test_events_built_from_lists_equal_decoded_ones_and_hash_alike() -> None:
    built = WireBlockStored(
        block_hashes=[1, 2],  # type: ignore[arg-type]
        parent_block_hash=None,
        token_ids=[3, 4],  # type: ignore[arg-type]
        block_size=1,
    )
    decoded = decode_batch(encode_batch(WireBatch(0.0, [built]))).events[0]  # type: ignore[arg-type]
    assert built == decoded and hash(built) == hash(decoded)
    assert built.block_hashes == (1, 2) and built.token_ids == (3, 4)


def test_our_hashes_fold_as_vllm_converts_its_own() -> None:
    digest = BlockHasher(block_size=2).hash_tokens([1, 2])[0]
    assert isinstance(digest, bytes) and len(digest) == 32
    # vLLM's maybe_convert_block_hash: int.from_bytes(hash, "big") & (2**64 - 1)
    vllm_int = int.from_bytes(digest, "big") & (2**64 - 1)
    assert to_wire_hash(digest, "int") == vllm_int == fold_hash(digest)
    assert to_wire_hash(digest, "bytes") == digest
    crc = BlockHasher(block_size=2, algorithm="crc32x2").hash_tokens([1, 2])[0]
    assert to_wire_hash(crc, "int") == crc == to_wire_hash(crc, "bytes")
    assert fold_hash(b"\x01\x02") == 0x0102  # short bytes: left-padded, as llm-d pads them


def test_topics_as_llm_d_parses_them() -> None:
    assert kv_topic("pod-1", "HuggingFaceTB/SmolLM2-135M") == "kv@pod-1@HuggingFaceTB/SmolLM2-135M"
    assert parse_topic("kv@pod-1@m") == ("pod-1", "m")
    assert parse_topic("kv-events") == ("kv-events", "")
    with pytest.raises(UsageError, match="'a@b'"):
        kv_topic("a@b", "m")


_hash = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
_name = st.none() | st.text(max_size=5)
_tuple = st.lists  # lists: the structs store them as tuples
_stored = st.builds(
    WireBlockStored,
    block_hashes=st.lists(_hash, max_size=4),
    parent_block_hash=st.none() | _hash,
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 100),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=_name,
    extra_keys=st.none() | st.lists(st.none() | st.tuples(st.text(max_size=3)), max_size=3),
    group_idx=st.none() | st.integers(0, 3),
    kv_cache_spec_kind=_name,
    kv_cache_spec_sliding_window=st.none() | st.integers(1, 4096),
    locality=_name,
    ownership=_name,
    session_id=_name,
)
_removed = st.builds(
    WireBlockRemoved,
    block_hashes=st.lists(_hash, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(0, 3),
    locality=_name,
    ownership=_name,
)
_batch = st.builds(
    WireBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(_stored, _removed, st.just(WireAllBlocksCleared())), max_size=6),
    data_parallel_rank=st.none() | st.integers(0, 7),
)


def _positional_fields_only(e: Any) -> Any:
    """What the positional form carries: nothing after kv_cache_spec_sliding_window."""
    if isinstance(e, WireBlockStored):
        return msgspec.structs.replace(e, locality=None, ownership=None, session_id=None)
    if isinstance(e, WireBlockRemoved):
        return msgspec.structs.replace(e, locality=None, ownership=None)
    return e


@given(batch=_batch)
def test_round_trip(batch: WireBatch) -> None:
    assert decode_batch(encode_batch(batch, encoding="map")) == batch
    positional = tuple(_positional_fields_only(e) for e in batch.events)
    assert decode_batch(encode_batch(batch, encoding="array")).events == positional


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "payload is not msgpack"),
        (msgspec.msgpack.encode(5), "batch: expected [ts, events"),
        (msgspec.msgpack.encode([1.0]), "batch: expected [ts, events"),
        (msgspec.msgpack.encode(["x", []]), "batch.ts: Expected `float`, got `str`"),
        (msgspec.msgpack.encode([float("nan"), []]), "batch.ts: Expected `float` >="),
        (msgspec.msgpack.encode([1.0, {}]), "batch.events: expected an array, got {}"),
        (msgspec.msgpack.encode([1.0, [], "0"]), "batch.data_parallel_rank: Expected `int | null`"),
        (msgspec.msgpack.encode([1.0, [["Nope"]]]), "batch.events[0]: unknown event tag 'Nope'"),
        (msgspec.msgpack.encode([1.0, [5]]), "batch.events[0]: expected an event tagged"),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]),
            "batch.events[0]: BlockStored is missing parent_block_hash, token_ids, block_size",
        ),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [], 4]]]),
            "batch.events[0].block_hashes[0]: Expected `int | bytes`, got `float`",
        ),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [b""], None, [], 4]]]),
            "batch.events[0].block_hashes[0]: Expected `bytes` of length >= 1",
        ),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [True], 4]]]),
            "batch.events[0].token_ids[0]: Expected `int`, got `bool`",
        ),
        (
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]),
            "batch.events[0].block_size: Expected `int` >= 1",
        ),
        (
            msgspec.msgpack.encode([1.0, [["AllBlocksCleared"], ["BlockRemoved", [1], 7]]]),
            "batch.events[1].medium: Expected `str | null`, got `int`",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
            "batch.events[0]: Object missing required field `parent_block_hash`",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}]]),
            "batch.events[0].block_hashes: Expected `array`, got `str`",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"block_hashes": []}]]),
            "batch.events[0]: expected an event tagged by its 'type'",
        ),
    ],
)
def test_bad_payloads_name_the_field(payload: bytes, message: str) -> None:
    with pytest.raises(KVEventFormatError) as caught:
        decode_batch(payload)
    assert str(caught.value).startswith(message), str(caught.value)


def test_live_and_replay_frames_in_both_vllm_layouts() -> None:
    seq = (5).to_bytes(8, "big")
    end = (-1).to_bytes(8, "big", signed=True)
    assert parse_live_frames([b"kv@p@m", seq, b"x"]) == ("kv@p@m", 5, b"x")
    assert parse_replay_frames([b"", b"kv@p@m", seq, b"x"]) == ("kv@p@m", 5, b"x")
    assert parse_replay_frames([b"", seq, b"x"]) == (None, 5, b"x")  # before the topic frame
    assert parse_replay_frames([b"", b"", end, b""]) == (None, END_SEQ, b"")
    assert parse_replay_frames([b"", end, b""]) == (None, END_SEQ, b"")
    for bad in ([b"t", b"\x00", b"x"], [b"t", seq]):
        with pytest.raises(KVEventFormatError, match="seq"):
            parse_live_frames(bad)
    with pytest.raises(KVEventFormatError, match="replay reply"):
        parse_replay_frames([b"", b"short", b"x"])
