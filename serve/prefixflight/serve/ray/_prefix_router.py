"""Ray's ``PrefixCacheAffinityRouter`` with routing tasks that keep their request.

The ``"prefix"`` router of `run_local`: Ray's own prefix-aware router (ray.serve.llm),
unchanged but for `OwnRequestRoutingMixin`, so that it does not lose requests to Serve
2.59's routing loop (see ``_routing_tasks``): it picks a replica for one request, as ours
does, and without the mixin 1-3 requests of every benchmark round never reached a replica.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter as _RayPrefixCacheAffinityRouter,
)

from ._routing_tasks import OwnRequestRoutingMixin

__all__ = ["PrefixCacheAffinityRouter"]


class PrefixCacheAffinityRouter(OwnRequestRoutingMixin, _RayPrefixCacheAffinityRouter):
    """Ray's ``PrefixCacheAffinityRouter``; routing tasks from `OwnRequestRoutingMixin`."""
