"""prefixflight's pure core: standard library and attrs only.

No I/O, no threads, no clocks: time is a value carried by events. Everything here is
deterministic and safe to embed in any engine.
"""

from ._cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheStats,
    KVEvent,
    PrefixCache,
)
from ._errors import CapacityError, ConfigError, PrefixflightError, TraceFormatError, UsageError
from ._hashing import BlockHash, BlockHasher, HashAlgorithm
from ._plan import DecodeWork, PrefillWork, RequestId, StepPlan, StepResult
from ._policies import LRU, S3FIFO, EvictionPolicy
from ._replay import PolicyName, ReplayConfig, ReplayReport, RequestResult, replay
from ._trace import TraceReader, TraceRecord, parse_trace_line

__all__ = [
    "LRU",
    "S3FIFO",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "CapacityError",
    "ConfigError",
    "DecodeWork",
    "EvictionPolicy",
    "HashAlgorithm",
    "KVEvent",
    "PolicyName",
    "PrefillWork",
    "PrefixCache",
    "PrefixflightError",
    "ReplayConfig",
    "ReplayReport",
    "RequestId",
    "RequestResult",
    "StepPlan",
    "StepResult",
    "TraceFormatError",
    "TraceReader",
    "TraceRecord",
    "UsageError",
    "parse_trace_line",
    "replay",
]
