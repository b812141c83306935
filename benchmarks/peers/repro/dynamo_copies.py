"""Dynamo: the ``RadixTree`` does not count copies: one ``removed`` event of a block stored
twice drops it, while the engine still holds the other copy.

Reproduces on Dynamo alone (checked with ai-dynamo-runtime 1.6.1, CPU):

    python dynamo_copies.py    # exit 1: reproduced; exit 0: copies counted

vLLM caches a block twice when two requests compute it (its block pool does not
de-duplicate) and reports each copy: a ``BlockStored`` per copy, a ``BlockRemoved`` per copy
evicted. Block A (tokens 0-15) is stored twice and one copy is evicted: the engine still
serves A from the other, but the tree's block holds a set of workers, so the first removal
takes the worker off it and the tree scores the worker 0 blocks.
"""

from __future__ import annotations

import json
import sys

from dynamo.llm import RadixTree, compute_block_hash_for_seq

BLOCK = 16
local = compute_block_hash_for_seq(list(range(BLOCK)), BLOCK)
A = 1001  # the engine's hash of the block
tree = RadixTree()
stored = {"parent_hash": None, "blocks": [{"block_hash": A, "tokens_hash": local[0]}]}
events = [("stored", stored), ("stored", stored), ("removed", {"block_hashes": [A]})]
for event_id, (kind, body) in enumerate(events, 1):
    tree.apply_event(0, json.dumps({"event_id": event_id, "data": {kind: body}}).encode())
    print(f"{kind} A: the tree scores worker 0: {tree.find_matches(local).scores.get((0, 0), 0)}")
score = tree.find_matches(local).scores.get((0, 0), 0)
print(f"the engine holds 1 copy of A; the tree scores worker 0: {score}")
if score == 1:
    print("not reproduced: the tree kept A until its last copy was removed")
    sys.exit(0)
print("REPRODUCED: one removed event of a block stored twice drops it")
sys.exit(1)
