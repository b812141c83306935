"""Seeded mutants of prefixflight's own classes, each with one mistake, for the bug benchmark's
synthetic set (``prefixflight conform prefixflight --impl mutants:NAME``). The engines'
mutants (vLLM, SGLang, libCacheSim) are ``tests/peers/broken.py``'s."""

from __future__ import annotations

from typing import Any

from prefixflight.core import LRU, S3FIFO
from prefixflight.serve.kv_events import ReplicaBlockIndex


class GhostlessS3FIFO(S3FIFO):  # type: ignore[misc]  # final: this is a mutant
    """Remembers nothing in the ghost queue: a block evicted from the small queue and used
    again starts over in small instead of entering main."""

    def _insert_ghost(self, b: Any) -> None:
        return None


class RemoveNothingLRU(LRU):  # type: ignore[misc]
    """A remove that checks its argument and then removes nothing."""

    def remove(self, block: Any) -> None:
        if block not in self:
            super().remove(block)  # the same UsageError as the real one


class DroppedRemovalsIndex(ReplicaBlockIndex):  # type: ignore[misc]
    """A router index that ignores every removal: it predicts hits on evicted blocks."""

    def _remove(self, event: Any) -> None:
        return None
