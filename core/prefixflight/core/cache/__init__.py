"""The block-level prefix cache: chained block hashes, eviction policies (S3FIFO, LRU), the
`PrefixCache` with pins and KV events, Mooncake trace records, trace replay and exact LRU
hit-rate curves."""

from ._cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheStats,
    EventSink,
    KVEvent,
    PrefixCache,
)
from ._curves import CurvePoint, LRUCurve, auto_capacities, lru_curve
from ._hashing import BlockHash, BlockHasher, HashAlgorithm
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
    "CurvePoint",
    "EventSink",
    "EvictionPolicy",
    "HashAlgorithm",
    "KVEvent",
    "LRUCurve",
    "PolicyName",
    "PrefixCache",
    "ReplayConfig",
    "ReplayReport",
    "RequestResult",
    "TraceReader",
    "TraceRecord",
    "auto_capacities",
    "lru_curve",
    "parse_trace_line",
    "replay",
]
