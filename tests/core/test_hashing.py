from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflight.core import BlockHasher, ConfigError, UsageError

tokens = st.lists(st.integers(0, 50_000), max_size=80)
algorithms = st.sampled_from(["sha256", "crc32x2"])


@given(tokens, tokens, st.integers(1, 8), algorithms)
def test_shared_token_prefixes_give_shared_hash_prefixes(
    a: list[int], b: list[int], bs: int, algo: str
) -> None:
    h = BlockHasher(block_size=bs, algorithm=algo)  # type: ignore[arg-type]
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    ha, hb = h.hash_tokens(a), h.hash_tokens(b)
    full_shared_blocks = shared // bs
    assert ha[:full_shared_blocks] == hb[:full_shared_blocks]
    if algo == "sha256" and len(ha) > full_shared_blocks and len(hb) > full_shared_blocks:
        assert ha[full_shared_blocks] != hb[full_shared_blocks]


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=60), st.integers(1, 6), st.data())
def test_changing_one_token_changes_exactly_the_hashes_from_its_block_on(
    toks: list[int], bs: int, data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(toks) - 1))
    changed = list(toks)
    changed[i] += 1
    for include_partial in (False, True):
        h = BlockHasher(block_size=bs, include_partial=include_partial)
        before, after = h.hash_tokens(toks), h.hash_tokens(changed)
        j = i // bs
        assert before[:j] == after[:j]
        assert all(x != y for x, y in zip(before[j:], after[j:], strict=True))


@given(tokens, st.text(max_size=5), st.text(max_size=5))
def test_namespaces_separate(toks: list[int], ns1: str, ns2: str) -> None:
    a = BlockHasher(block_size=4, namespace=ns1).hash_tokens(toks)
    b = BlockHasher(block_size=4, namespace=ns2).hash_tokens(toks)
    if ns1 != ns2:
        assert not set(a) & set(b)
    else:
        assert a == b


@given(st.integers(0, 40), st.integers(1, 7))
def test_full_blocks_only_unless_asked(n: int, bs: int) -> None:
    toks = list(range(n))
    assert len(BlockHasher(block_size=bs).hash_tokens(toks)) == n // bs
    with_partial = BlockHasher(block_size=bs, include_partial=True)
    assert len(with_partial.hash_tokens(toks)) == -(-n // bs) == with_partial.num_blocks(n)


def test_the_chain_is_sha256_over_the_parent_and_little_endian_token_bytes() -> None:
    # derived from the documented construction, independently of the implementation
    ns = b"model-a"
    seed = hashlib.sha256(b"prefixflight/block-hash/v1\x00" + len(ns).to_bytes(8, "little") + ns)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    data = array("q", toks)
    if sys.byteorder != "little":
        data.byteswap()
    raw = data.tobytes()
    h0 = hashlib.sha256(seed.digest() + raw[:32]).digest()
    h1 = hashlib.sha256(h0 + raw[32:]).digest()
    assert BlockHasher(block_size=4, namespace=ns).hash_tokens(toks) == (h0, h1)


def test_hashes_are_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from prefixflight.core import BlockHasher;"
        "print([BlockHasher(block_size=3, namespace='t', algorithm=a).hash_tokens(range(10))"
        " for a in ('sha256', 'crc32x2')])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="0"):
        BlockHasher(block_size=0)
    with pytest.raises(ConfigError, match="md5"):
        BlockHasher(algorithm="md5")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="int64"):
        BlockHasher().hash_tokens([2**70])


@given(st.lists(st.integers(0, 999), max_size=40), tokens, st.integers(1, 5), algorithms)
def test_a_chain_continues_from_its_last_hash(
    head: list[int], tail: list[int], bs: int, algo: str
) -> None:
    h = BlockHasher(block_size=bs, namespace="ns", algorithm=algo)  # type: ignore[arg-type]
    head = head[: len(head) - len(head) % bs]  # whole blocks
    whole = h.hash_tokens(head + tail)
    parent = h.hash_tokens(head)[-1] if head else None
    assert h.hash_tokens(tail, parent=parent) == whole[len(head) // bs :]


def test_a_foreign_parent_is_rejected() -> None:
    with pytest.raises(UsageError, match="32-byte"):
        BlockHasher().hash_tokens([1], parent=7)
    with pytest.raises(UsageError, match="64-bit"):
        BlockHasher(algorithm="crc32x2").hash_tokens([1], parent=b"x")


def test_crc64_is_a_deprecated_alias_of_crc32x2() -> None:
    """The 64-bit hash is two chained CRC-32s: named for what it is, the old name warns."""
    with pytest.warns(DeprecationWarning, match="crc32x2"):
        old = BlockHasher(4, algorithm="crc64")
    new = BlockHasher(4, algorithm="crc32x2")
    assert old == new and old.algorithm == "crc32x2"
    assert old.hash_tokens(range(12)) == new.hash_tokens(range(12))
