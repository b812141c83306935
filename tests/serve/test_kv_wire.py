"""vLLM's KV-event wire format: golden bytes, both encodings, round trips, bad payloads.

Where the golden schema comes from (vllm-project/vllm, ``vllm/distributed/kv_events.py``):

- ``Legacy*``: the file at commit b4e69e0af33f4698e157a262cc787fe61983cd3d (the first
  release of KV events): ``EventBatch(ts, events)`` and ``KVCacheEvent`` subclasses, all
  msgspec structs with ``array_like=True, omit_defaults=True, tag=True``;
  ``BlockStored(block_hashes: list[int], parent_block_hash, token_ids, block_size, lora_id)``,
  ``BlockRemoved(block_hashes)``.
- ``Positional*``: the field list at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34
  (``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, then extra_keys / group_idx / kv_cache_spec_kind /
  kv_cache_spec_sliding_window defaulting to None; ``BlockRemoved``: block_hashes, medium,
  group_idx=None; ``EventBatch``: ts, events, data_parallel_rank=None) with the struct
  options of b4e69e0a (``array_like=True``): the positional form vLLM sent until vLLM PR
  #42892 removed ``array_like``.
- ``Named*``: the structs exactly as declared at 0181ea31 (no ``array_like``: maps, the tag
  under ``"type"``). A capture from vLLM 0.26 (in volcano-sh/kthena issue #1535) shows
  named events inside a positional batch; both shapes are tested.

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
    END_SEQ,
    KVEventFormatError,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    encode_batch,
    fold_hash,
    kv_topic,
    parse_live_frames,
    parse_replay_frames,
    parse_topic,
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


class NamedStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
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


class NamedRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class NamedCleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


TS = 1700000000.25
BIG = 2**64 - 5  # a uint64 hash, as vLLM's default int hashes are
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]

OURS = WireBatch(
    ts=TS,
    events=(
        WireBlockStored(
            block_hashes=(BIG, 7),
            parent_block_hash=None,
            token_ids=TOKENS,
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


def _named_events() -> list[Any]:
    return [
        NamedStored(
            block_hashes=[BIG, 7],
            parent_block_hash=None,
            token_ids=TOKENS,
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        NamedRemoved(block_hashes=[7], medium="GPU"),
        NamedCleared(),
    ]


def test_positional_golden_bytes_match_vllms_schema_and_ours() -> None:
    assert _positional() == GOLDEN_ARRAY
    assert encode_batch(OURS, encoding="array") == GOLDEN_ARRAY
    assert decode_batch(GOLDEN_ARRAY) == OURS


def test_named_events_in_a_positional_batch_match_ours() -> None:
    # vLLM 0.26's shape: named events, positional batch
    golden = msgspec.msgpack.encode([TS, _named_events(), 0])
    assert encode_batch(OURS, encoding="map") == golden
    assert decode_batch(golden) == OURS


def test_a_named_batch_decodes() -> None:
    golden = msgspec.msgpack.encode(NamedBatch(ts=TS, events=_named_events(), data_parallel_rank=0))
    assert golden[0] & 0xF0 == 0x80  # a map, not an array
    assert decode_batch(golden) == OURS


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


def test_trailing_fields_vllm_added_later_are_accepted_and_ignored() -> None:
    stored = PositionalStored(
        block_hashes=[b"\x01" * 32],
        parent_block_hash=b"\x02" * 32,
        token_ids=[4, 5],
        block_size=2,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("salt",)],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=128,
    )
    for payload in (
        msgspec.msgpack.encode(PositionalBatch(ts=1.0, events=[stored])),
        msgspec.msgpack.encode(
            NamedBatch(ts=1.0, events=[NamedStored(**msgspec.structs.asdict(stored))])
        ),
    ):
        (event,) = decode_batch(payload).events
        assert event == WireBlockStored(
            block_hashes=(b"\x01" * 32,),
            parent_block_hash=b"\x02" * 32,
            token_ids=(4, 5),
            block_size=2,
            lora_id=3,
            medium="CPU",
            lora_name="adapter",
            group_idx=1,
        )


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
_stored = st.builds(
    WireBlockStored,
    block_hashes=st.lists(_hash, max_size=4),
    parent_block_hash=st.none() | _hash,
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 100),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=st.none() | st.text(max_size=5),
    group_idx=st.none() | st.integers(0, 3),
)
_removed = st.builds(
    WireBlockRemoved,
    block_hashes=st.lists(_hash, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(0, 3),
)
_batch = st.builds(
    WireBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(_stored, _removed, st.just(WireAllBlocksCleared())), max_size=6),
    data_parallel_rank=st.none() | st.integers(0, 7),
)


@given(batch=_batch, encoding=st.sampled_from(["array", "map"]))
def test_round_trip(batch: WireBatch, encoding: Any) -> None:
    assert decode_batch(encode_batch(batch, encoding=encoding)) == batch


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode(5), "batch"),
        (msgspec.msgpack.encode([1.0]), "batch"),
        (msgspec.msgpack.encode(["x", []]), "batch.ts"),
        (msgspec.msgpack.encode([1.0, {}]), "batch.events"),
        (msgspec.msgpack.encode([1.0, [["Nope"]]]), "unknown event tag 'Nope'"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]), "missing parent_block_hash"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [], 4]]]), "block_hashes"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]), "block_size"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], 7]]]), "medium"),
        (msgspec.msgpack.encode([1.0, [{"block_hashes": []}]]), "'type'"),
    ],
)
def test_bad_payloads_name_the_field(payload: bytes, where: str) -> None:
    with pytest.raises(KVEventFormatError, match=where.replace("[", r"\[")):
        decode_batch(payload)


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
