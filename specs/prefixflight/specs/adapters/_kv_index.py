"""prefixflight's router index (`prefixflight.serve.kv_events.ReplicaBlockIndex`) under
`KVIndexConformance`.

The index reads a replica's KV events in vLLM's wire format. It is built the way ``prefixflight
route`` builds it for a vLLM replica: keyed by the router's own `BlockHasher`, each stored
block's key rebuilt from its ``token_ids`` chained from its parent's (the engine's own hashes
are unknown to the router). The adapter turns the machine's events into `WireBlockStored`,
`WireBlockRemoved` and `WireAllBlocksCleared`, one block each, with the engine's hash of a
block a stable function of its key. Needs the ``serve`` extra (msgspec), imported when an
adapter is made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from .._declare import IndexSemantics

__all__ = ["ReplicaIndexAdapter"]


def _engine_hash(key: Sequence[int]) -> int:
    """The engine's hash of a block (a stable 63-bit digest of its key)."""
    digest = hashlib.blake2b(repr(tuple(key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class ReplicaIndexAdapter:
    """One `ReplicaBlockIndex` fed the machine's events (``index_cls`` replaces the class).

    Declares ``order="parents-first"``: a block is keyed from its parent's rebuilt key, so a
    child stored before its parent cannot be keyed. It counts copies (the default).
    """

    semantics = IndexSemantics(order="parents-first")
    block_size = 4

    def __init__(self, *, index_cls: type[Any] | None = None) -> None:
        from prefixflight.core import BlockHasher
        from prefixflight.serve import kv_events

        self._wire = kv_events
        self.hasher = BlockHasher(self.block_size)
        self.index = (index_cls or kv_events.ReplicaBlockIndex)("replica", hasher=self.hasher)

    def apply(self, kind: str, key: Sequence[int] | None) -> None:
        wire, bs = self._wire, self.block_size
        event: Any
        if kind == "cleared" or key is None:
            event = wire.WireAllBlocksCleared()
        elif kind == "stored":
            parent = _engine_hash(key[:-bs]) if len(key) > bs else None
            event = wire.WireBlockStored(
                block_hashes=(_engine_hash(key),),
                parent_block_hash=parent,
                token_ids=tuple(key[-bs:]),
                block_size=bs,
            )
        else:
            event = wire.WireBlockRemoved(block_hashes=(_engine_hash(key),))
        self.index.apply(event)

    def hits(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` the index says are cached."""
        return int(self.index.prefix_blocks(self.hasher.hash_tokens(tokens)))
