"""prefixflight's executable specification: reference models, strategies, state machines.

Needs the ``specs`` extra (Hypothesis). Point the machines at your own implementation::

    run_state_machine_as_test(S3FIFOConformance.for_factory(MyS3FIFO))
"""

from ._cache_machine import CacheConformance
from ._curves import LRUCurveConformance, ReferenceLRUCurve
from ._flight import CoordinatorUnderTest, FlightCoordinatorMachine, FlightModel
from ._machines import LRUConformance, PolicyConformance, S3FIFOConformance
from ._reference import ReferenceLRU, ReferenceReplay, ReferenceS3FIFO, reference_replay
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
from ._scheduler import FakeBackend, SchedulerFactory, SchedulerMachine
from ._strategies import policy_configs, s3fifo_configs, small_ratios, trace_records, traces

__all__ = [
    "BurstRouterConformance",
    "CacheConformance",
    "CoordinatorUnderTest",
    "FakeBackend",
    "FlightCoordinatorMachine",
    "FlightModel",
    "LRUConformance",
    "LRUCurveConformance",
    "PolicyConformance",
    "ReferenceLRU",
    "ReferenceLRUCurve",
    "ReferenceReplay",
    "ReferenceS3FIFO",
    "ReferenceWindow",
    "S3FIFOConformance",
    "SchedulerFactory",
    "SchedulerMachine",
    "WindowedRouter",
    "burst_configs",
    "chained_blocks",
    "policy_configs",
    "reference_assign",
    "reference_replay",
    "replica_loads",
    "route_batches",
    "s3fifo_configs",
    "small_ratios",
    "trace_records",
    "traces",
]
