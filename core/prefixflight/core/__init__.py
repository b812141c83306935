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

from ._errors import CapacityError as CapacityError
from ._errors import ConfigError as ConfigError
from ._errors import PrefixflightError as PrefixflightError
from ._errors import TraceFormatError as TraceFormatError
from ._errors import UsageError as UsageError
from ._lazy import lazy_attributes as _lazy_attributes

if typing.TYPE_CHECKING:
    from .cache import LRU as LRU
    from .cache import S3FIFO as S3FIFO
    from .cache import BlockHash as BlockHash
    from .cache import BlockHasher as BlockHasher
    from .cache import EvictionPolicy as EvictionPolicy
    from .cache import PrefixCache as PrefixCache
    from .cache import ReplayConfig as ReplayConfig
    from .cache import ReplayReport as ReplayReport
    from .cache import TraceRecord as TraceRecord
    from .cache import parse_trace_line as parse_trace_line
    from .cache import replay as replay
    from .flight import DecodeWork as DecodeWork
    from .flight import FinishReason as FinishReason
    from .flight import FlightConfig as FlightConfig
    from .flight import FlightCoordinator as FlightCoordinator
    from .flight import FlightKey as FlightKey
    from .flight import PrefillWork as PrefillWork
    from .flight import PublishMode as PublishMode
    from .flight import ReleasePolicy as ReleasePolicy
    from .flight import RequestId as RequestId
    from .flight import RequestReport as RequestReport
    from .flight import Scheduler as Scheduler
    from .flight import SchedulerConfig as SchedulerConfig
    from .flight import StepOutcome as StepOutcome
    from .flight import StepPlan as StepPlan
    from .flight import StepResult as StepResult
    from .routing import BurstConfig as BurstConfig
    from .routing import BurstRouter as BurstRouter
    from .routing import PrefixIndex as PrefixIndex
    from .routing import ReplicaLoad as ReplicaLoad
    from .routing import Routed as Routed
    from .routing import Router as Router
    from .routing import RouteRequest as RouteRequest

# the names each subpackage defines; it is imported on first use of one of them
_LAZY = {
    "cache": (
        "LRU", "S3FIFO", "BlockHash", "BlockHasher", "EvictionPolicy", "PrefixCache",
        "ReplayConfig", "ReplayReport", "TraceRecord", "parse_trace_line", "replay",
    ),
    "flight": (
        "DecodeWork", "FinishReason", "FlightConfig", "FlightCoordinator", "FlightKey",
        "PrefillWork", "PublishMode", "ReleasePolicy", "RequestId", "RequestReport", "Scheduler",
        "SchedulerConfig", "StepOutcome", "StepPlan", "StepResult",
    ),
    "routing": (
        "BurstConfig", "BurstRouter", "PrefixIndex", "ReplicaLoad", "Routed", "Router",
        "RouteRequest",
    ),
}  # fmt: skip

# __all__ is the errors and the lazy names; it is computed, which mypy cannot read (it would
# export nothing), so type checkers see none of the three and read the re-exports above
if not typing.TYPE_CHECKING:
    __getattr__, __dir__, __all__ = _lazy_attributes(globals(), _LAZY, eager=(
        "CapacityError", "ConfigError", "PrefixflightError", "TraceFormatError", "UsageError",
    ))  # fmt: skip
