"""Start a local Ray instance with N engine replicas behind a chosen request router.

``run_local(replicas=4, router="burst")`` returns the deployment handle; `shutdown` stops
Serve and Ray. Each replica reserves ``cores / replicas`` CPUs (fractional, so more replicas
than cores fit) and runs torch with ``max(1, cores // replicas)`` threads, so N replicas do
not oversubscribe the machine. The HTTP proxy is disabled: requests go through the handle.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

from prefixflight.core import ConfigError

from ._deployment import EngineReplica, ModelSpec

__all__ = ["ROUTERS", "RouterName", "router_config", "run_local", "shutdown"]

RouterName: TypeAlias = Literal["burst", "prefix", "pow2"]

ROUTERS: Mapping[str, str | None] = {
    "burst": "prefixflight.serve.ray:BurstRequestRouter",
    # Ray's PrefixCacheAffinityRouter (ray.serve.llm) with routing tasks that keep their
    # request (Serve 2.59's loop loses some: see _routing_tasks, which also says where the
    # class is imported from).
    "prefix": "prefixflight.serve.ray._routing_tasks:PrefixCacheAffinityRouter",
    "pow2": None,  # Serve's default request router, PowerOfTwoChoicesRequestRouter
}
"""``--router`` names -> request router classes: ours, Ray's prefix-aware one, Ray's default
(``None``: Serve's own default, named by no import path here)."""


def router_config(
    router: RouterName,
    router_kwargs: Mapping[str, Any] | None = None,
    *,
    stats_period_s: float = 1.0,
) -> Any:
    """A ``RequestRouterConfig`` for one of `ROUTERS`."""
    from ray.serve.config import RequestRouterConfig

    config_cls: Any = RequestRouterConfig  # a pydantic model: mypy sees its fields wrongly
    if router not in ROUTERS:
        raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    cls = ROUTERS[router]
    return config_cls(
        **({} if cls is None else {"request_router_class": cls}),
        request_router_kwargs=dict(router_kwargs or {}),
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(stats_period_s, 5.0),
    )


def run_local(
    replicas: int = 4,
    router: RouterName = "burst",
    model: ModelSpec | None = None,
    engine_config: Any = None,
    *,
    router_kwargs: Mapping[str, Any] | None = None,
    num_cpus: int | None = None,
    torch_threads: int | None = None,
    max_ongoing_requests: int = 256,
    stats_period_s: float = 1.0,
    app_name: str = "prefixflight",
) -> Any:
    """Deploy ``replicas`` engine replicas on a local Ray (started if none is running) and
    return the deployment handle (``handle.generate.remote(GenerateRequest(...))``).

    ``num_cpus`` is the Ray instance's CPU count (default: this machine's cores); an already
    initialised Ray keeps its own. ``max_ongoing_requests`` is high so that a router's choice
    is not overruled by Serve's per-replica queue cap during a burst. With
    ``router_kwargs={"residency_source": "kv_events"}`` the replicas publish their KV events
    for the router to follow.
    """
    import ray as ray_module
    from ray import serve as serve_module
    from ray.serve.config import ProxyLocation

    ray: Any = ray_module  # partly untyped
    serve: Any = serve_module

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an int >= 1, got {replicas!r}")
    config = router_config(router, router_kwargs, stats_period_s=stats_period_s)
    if not ray.is_initialized():
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    cores = float(ray.cluster_resources().get("CPU", 1.0))
    threads = torch_threads if torch_threads is not None else max(1, int(cores) // replicas)
    serve.start(proxy_location=ProxyLocation.Disabled)
    deployment = serve.deployment(EngineReplica).options(
        name="engine",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": cores / replicas},
        request_router_config=config,
    )
    kv_events = dict(router_kwargs or {}).get("residency_source") == "kv_events"
    app = deployment.bind(
        model or ModelSpec.tiny(),
        engine_config,
        threads,
        report_blocks=0 if kv_events else 4096,  # the router reads the events, not snapshots
        kv_events=kv_events,
    )
    return serve.run(app, name=app_name, route_prefix=None)


def shutdown() -> None:
    """Stop Serve and the local Ray instance."""
    import ray as ray_module
    from ray import serve as serve_module

    ray: Any = ray_module
    serve: Any = serve_module
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
