"""The block-level prefix cache: chained block hashes, eviction policies (S3FIFO, LRU), the
`PrefixCache` with pins and KV events, Mooncake trace records, trace replay and exact LRU
hit-rate curves; ``compiled`` says whether the optional compiled build of these modules is
loaded.

A module is imported on first use of one of its names, so a trace replay does not pay for
the hashers' and the curves' classes at start-up.
"""

from __future__ import annotations

import typing

from .._lazy import lazy_attributes as _lazy_attributes

if typing.TYPE_CHECKING:
    from ._build import compiled
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
    from ._registry import POLICIES, PolicyName, make_policy
    from ._replay import ReplayConfig, ReplayReport, RequestResult, replay
    from ._trace import TraceReader, TraceRecord, parse_trace_line

# name -> the module that defines it (imported on first use of one of its names)
_LAZY = {
    "compiled": "_build",
    "AllBlocksCleared": "_cache",
    "BlockRemoved": "_cache",
    "BlockStored": "_cache",
    "CacheStats": "_cache",
    "EventSink": "_cache",
    "KVEvent": "_cache",
    "PrefixCache": "_cache",
    "CurvePoint": "_curves",
    "LRUCurve": "_curves",
    "auto_capacities": "_curves",
    "lru_curve": "_curves",
    "BlockHash": "_hashing",
    "BlockHasher": "_hashing",
    "HashAlgorithm": "_hashing",
    "LRU": "_policies",
    "S3FIFO": "_policies",
    "EvictionPolicy": "_policies",
    "POLICIES": "_registry",
    "PolicyName": "_registry",
    "make_policy": "_registry",
    "ReplayConfig": "_replay",
    "ReplayReport": "_replay",
    "RequestResult": "_replay",
    "replay": "_replay",
    "TraceReader": "_trace",
    "TraceRecord": "_trace",
    "parse_trace_line": "_trace",
}


__getattr__, __dir__ = _lazy_attributes(globals(), _LAZY)

__all__ = [
    "LRU",
    "POLICIES",
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
    "compiled",
    "lru_curve",
    "make_policy",
    "parse_trace_line",
    "replay",
]
