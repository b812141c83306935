"""NVIDIA Dynamo's KV router index (``dynamo.llm.RadixTree``, from the ``ai-dynamo-runtime``
wheel) under `KVIndexConformance`.

The tree is what Dynamo's KV-aware router scores workers with: each worker's ``stored``,
``removed`` and ``cleared`` events (JSON, as its ``apply_event`` reads them) build a radix
tree of block hashes, and ``find_matches`` returns, per worker, how many leading blocks of
a prompt it holds. The adapter feeds it the machine's events as one worker's, the way a
vLLM worker's KV events reach it:

- a block's ``block_hash`` (the engine's hash, which the tree looks parents up by) is a
  stable digest of its key, and its ``tokens_hash`` is Dynamo's own hash of the block's
  tokens (``compute_block_hash_for_seq``: each block hashed alone, unchained; the tree
  chains blocks by where they hang);
- ``hits(tokens)`` is the worker's score from ``find_matches`` over the same hashes of the
  prompt's full blocks;
- the block size is 16 tokens (vLLM's default; the tree itself takes hashes of any size).

Dynamo raises ``RuntimeError`` for an event it cannot apply (a parent it does not know, a
block to remove it does not hold); the adapter lets it through, so the machine reports it.

Runs where ``ai-dynamo-runtime`` is installed (``benchmarks/peers/setup.sh`` installs 1.6.1
without its dependencies; ``dynamo.llm`` needs pydantic), imported when an adapter is made.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from importlib import import_module
from typing import Any

from .._declare import IndexSemantics

__all__ = ["DynamoIndexAdapter"]

_WORKER = 0


def _block_hash(key: Sequence[int]) -> int:
    """The engine's hash of a block (a stable unsigned 64-bit digest of its key)."""
    digest = hashlib.blake2b(repr(tuple(key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class DynamoIndexAdapter:
    """One Dynamo ``RadixTree`` fed the machine's events as worker 0's (``tree_cls`` replaces
    the class: anything with its ``apply_event``, ``find_matches`` and ``clear_all_blocks``).

    Declares ``order="parents-first"`` (a block stored before its parent is refused:
    ``Failed to find parent block``; a removed parent takes its descendants with it, so
    their own ``removed`` events after it fail: ``Failed to find block``) and
    ``copies="single"`` (a block's workers are a set: one ``removed`` of a block stored
    twice drops it).
    """

    semantics = IndexSemantics(order="parents-first", removals="children-first", copies="single")
    block_size = 16

    def __init__(self, *, tree_cls: type[Any] | None = None) -> None:
        llm = import_module("dynamo.llm")
        self._hash = llm.compute_block_hash_for_seq
        self.tree = (tree_cls or llm.RadixTree)()
        self._event_id = 0

    def _local(self, tokens: Sequence[int]) -> list[int]:
        full = len(tokens) - len(tokens) % self.block_size
        return list(self._hash(list(tokens[:full]), self.block_size)) if full else []

    def apply(self, kind: str, key: Sequence[int] | None) -> None:
        bs = self.block_size
        data: Any
        if kind == "cleared" or key is None:
            data = "cleared"
        elif kind == "stored":
            parent = _block_hash(key[:-bs]) if len(key) > bs else None
            block = {"block_hash": _block_hash(key), "tokens_hash": self._local(key[-bs:])[0]}
            data = {"stored": {"parent_hash": parent, "blocks": [block]}}
        else:
            data = {"removed": {"block_hashes": [_block_hash(key)]}}
        self._event_id += 1
        event = {"event_id": self._event_id, "data": data}
        self.tree.apply_event(_WORKER, json.dumps(event).encode())

    def hits(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` the tree says worker 0 holds."""
        local = self._local(tokens)
        if not local:
            return 0
        scores = self.tree.find_matches(local).scores
        return int(scores.get((_WORKER, 0), 0))
