"""Dynamo: after a block's ``removed`` event, the ``RadixTree`` has also dropped the block's
descendants, so their own ``removed`` events fail as if the tree never held them.

Reproduces on Dynamo alone (checked with ai-dynamo-runtime 1.6.1, CPU):

    python dynamo_removal_after_parent.py    # exit 1: reproduced; exit 0: fixed

The engine caches blocks A (tokens 0-15) and AB (0-31, parent A), then evicts both, and the
two ``removed`` events reach the tree parent first, as two events. The first takes AB out
with A; the second raises ``RuntimeError`` ("Failed to find block"), the same error as a
block the tree never held. (The tree ends right: nothing is indexed. The same two hashes in
one ``removed`` event raise nothing.) vLLM frees a chain tail first, so one vLLM worker's
stream removes children first; a consumer that takes a step's removals in any order meets
the error.
"""

from __future__ import annotations

import json
import sys

from dynamo.llm import RadixTree, compute_block_hash_for_seq

BLOCK = 16
local = compute_block_hash_for_seq(list(range(2 * BLOCK)), BLOCK)
A, AB = 1001, 1002  # the engine's hashes of the two blocks
tree = RadixTree()
event_id = 0


def apply(data: object) -> str:
    global event_id
    event_id += 1
    try:
        tree.apply_event(0, json.dumps({"event_id": event_id, "data": data}).encode())
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "applied"


def stored(block: int, tokens_hash: int, parent: int | None) -> str:
    blocks = [{"block_hash": block, "tokens_hash": tokens_hash}]
    return apply({"stored": {"parent_hash": parent, "blocks": blocks}})


print("stored A:", stored(A, local[0], None), "| stored AB:", stored(AB, local[1], A))
print("removed A:", apply({"removed": {"block_hashes": [A]}}))
child = apply({"removed": {"block_hashes": [AB]}})
print("removed AB:", child)
print("removed 7 (never stored):", apply({"removed": {"block_hashes": [7]}}))
print("the tree scores worker 0:", tree.find_matches(local).scores.get((0, 0), 0))
if child == "applied":
    print("not reproduced: the child's removal after its parent's was applied")
    sys.exit(0)
print("REPRODUCED: a child's removed event after its parent's fails like an unknown block's")
sys.exit(1)
