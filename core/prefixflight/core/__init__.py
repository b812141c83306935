"""prefixflight's pure core: standard library and attrs only.

No I/O, no threads, no clocks: time is a value carried by events. Everything here is
deterministic and safe to embed in any engine.
"""

from ._baselines import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
    LeastLoadedRouter,
)
from ._cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheStats,
    KVEvent,
    PrefixCache,
)
from ._cluster import (
    ClusterConfig,
    RouterReport,
    SimRequest,
    Workload,
    grpo_workload,
    simulate,
    trace_workload,
)
from ._errors import CapacityError, ConfigError, PrefixflightError, TraceFormatError, UsageError
from ._hashing import BlockHash, BlockHasher, HashAlgorithm
from ._plan import DecodeWork, PrefillWork, RequestId, StepPlan, StepResult
from ._policies import LRU, S3FIFO, EvictionPolicy
from ._replay import PolicyName, ReplayConfig, ReplayReport, RequestResult, replay
from ._router import (
    Assignment,
    BalanceBy,
    BurstConfig,
    BurstRouter,
    NoAffinity,
    Placed,
    assign_batch,
)
from ._routing import ReplicaLoad, Rng, Routed, Router, RouteRequest
from ._trace import TraceReader, TraceRecord, parse_trace_line

__all__ = [
    "LRU",
    "S3FIFO",
    "AllBlocksCleared",
    "ApproxPrefixConfig",
    "ApproxPrefixRouter",
    "Assignment",
    "BalanceBy",
    "BlockHash",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "BurstAffinityRouter",
    "BurstConfig",
    "BurstRouter",
    "CacheStats",
    "CapacityError",
    "ClusterConfig",
    "ConfigError",
    "DecodeWork",
    "EvictionPolicy",
    "HashAlgorithm",
    "KVEvent",
    "LeastLoadedRouter",
    "NoAffinity",
    "Placed",
    "PolicyName",
    "PrefillWork",
    "PrefixCache",
    "PrefixflightError",
    "ReplayConfig",
    "ReplayReport",
    "ReplicaLoad",
    "RequestId",
    "RequestResult",
    "Rng",
    "RouteRequest",
    "Routed",
    "Router",
    "RouterReport",
    "SimRequest",
    "StepPlan",
    "StepResult",
    "TraceFormatError",
    "TraceReader",
    "TraceRecord",
    "UsageError",
    "Workload",
    "assign_batch",
    "grpo_workload",
    "parse_trace_line",
    "replay",
    "simulate",
    "trace_workload",
]
