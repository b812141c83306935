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
    from ._build import compiled as compiled
    from ._cache import AllBlocksCleared as AllBlocksCleared
    from ._cache import BlockRemoved as BlockRemoved
    from ._cache import BlockStored as BlockStored
    from ._cache import CacheStats as CacheStats
    from ._cache import EventSink as EventSink
    from ._cache import KVEvent as KVEvent
    from ._cache import PrefixCache as PrefixCache
    from ._curves import CurvePoint as CurvePoint
    from ._curves import LRUCurve as LRUCurve
    from ._curves import auto_capacities as auto_capacities
    from ._curves import lru_curve as lru_curve
    from ._hashing import BlockHash as BlockHash
    from ._hashing import BlockHasher as BlockHasher
    from ._hashing import HashAlgorithm as HashAlgorithm
    from ._policies import LRU as LRU
    from ._policies import S3FIFO as S3FIFO
    from ._policies import EvictionPolicy as EvictionPolicy
    from ._registry import POLICIES as POLICIES
    from ._registry import PolicyName as PolicyName
    from ._registry import make_policy as make_policy
    from ._replay import ReplayConfig as ReplayConfig
    from ._replay import ReplayReport as ReplayReport
    from ._replay import RequestResult as RequestResult
    from ._replay import replay as replay
    from ._trace import TraceReader as TraceReader
    from ._trace import TraceRecord as TraceRecord
    from ._trace import parse_trace_line as parse_trace_line

# the names each module defines; it is imported on first use of one of them
_LAZY = {
    "_build": ("compiled",),
    "_cache": (
        "AllBlocksCleared", "BlockRemoved", "BlockStored", "CacheStats", "EventSink", "KVEvent",
        "PrefixCache",
    ),
    "_curves": ("CurvePoint", "LRUCurve", "auto_capacities", "lru_curve"),
    "_hashing": ("BlockHash", "BlockHasher", "HashAlgorithm"),
    "_policies": ("LRU", "S3FIFO", "EvictionPolicy"),
    "_registry": ("POLICIES", "PolicyName", "make_policy"),
    "_replay": ("ReplayConfig", "ReplayReport", "RequestResult", "replay"),
    "_trace": ("TraceReader", "TraceRecord", "parse_trace_line"),
}  # fmt: skip

# __all__ is the lazy names; it is computed, which mypy cannot read (it would export
# nothing), so type checkers see none of the three and read the re-exports above
if not typing.TYPE_CHECKING:
    __getattr__, __dir__, __all__ = _lazy_attributes(globals(), _LAZY)
