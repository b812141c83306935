"""Run in the peers environment: libCacheSim's crashes, found by the kit as findings.

Without the shipped adapters' guards, an S3FIFO whose small queue would hold no object aborts
the process in ``S3FIFO_init``, and ``evict`` on an empty LRU segfaults. Each is run under
`isolated` and the machine; prints one JSON object: per policy, the crash's signal, the
shrunk failing call and what libCacheSim printed."""

from __future__ import annotations

import importlib
import json
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.specs import EngineCrashed, LRUConformance, S3FIFOConformance, isolated
from prefixflight.specs.adapters import LibCacheSimLRU, LibCacheSimS3FIFO


class UnguardedS3FIFO(LibCacheSimS3FIFO):
    """The shipped adapter without its Unsupported guard."""

    def __init__(self, capacity: int, small_ratio: float = 0.1, **_: Any) -> None:
        import libcachesim

        cache = libcachesim.S3FIFO(capacity, hashpower=8, small_size_ratio=small_ratio)
        super(LibCacheSimS3FIFO, self).__init__(capacity, cache)


class UnguardedLRU(LibCacheSimLRU):
    """The shipped adapter without its empty-cache guard on evict."""

    def evict(self) -> None:
        self._cache.evict(self._request(0))


def crash(machine: type[Any]) -> dict[str, Any]:
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=100,
                stateful_step_count=20,
                database=None,
                deadline=None,
                derandomize=True,
                report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.generate, Phase.shrink),
                suppress_health_check=list(HealthCheck),
            ),
        )
    except EngineCrashed as exc:
        steps = [n for n in getattr(exc, "__notes__", ()) if n.startswith(("config:", "state."))]
        return {"signal": exc.signal, "call": exc.call, "stderr": exc.stderr, "steps": steps}
    return {"signal": None}


if __name__ == "__main__":
    # the worker imports the adapters by module name, not from __main__
    crashes = importlib.import_module("crashes")
    from hypothesis import strategies as st

    ratio_configs = st.builds(
        lambda c, r: {"capacity": c, "small_ratio": r}, st.integers(1, 12), st.just(0.1)
    )
    print(
        json.dumps(
            {
                "s3fifo": crash(
                    S3FIFOConformance.for_factory(
                        isolated(crashes.UnguardedS3FIFO), configs=ratio_configs
                    )
                ),
                "lru": crash(LRUConformance.for_factory(isolated(crashes.UnguardedLRU))),
            }
        )
    )
