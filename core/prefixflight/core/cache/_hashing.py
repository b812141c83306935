"""Chained block hashes over token ids.

Block ``i``'s hash covers block ``i``'s tokens and block ``i - 1``'s hash, so two prompts share
the first ``k`` hashes exactly when they share the first ``k`` blocks of tokens. The chain is
seeded by a namespace (model id, LoRA name, cache salt), so different tenants never share a
block. Hashes are computed from little-endian int64 token bytes with hashlib or zlib, never
with the builtin ``hash``: they are the same in every process, on every platform, in every
Python version.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Hashable, Sequence
from typing import Final, Literal, TypeAlias, final

import attrs

from ..validate import check_choice, check_instance, check_int, is_int
from ._chain import chain_crc, chain_sha256

__all__ = ["BlockHash", "BlockHasher", "HashAlgorithm"]

BlockHash: TypeAlias = Hashable
"""A block's identity: ``bytes`` from `BlockHasher`, ``int`` in Mooncake traces."""

HashAlgorithm: TypeAlias = Literal["sha256", "crc32x2"]
"""``"crc64"`` is still accepted as a deprecated alias of ``"crc32x2"``."""

_SEED_TAG: Final = b"prefixflight/block-hash/v1\x00"
_TOKEN_BYTES: Final = 8
_SWAP: Final = sys.byteorder != "little"
_sha256 = hashlib.sha256


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        buf = array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        from .._errors import UsageError

        raise UsageError(f"token ids must be ints in the int64 range: {exc}") from None
    if _SWAP:  # pragma: no cover - big-endian hosts only
        buf.byteswap()
    return buf.tobytes()


def _algorithm(value: Literal["sha256", "crc32x2", "crc64"]) -> HashAlgorithm:
    """``"crc64"`` (the former name of ``"crc32x2"``) -> ``"crc32x2"``, with a warning."""
    if value == "crc64":
        import warnings

        warnings.warn(
            'BlockHasher(algorithm="crc64") is deprecated: the algorithm is two chained '
            'CRC-32s, now named "crc32x2"',
            DeprecationWarning,
            stacklevel=4,
        )
        return "crc32x2"
    return value  # anything else: the validator names it


def _as_bytes(namespace: str | bytes) -> bytes:
    return namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)


@final
@attrs.frozen
class BlockHasher:
    """Token ids -> tuple of chained block hashes.

    ``algorithm="sha256"`` (the default) gives 32-byte digests and is collision-safe.
    ``algorithm="crc32x2"`` chains two CRC-32s into a 64-bit int (it is not a CRC-64):
    faster, but an adversary can construct collisions, so never use it where tenants share
    one cache. ``"crc64"``, its former name, still works and warns (`DeprecationWarning`).

    By default only full blocks are hashed (engines reuse only full pages);
    ``include_partial=True`` also hashes the trailing partial block, as Mooncake traces and
    llm-d's router do.
    """

    block_size: int = attrs.field(default=16)
    namespace: str | bytes = attrs.field(default=b"")
    algorithm: HashAlgorithm = attrs.field(default="sha256", converter=_algorithm)
    include_partial: bool = attrs.field(default=False)
    _seed: bytes = attrs.field(init=False, repr=False, eq=False)

    @block_size.validator
    def _check_block_size(self, _a: object, value: object) -> None:
        check_int("block_size", value, minimum=1)

    @namespace.validator
    def _check_namespace(self, _a: object, value: object) -> None:
        check_instance("namespace", value, (str, bytes))

    @algorithm.validator
    def _check_algorithm(self, _a: object, value: object) -> None:
        check_choice("algorithm", value, ("sha256", "crc32x2"))

    def __attrs_post_init__(self) -> None:
        ns = _as_bytes(self.namespace)
        seed = _sha256(_SEED_TAG + len(ns).to_bytes(8, "little") + ns).digest()
        object.__setattr__(self, "_seed", seed)

    def num_blocks(self, num_tokens: int) -> int:
        """How many hashes `hash_tokens` returns for a prompt of ``num_tokens`` tokens."""
        full, rest = divmod(num_tokens, self.block_size)
        return full + (1 if rest and self.include_partial else 0)

    def hash_tokens(
        self, token_ids: Sequence[int], *, parent: BlockHash | None = None
    ) -> tuple[BlockHash, ...]:
        """Chained hashes of ``token_ids``' blocks, block 0 first.

        ``parent`` continues a chain: give the hash of the block just before ``token_ids``
        (which must then start on a block boundary) to hash only the new blocks, in O(new
        blocks); ``hash_tokens(a + b)[len(a) // block_size:] == hash_tokens(b,
        parent=hash_tokens(a)[-1])`` for ``a`` a whole number of blocks.
        """
        data = _token_bytes(token_ids)
        step = self.block_size * _TOKEN_BYTES
        end = len(data) if self.include_partial else len(data) - len(data) % step
        if self.algorithm == "sha256":
            chain = self._seed if parent is None else self._parent_bytes(parent)
            return chain_sha256(chain, data, step, end)
        if parent is None:
            lo = int.from_bytes(self._seed[:4], "little")
            hi = int.from_bytes(self._seed[4:8], "little")
        else:
            value = self._parent_int(parent)
            lo, hi = value & 0xFFFFFFFF, value >> 32
        return chain_crc(lo, hi, data, step, end)

    @staticmethod
    def _parent_bytes(parent: BlockHash) -> bytes:
        if not isinstance(parent, bytes) or len(parent) != 32:
            from .._errors import UsageError

            raise UsageError(f"parent must be a 32-byte sha256 block hash, got {parent!r}")
        return parent

    @staticmethod
    def _parent_int(parent: BlockHash) -> int:
        if is_int(parent) and 0 <= parent < 2**64:
            return parent
        from .._errors import UsageError

        raise UsageError(f"parent must be a 64-bit crc32x2 block hash, got {parent!r}")
