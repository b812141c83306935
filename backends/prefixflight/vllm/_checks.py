"""The checked mode: vLLM's live pool and scheduler against the specs' invariants.

After every step (``update_from_output``), `PoolChecker.check` tests the rules the engine
machine of ``prefixflight.specs`` holds every engine to:

- ``blocks add up``: every block is free, held by a request, or vLLM's null block, and the
  free queue counts exactly the blocks no request holds;
- ``negative reference count``: no block's ``ref_cnt`` is below zero;
- ``held block evicted``: every block a running request holds as cached still carries its
  hash (an evicted block in use would be overwritten under the request);
- ``cached but never computed``: a free block that carries a hash had its KV written by a
  step that ran (vLLM caches blocks when it schedules them; a request scheduled and then
  preempted in the same step leaves them uncomputed).

Each violation is logged once per block and rule, as one line that starts
``prefixflight invariant violation:`` and names the rule and the block. No vLLM import.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from ._queue import PolicyQueue

__all__ = ["PREFIX", "PoolChecker"]

PREFIX: Final = "prefixflight invariant violation:"


class PoolChecker:
    """The checks over one pool, its `PolicyQueue` and its full-attention manager."""

    def __init__(self, pool: Any, queue: PolicyQueue, manager: Any, log: logging.Logger) -> None:
        self._pool = pool
        self._queue = queue
        self._manager = manager
        self._log = log
        self._block_size: int = manager.block_size
        self._steps: dict[int, list[tuple[int, object]]] = {}
        self._reported: set[tuple[str, int]] = set()
        self.violations = 0
        self.steps = 0

    def scheduled(self, output: Any, requests: dict[str, Any]) -> None:
        """A step was scheduled: remember which blocks it computes (ids and hashes, since
        async scheduling may free them before the step's output comes back)."""
        bs = self._block_size
        to_blocks = self._manager.req_to_blocks
        written: list[tuple[int, object]] = []
        for rid in output.num_scheduled_tokens:
            request = requests.get(rid)
            blocks = to_blocks.get(rid)
            if request is None or not blocks:
                continue
            upto = min(request.num_computed_tokens // bs, len(blocks))  # blocks written whole
            written.extend((b.block_id, b.block_hash) for b in blocks[:upto] if not b.is_null)
        self._steps[id(output)] = written

    def ran(self, output: Any) -> None:
        """The step ran: its blocks' KV is written (unless a block was reused since)."""
        computed = self._queue.computed
        blocks = self._pool.blocks
        for bid, key in self._steps.pop(id(output), ()):
            if blocks[bid].block_hash == key:
                computed[bid] = True

    def check(self) -> None:
        """Test every rule now; log each new violation."""
        self.steps += 1
        queue = self._queue
        computed = queue.computed
        is_free = queue.is_free
        free = 0
        for b in self._pool.blocks:
            if b.is_null:
                continue
            ref = b.ref_cnt
            if ref < 0:
                self._violation("negative reference count", b, f"ref_cnt {ref}")
            elif ref == 0:
                free += 1
                if not is_free(b):
                    self._violation("blocks add up", b, "no request holds it, yet it is not free")
                elif b.block_hash is not None and not computed[b.block_id]:
                    self._violation(
                        "cached but never computed", b, "a free cached block no step wrote"
                    )
            elif is_free(b):
                self._violation("blocks add up", b, f"held (ref_cnt {ref}) yet in the free queue")
        if free != queue.num_free_blocks:
            self._violation(
                "blocks add up",
                None,
                f"{free} blocks are unheld but the free queue counts {queue.num_free_blocks}",
            )
        manager = self._manager
        for rid, blocks in manager.req_to_blocks.items():
            n = manager.num_cached_block.get(rid, 0)
            for b in blocks[:n]:
                if not b.is_null and b.block_hash is None:
                    self._violation("held block evicted", b, f"request {rid!r} holds it as cached")

    def _violation(self, rule: str, block: Any, detail: str) -> None:
        bid = -1 if block is None else block.block_id
        if (rule, bid) in self._reported:
            return
        self._reported.add((rule, bid))
        self.violations += 1
        where = "the pool" if block is None else f"block {bid}"
        self._log.error("%s %s: %s (%s)", PREFIX, rule, where, detail)
