"""prefixflight's executable specification: reference models, strategies, state machines.

The machines and strategies need the ``specs`` extra (Hypothesis). Point the machines at
your own implementation: ``machine_for(MyAdapter)`` is the machine its declaration names
(``prefixflight conform --adapter module:MyAdapter`` runs it from the command line)::

    run_state_machine_as_test(machine_for(MyS3FIFO))  # semantics = PolicySemantics(policy="s3fifo")
    run_state_machine_as_test(PrefixEngineConformance.for_adapter(MyEngineAdapter))
    run_state_machine_as_test(SchedulerConformance.for_adapter(MySchedulerAdapter))

An implementation declares how it differs from prefixflight's semantics (`EngineSemantics`,
`PolicySemantics`, `SchedulerSemantics`) and the machines follow the declaration (a policy
follows `PolicyAdapter`, an engine's adapter `EngineAdapter`);
`prefixflight.specs.adapters` has the declared adapters of vLLM (its cache and its
scheduler), SGLang and libCacheSim (``prefixflight conform`` runs them). `isolated` runs an
implementation in a worker process, so a crash is a finding.

`FakeBackend` (a development backend for a host loop) and the reference models need only
``prefixflight.core``: the modules that import Hypothesis are loaded on first use of one of
their names, so ``from prefixflight.specs import FakeBackend`` works without it (so do the
declarations, `ReferencePrefixEngine` and the adapters).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._adapter import EngineAdapter, IndexAdapter, KVChange, PolicyAdapter, PoolView
from ._backend import FakeBackend
from ._declare import (
    EngineCrashed,
    EngineSemantics,
    IndexSemantics,
    PolicySemantics,
    SchedulerSemantics,
    Unsupported,
    declared_differences,
)
from ._engine_ref import ReferencePrefixEngine
from ._isolate import isolated
from ._reference import (
    ReferenceFIFO,
    ReferenceLFU,
    ReferenceLRU,
    ReferenceReplay,
    ReferenceS3FIFO,
    ReferenceSIEVE,
    reference_replay,
)
from ._sched_adapter import (
    Delivery,
    ScheduledRow,
    SchedulerAdapter,
    SchedulerLimits,
    SchedulerPages,
)

if TYPE_CHECKING:
    from ._cache_machine import CacheConformance
    from ._conform import machine_for
    from ._curves import LRUCurveConformance, ReferenceLRUCurve
    from ._engine_machine import PrefixEngineConformance
    from ._flight import CoordinatorUnderTest, FlightCoordinatorMachine, FlightModel
    from ._index_machine import KVIndexConformance
    from ._machines import (
        FIFOConformance,
        LFUConformance,
        LRUConformance,
        PolicyConformance,
        S3FIFOConformance,
        SIEVEConformance,
    )
    from ._router import (
        BurstRouterConformance,
        ReferenceWindow,
        WindowedRouter,
        burst_configs,
        chained_blocks,
        reference_assign,
        replica_loads,
        route_batches,
    )
    from ._sched_machine import SchedulerConformance, sampled_token
    from ._scheduler import SchedulerFactory, SchedulerMachine
    from ._strategies import (
        capacity_configs,
        policy_configs,
        s3fifo_configs,
        small_ratios,
        trace_records,
        traces,
    )

# name -> module of the names whose modules import Hypothesis (loaded on first use)
_LAZY = {
    "CacheConformance": "_cache_machine",
    "LRUCurveConformance": "_curves",
    "machine_for": "_conform",
    "ReferenceLRUCurve": "_curves",
    "PrefixEngineConformance": "_engine_machine",
    "CoordinatorUnderTest": "_flight",
    "FlightCoordinatorMachine": "_flight",
    "FlightModel": "_flight",
    "KVIndexConformance": "_index_machine",
    "FIFOConformance": "_machines",
    "LFUConformance": "_machines",
    "LRUConformance": "_machines",
    "SIEVEConformance": "_machines",
    "PolicyConformance": "_machines",
    "S3FIFOConformance": "_machines",
    "BurstRouterConformance": "_router",
    "ReferenceWindow": "_router",
    "WindowedRouter": "_router",
    "burst_configs": "_router",
    "chained_blocks": "_router",
    "reference_assign": "_router",
    "replica_loads": "_router",
    "route_batches": "_router",
    "SchedulerConformance": "_sched_machine",
    "sampled_token": "_sched_machine",
    "SchedulerFactory": "_scheduler",
    "SchedulerMachine": "_scheduler",
    "capacity_configs": "_strategies",
    "policy_configs": "_strategies",
    "s3fifo_configs": "_strategies",
    "small_ratios": "_strategies",
    "trace_records": "_strategies",
    "traces": "_strategies",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BurstRouterConformance",
    "CacheConformance",
    "CoordinatorUnderTest",
    "Delivery",
    "EngineAdapter",
    "EngineCrashed",
    "EngineSemantics",
    "FIFOConformance",
    "FakeBackend",
    "FlightCoordinatorMachine",
    "FlightModel",
    "IndexAdapter",
    "IndexSemantics",
    "KVChange",
    "KVIndexConformance",
    "LFUConformance",
    "LRUConformance",
    "LRUCurveConformance",
    "PolicyAdapter",
    "PolicyConformance",
    "PolicySemantics",
    "PoolView",
    "PrefixEngineConformance",
    "ReferenceFIFO",
    "ReferenceLFU",
    "ReferenceLRU",
    "ReferenceLRUCurve",
    "ReferencePrefixEngine",
    "ReferenceReplay",
    "ReferenceS3FIFO",
    "ReferenceSIEVE",
    "ReferenceWindow",
    "S3FIFOConformance",
    "SIEVEConformance",
    "ScheduledRow",
    "SchedulerAdapter",
    "SchedulerConformance",
    "SchedulerFactory",
    "SchedulerLimits",
    "SchedulerMachine",
    "SchedulerPages",
    "SchedulerSemantics",
    "Unsupported",
    "WindowedRouter",
    "burst_configs",
    "capacity_configs",
    "chained_blocks",
    "declared_differences",
    "isolated",
    "machine_for",
    "policy_configs",
    "reference_assign",
    "reference_replay",
    "replica_loads",
    "route_batches",
    "s3fifo_configs",
    "sampled_token",
    "small_ratios",
    "trace_records",
    "traces",
]
