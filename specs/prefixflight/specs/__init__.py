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

import typing

from prefixflight.core._lazy import lazy_attributes as _lazy_attributes

from ._adapter import EngineAdapter as EngineAdapter
from ._adapter import IndexAdapter as IndexAdapter
from ._adapter import KVChange as KVChange
from ._adapter import PolicyAdapter as PolicyAdapter
from ._adapter import PoolView as PoolView
from ._backend import FakeBackend as FakeBackend
from ._declare import EngineCrashed as EngineCrashed
from ._declare import EngineSemantics as EngineSemantics
from ._declare import IndexSemantics as IndexSemantics
from ._declare import PolicySemantics as PolicySemantics
from ._declare import SchedulerSemantics as SchedulerSemantics
from ._declare import Unsupported as Unsupported
from ._declare import declared_differences as declared_differences
from ._engine_ref import ReferencePrefixEngine as ReferencePrefixEngine
from ._isolate import isolated as isolated
from ._reference import ReferenceFIFO as ReferenceFIFO
from ._reference import ReferenceLFU as ReferenceLFU
from ._reference import ReferenceLRU as ReferenceLRU
from ._reference import ReferenceReplay as ReferenceReplay
from ._reference import ReferenceS3FIFO as ReferenceS3FIFO
from ._reference import ReferenceSIEVE as ReferenceSIEVE
from ._reference import reference_replay as reference_replay
from ._sched_adapter import Delivery as Delivery
from ._sched_adapter import ScheduledRow as ScheduledRow
from ._sched_adapter import SchedulerAdapter as SchedulerAdapter
from ._sched_adapter import SchedulerLimits as SchedulerLimits
from ._sched_adapter import SchedulerPages as SchedulerPages

if typing.TYPE_CHECKING:
    from ._cache_machine import CacheConformance as CacheConformance
    from ._conform import machine_for as machine_for
    from ._curves import LRUCurveConformance as LRUCurveConformance
    from ._curves import ReferenceLRUCurve as ReferenceLRUCurve
    from ._engine_machine import PrefixEngineConformance as PrefixEngineConformance
    from ._flight import CoordinatorUnderTest as CoordinatorUnderTest
    from ._flight import FlightCoordinatorMachine as FlightCoordinatorMachine
    from ._flight import FlightModel as FlightModel
    from ._index_machine import KVIndexConformance as KVIndexConformance
    from ._machines import FIFOConformance as FIFOConformance
    from ._machines import LFUConformance as LFUConformance
    from ._machines import LRUConformance as LRUConformance
    from ._machines import PolicyConformance as PolicyConformance
    from ._machines import S3FIFOConformance as S3FIFOConformance
    from ._machines import SIEVEConformance as SIEVEConformance
    from ._router import BurstRouterConformance as BurstRouterConformance
    from ._router import ReferenceWindow as ReferenceWindow
    from ._router import WindowedRouter as WindowedRouter
    from ._router import burst_configs as burst_configs
    from ._router import chained_blocks as chained_blocks
    from ._router import reference_assign as reference_assign
    from ._router import replica_loads as replica_loads
    from ._router import route_batches as route_batches
    from ._sched_machine import SchedulerConformance as SchedulerConformance
    from ._sched_machine import sampled_token as sampled_token
    from ._scheduler import SchedulerFactory as SchedulerFactory
    from ._scheduler import SchedulerMachine as SchedulerMachine
    from ._strategies import capacity_configs as capacity_configs
    from ._strategies import policy_configs as policy_configs
    from ._strategies import s3fifo_configs as s3fifo_configs
    from ._strategies import small_ratios as small_ratios
    from ._strategies import trace_records as trace_records
    from ._strategies import traces as traces

# the names each module that imports Hypothesis defines; it is imported on first use of one
# of them
_LAZY = {
    "_cache_machine": ("CacheConformance",),
    "_conform": ("machine_for",),
    "_curves": ("LRUCurveConformance", "ReferenceLRUCurve"),
    "_engine_machine": ("PrefixEngineConformance",),
    "_flight": ("CoordinatorUnderTest", "FlightCoordinatorMachine", "FlightModel"),
    "_index_machine": ("KVIndexConformance",),
    "_machines": (
        "FIFOConformance", "LFUConformance", "LRUConformance", "PolicyConformance",
        "S3FIFOConformance", "SIEVEConformance",
    ),
    "_router": (
        "BurstRouterConformance", "ReferenceWindow", "WindowedRouter", "burst_configs",
        "chained_blocks", "reference_assign", "replica_loads", "route_batches",
    ),
    "_sched_machine": ("SchedulerConformance", "sampled_token"),
    "_scheduler": ("SchedulerFactory", "SchedulerMachine"),
    "_strategies": (
        "capacity_configs", "policy_configs", "s3fifo_configs", "small_ratios", "trace_records",
        "traces",
    ),
}  # fmt: skip

# __all__ is the names imported above and the lazy ones; it is computed, which mypy cannot
# read (it would export nothing), so type checkers see none of the three and read the
# re-exports above
if not typing.TYPE_CHECKING:
    __getattr__, __dir__, __all__ = _lazy_attributes(globals(), _LAZY, eager=(
        "EngineAdapter", "IndexAdapter", "KVChange", "PolicyAdapter", "PoolView", "FakeBackend",
        "EngineCrashed", "EngineSemantics", "IndexSemantics", "PolicySemantics",
        "SchedulerSemantics", "Unsupported", "declared_differences", "ReferencePrefixEngine",
        "isolated", "ReferenceFIFO", "ReferenceLFU", "ReferenceLRU", "ReferenceReplay",
        "ReferenceS3FIFO", "ReferenceSIEVE", "reference_replay", "Delivery", "ScheduledRow",
        "SchedulerAdapter", "SchedulerLimits", "SchedulerPages",
    ))  # fmt: skip
