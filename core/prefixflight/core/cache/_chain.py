"""The chain loops of `BlockHasher.hash_tokens`, kept free of attrs so the optional compiled
build (mypyc; see docs/performance.md) can compile them; `_hashing` keeps the public class."""

from __future__ import annotations

import hashlib
import zlib

__all__ = ["chain_crc", "chain_sha256"]

_sha256 = hashlib.sha256
_crc32 = zlib.crc32


def chain_sha256(chain: bytes, data: bytes, step: int, end: int) -> tuple[bytes, ...]:
    """sha256 over each ``step``-byte block of ``data[:end]``, each seeded by the previous
    digest (``chain`` for the first)."""
    out: list[bytes] = []
    append = out.append
    for i in range(0, end, step):
        chain = _sha256(chain + data[i : i + step]).digest()
        append(chain)
    return tuple(out)


def chain_crc(lo: int, hi: int, data: bytes, step: int, end: int) -> tuple[int, ...]:
    """Two chained CRC-32s per ``step``-byte block of ``data[:end]``, as one 64-bit int."""
    out: list[int] = []
    append = out.append
    for i in range(0, end, step):
        chunk = data[i : i + step]
        lo = _crc32(chunk, lo ^ hi)
        hi = _crc32(chunk, hi ^ 0x9E3779B9 ^ lo)
        append((hi << 32) | lo)
    return tuple(out)
