"""Dynamo: the KV router's ``RadixTree`` refuses a block stored before its parent, and the
block stays unindexed after the parent arrives.

Reproduces on Dynamo alone (checked with ai-dynamo-runtime 1.6.1, CPU):

    python dynamo_child_before_parent.py    # exit 1: reproduced; exit 0: the tree takes it

An engine caches a two-block prompt, blocks A (tokens 0-15) and AB (0-31, parent A), and its
two ``stored`` events reach the tree child first. ``apply_event`` raises ``RuntimeError``
("Failed to find parent block") for AB and skips it; A is then stored. The engine holds both
blocks, the tree scores the worker 1 block for the prompt. vLLM sends a request's new
blocks parents first, so a consumer of one vLLM worker's ordered stream does not meet this;
an index that must take events of one step in any order does.
"""

from __future__ import annotations

import json
import sys

from dynamo.llm import RadixTree, compute_block_hash_for_seq

BLOCK = 16
prompt = list(range(2 * BLOCK))
local = compute_block_hash_for_seq(prompt, BLOCK)  # each block's own tokens, unchained
A, AB = 1001, 1002  # the engine's hashes of the two blocks
tree = RadixTree()


def stored(event_id: int, block: int, tokens_hash: int, parent: int | None) -> str:
    data = {"parent_hash": parent, "blocks": [{"block_hash": block, "tokens_hash": tokens_hash}]}
    try:
        tree.apply_event(0, json.dumps({"event_id": event_id, "data": {"stored": data}}).encode())
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "applied"


print("stored AB (parent A), before A:", stored(1, AB, local[1], A))
print("stored A:", stored(2, A, local[0], None))
score = tree.find_matches(local).scores.get((0, 0), 0)
print(f"the engine holds 2 blocks of the prompt; the tree scores worker 0: {score}")
if score == 2:
    print("not reproduced: the tree indexed the child stored before its parent")
    sys.exit(0)
print("REPRODUCED: a block stored before its parent is refused and stays unindexed")
sys.exit(1)
