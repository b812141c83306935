"""``prefixflight serve --replicas N --router burst|prefix|pow2``: engine replicas on a local
Ray Serve (the ray extra).

`add_ray_arguments` adds the flags to the ``serve`` command; `run_ray` handles them: it starts
a local Ray instance with N replicas behind the chosen router, sends ``--burst`` identical
prompts through the deployment handle, prints where each landed and what it reused, then
stops Ray unless ``--keep`` (serve until Ctrl-C: other drivers reach the app with
``ray.init(address="auto")`` and ``serve.get_app_handle``).

Ray and torch are imported inside `run_ray`, so the rest of the CLI never needs them.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefixflight.core import UsageError

from ._args import at_least
from ._extras import missing_extra

__all__ = ["add_ray_arguments", "run_ray"]

ROUTER_CHOICES = ("burst", "prefix", "pow2")
RESIDENCY_CHOICES = ("none", "stats", "kv_events")


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The Ray Serve flags."""
    g = p.add_argument_group("Ray Serve (extra 'ray')")
    g.add_argument(
        "--replicas",
        type=at_least(1),
        default=None,
        metavar="N",
        help="run N engine replicas on a local Ray Serve instead of one HTTP server",
    )
    g.add_argument(
        "--router",
        choices=ROUTER_CHOICES,
        default="burst",
        help="burst: prefixflight's burst router; prefix: Ray's PrefixCacheAffinityRouter (with "
        "routing tasks that keep their request, as burst); "
        "pow2: Ray's default power of two choices (default burst)",
    )
    g.add_argument("--window-ms", type=at_least(1), default=100, help="burst window (default 100)")
    g.add_argument(
        "--residency",
        choices=RESIDENCY_CHOICES,
        default="none",
        help="what the burst router knows of the replicas' caches for requests its window "
        "leaves alone (token-id prompts only): none (the approximate scorer's guess), stats "
        "(block snapshots in the routing stats) or kv_events (each replica publishes its KV "
        "events; the router follows them) (default none)",
    )
    g.add_argument(
        "--num-cpus", type=at_least(1), default=None, help="CPUs Ray may use (default: all)"
    )
    g.add_argument(
        "--torch-threads",
        type=at_least(1),
        default=None,
        help="torch threads per replica (default: cores / replicas, at least 1)",
    )
    g.add_argument(
        "--burst",
        type=at_least(1),
        default=8,
        metavar="K",
        help="send K identical prompts at once and show where they landed (default 8)",
    )
    g.add_argument("--max-tokens", type=at_least(1), default=8, help="tokens per request")
    g.add_argument(
        "--keep", action="store_true", help="keep serving after the burst, until Ctrl-C"
    )


def run_ray(args: argparse.Namespace) -> int:
    """Start the replicas, send the burst, print the placement; 0 on success."""
    kwargs: dict[str, Any] = {}
    if args.router == "burst":
        kwargs["window_ms"] = args.window_ms
        if args.residency != "none":
            kwargs["residency_source"] = args.residency
    elif args.residency != "none":
        raise UsageError(f"--residency {args.residency} needs --router burst")
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise missing_extra("--replicas", "ray", exc) from None
    import asyncio
    import threading

    from prefixflight.serve.ray import GenerateRequest, ModelSpec, run_local, shutdown

    model = ModelSpec.tiny() if args.model == "tiny" else ModelSpec.smollm2()
    handle = run_local(
        args.replicas,
        args.router,
        model,
        router_kwargs=kwargs,
        num_cpus=args.num_cpus,
        torch_threads=args.torch_threads,
    )
    try:
        prompt = "Explain prefix caching in one sentence. " * 3
        request = GenerateRequest(prompt=prompt, max_tokens=args.max_tokens)

        async def burst() -> list[Any]:
            return list(
                await asyncio.gather(*(handle.generate.remote(request) for _ in range(args.burst)))
            )

        results = asyncio.run(burst())
        print(f"{'request':>7}  {'replica':<12} {'role':<11} {'cached/prompt tokens':>20}")
        for i, r in enumerate(results):
            tokens = f"{r.cached_tokens}/{r.prompt_tokens}"
            print(f"{i:>7}  {r.replica:<12} {r.role:<11} {tokens:>20}")
        replicas = {r.replica for r in results}
        print(f"{len(results)} identical prompts on {len(replicas)} of {args.replicas} replicas")
        if args.keep:
            print("serving app 'prefixflight' (Ctrl-C stops it)")
            threading.Event().wait()
    finally:
        shutdown()
    return 0
