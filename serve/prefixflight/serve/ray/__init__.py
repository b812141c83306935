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

from typing import TYPE_CHECKING, Any

from .._residency import BlockSetResidency, FollowsReplicas, ResidencyFirstRouter
from ._adapter import (
    ROUTING_STATS_KEYS,
    FallbackName,
    FirstToken,
    GenerateRequest,
    GenerateResult,
    RoutingState,
    find_request,
    replica_load,
)
from ._deployment import TINY_LLAMA, CharTokenizer, EngineReplica, ModelSpec
from ._launch import ROUTERS, RouterName, router_config, run_local, shutdown

if TYPE_CHECKING:
    from ._kv_residency import KV_ENDPOINT_KEYS, KVEventResidency
    from ._router import BurstRequestRouter

__all__ = [
    "ROUTERS",
    "KV_ENDPOINT_KEYS",
    "ROUTING_STATS_KEYS",
    "TINY_LLAMA",
    "BlockSetResidency",
    "BurstRequestRouter",
    "CharTokenizer",
    "EngineReplica",
    "FallbackName",
    "FirstToken",
    "FollowsReplicas",
    "GenerateRequest",
    "GenerateResult",
    "KVEventResidency",
    "ModelSpec",
    "ResidencyFirstRouter",
    "RouterName",
    "RoutingState",
    "find_request",
    "replica_load",
    "router_config",
    "run_local",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    if name == "BurstRequestRouter":  # imports Ray
        from ._router import BurstRequestRouter

        return BurstRequestRouter
    if name in ("KVEventResidency", "KV_ENDPOINT_KEYS"):  # imports ZMQ
        from . import _kv_residency

        return getattr(_kv_residency, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
