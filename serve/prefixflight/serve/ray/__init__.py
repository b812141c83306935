"""prefixflight on Ray Serve (extra ``ray``): engine replicas behind our burst router.

- `run_local` / `shutdown`: a local Ray instance with N `AsyncEngine` replicas behind
  ``"burst"`` (ours), ``"prefix"`` (Ray's ``PrefixCacheAffinityRouter``, with routing tasks
  that keep their request) or ``"pow2"`` (Ray's default) routing.
- `BurstRequestRouter`: our `BurstRouter` behind Ray Serve's ``RequestRouter``; its routing
  tasks (`OwnRequestRoutingMixin`, in ``_routing_tasks``) never abandon a request, which
  Serve 2.59's own loop does.
- `EngineReplica`, `ModelSpec`: the deployment (handle API: ``generate(GenerateRequest)``
  -> `GenerateResult`; coarse cache state via ``record_routing_stats``).
- Ray-free (importable without Ray): `GenerateRequest`, `GenerateResult`, `RoutingState`,
  `replica_load`, `find_request`, and residency (the core's `PrefixIndex` protocol, the one
  every source implements): `BlockSetResidency` (fed by the replicas' stats snapshots) and
  `KVEventResidency` (a subscriber following the replicas' KV-event publishers; needs the
  ``serve`` extra), both `FollowsReplicas`; `ResidencyFirstRouter` routes by them.

Names that need Ray (or ZMQ) are imported on first use, so the Ray-free ones work without it.
"""

from __future__ import annotations

import typing

from prefixflight.core._lazy import lazy_attributes as _lazy_attributes

from .._residency import BlockSetResidency as BlockSetResidency
from .._residency import FollowsReplicas as FollowsReplicas
from .._residency import ResidencyFirstRouter as ResidencyFirstRouter
from ._adapter import ROUTING_STATS_KEYS as ROUTING_STATS_KEYS
from ._adapter import FallbackName as FallbackName
from ._adapter import FirstToken as FirstToken
from ._adapter import GenerateRequest as GenerateRequest
from ._adapter import GenerateResult as GenerateResult
from ._adapter import RoutingState as RoutingState
from ._adapter import find_request as find_request
from ._adapter import replica_load as replica_load
from ._deployment import TINY_LLAMA as TINY_LLAMA
from ._deployment import CharTokenizer as CharTokenizer
from ._deployment import EngineReplica as EngineReplica
from ._deployment import ModelSpec as ModelSpec
from ._launch import ROUTERS as ROUTERS
from ._launch import RouterName as RouterName
from ._launch import router_config as router_config
from ._launch import run_local as run_local
from ._launch import shutdown as shutdown

if typing.TYPE_CHECKING:
    from ._kv_residency import KV_ENDPOINT_KEYS as KV_ENDPOINT_KEYS
    from ._kv_residency import KVEventResidency as KVEventResidency
    from ._router import BurstRequestRouter as BurstRequestRouter

# the names that need Ray (_router) or ZMQ (_kv_residency), imported on first use
_LAZY = {
    "_kv_residency": ("KV_ENDPOINT_KEYS", "KVEventResidency"),
    "_router": ("BurstRequestRouter",),
}

# __all__ is computed (see prefixflight.core._lazy): type checkers read the re-exports above
if not typing.TYPE_CHECKING:
    __getattr__, __dir__, __all__ = _lazy_attributes(globals(), _LAZY, eager=(
        "ROUTERS", "ROUTING_STATS_KEYS", "TINY_LLAMA", "BlockSetResidency", "CharTokenizer",
        "EngineReplica", "FallbackName", "FirstToken", "FollowsReplicas", "GenerateRequest",
        "GenerateResult", "ModelSpec", "ResidencyFirstRouter", "RouterName", "RoutingState",
        "find_request", "replica_load", "router_config", "run_local", "shutdown",
    ))  # fmt: skip
