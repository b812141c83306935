"""prefixflight's pure core: the components an engine embeds. Standard library and attrs only.

No I/O, no threads, no clocks: time is a value carried by events. Everything here is
deterministic and safe to embed in any engine.

The top level holds what an engine builds and the values that cross the components' main
methods: the block hasher, eviction policies and prefix cache; trace records and replay; the
single-flight coordinator and the scheduler with its step plans; the router protocol and the
burst router; and the errors. Everything else lives in its capability subpackage:

- `prefixflight.core.cache`: KV events, cache stats, the trace reader, per-request replay
  rows, LRU hit-rate curves, and the build flag (``compiled``);
- `prefixflight.core.flight`: the coordinator's events and decisions, request states and
  roles, page usage and the stats rows;
- `prefixflight.core.routing`: the burst router's assignments and batch assignment, and the
  baselines it is measured against.

A subpackage is imported on first use of one of its names, so a program that needs only the
cache does not pay for the scheduler's and the routers' classes at start-up. Simulations and
experiments live in `prefixflight.sim`.
"""

from __future__ import annotations

import typing

from ._errors import CapacityError, ConfigError, PrefixflightError, TraceFormatError, UsageError
from ._lazy import lazy_attributes as _lazy_attributes

if typing.TYPE_CHECKING:
    from .cache import (
        LRU,
        S3FIFO,
        BlockHash,
        BlockHasher,
        EvictionPolicy,
        PrefixCache,
        ReplayConfig,
        ReplayReport,
        TraceRecord,
        parse_trace_line,
        replay,
    )
    from .flight import (
        DecodeWork,
        FinishReason,
        FlightConfig,
        FlightCoordinator,
        FlightKey,
        PrefillWork,
        PublishMode,
        ReleasePolicy,
        RequestId,
        RequestReport,
        Scheduler,
        SchedulerConfig,
        StepOutcome,
        StepPlan,
        StepResult,
    )
    from .routing import (
        BurstConfig,
        BurstRouter,
        PrefixIndex,
        ReplicaLoad,
        Routed,
        Router,
        RouteRequest,
    )

# name -> the subpackage that defines it (imported on first use of one of its names)
_LAZY = {
    "LRU": "cache",
    "S3FIFO": "cache",
    "BlockHash": "cache",
    "BlockHasher": "cache",
    "EvictionPolicy": "cache",
    "PrefixCache": "cache",
    "ReplayConfig": "cache",
    "ReplayReport": "cache",
    "TraceRecord": "cache",
    "parse_trace_line": "cache",
    "replay": "cache",
    "DecodeWork": "flight",
    "FinishReason": "flight",
    "FlightConfig": "flight",
    "FlightCoordinator": "flight",
    "FlightKey": "flight",
    "PrefillWork": "flight",
    "PublishMode": "flight",
    "ReleasePolicy": "flight",
    "RequestId": "flight",
    "RequestReport": "flight",
    "Scheduler": "flight",
    "SchedulerConfig": "flight",
    "StepOutcome": "flight",
    "StepPlan": "flight",
    "StepResult": "flight",
    "BurstConfig": "routing",
    "BurstRouter": "routing",
    "PrefixIndex": "routing",
    "ReplicaLoad": "routing",
    "Routed": "routing",
    "Router": "routing",
    "RouteRequest": "routing",
}


__getattr__, __dir__ = _lazy_attributes(
    globals(), _LAZY, subpackages=("cache", "flight", "routing")
)

__all__ = [
    "LRU",
    "S3FIFO",
    "BlockHash",
    "BlockHasher",
    "BurstConfig",
    "BurstRouter",
    "CapacityError",
    "ConfigError",
    "DecodeWork",
    "EvictionPolicy",
    "FinishReason",
    "FlightConfig",
    "FlightCoordinator",
    "FlightKey",
    "PrefillWork",
    "PrefixCache",
    "PrefixIndex",
    "PrefixflightError",
    "PublishMode",
    "ReleasePolicy",
    "ReplayConfig",
    "ReplayReport",
    "ReplicaLoad",
    "RequestId",
    "RequestReport",
    "RouteRequest",
    "Routed",
    "Router",
    "Scheduler",
    "SchedulerConfig",
    "StepOutcome",
    "StepPlan",
    "StepResult",
    "TraceFormatError",
    "TraceRecord",
    "UsageError",
    "parse_trace_line",
    "replay",
]
