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
from prefixflight.core._extras import missing_extra

from ._args import at_least

__all__ = ["RAY_DEFAULTS", "add_ray_arguments", "as_given", "ray_flags_given", "run_ray"]

ROUTER_CHOICES = ("burst", "prefix", "pow2")
RESIDENCY_CHOICES = ("none", "stats", "kv_events")
RAY_DEFAULTS: dict[str, object] = {
    "router": "burst",
    "window_ms": 100,
    "residency": "none",
    "num_cpus": None,
    "torch_threads": None,
    "burst": 8,
    "max_tokens": 8,
    "keep": False,
}
"""The flags that only apply with ``--replicas``, by destination, and their defaults. The
parser leaves them ``None`` when not given (`ray_flags_given`); `run_ray` fills these in."""


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """``--replicas`` and the flags that only apply with it, in a group of their own."""
    d = RAY_DEFAULTS
    g = p.add_argument_group(
        "Ray Serve replicas (extra 'ray'): the flags after --replicas apply only with it"
    )
    g.add_argument(
        "--replicas",
        type=at_least(1),
        default=None,
        metavar="N",
        help="run N engine replicas on a local Ray Serve, send one burst of identical prompts "
        "and print where each landed, instead of running one HTTP server",
    )
    g.add_argument(
        "--router",
        choices=ROUTER_CHOICES,
        help="burst: prefixflight's burst router; prefix: Ray's PrefixCacheAffinityRouter (with "
        "routing tasks that keep their request, as burst); "
        f"pow2: Ray's default power of two choices (default {d['router']})",
    )
    g.add_argument(
        "--window-ms",
        type=at_least(1),
        metavar="MS",
        help=f"the burst router's window (default {d['window_ms']})",
    )
    g.add_argument(
        "--residency",
        choices=RESIDENCY_CHOICES,
        help="what the burst router knows of the replicas' caches for requests its window "
        "leaves alone (token-id prompts only): none (the approximate scorer's guess), stats "
        "(block snapshots in the routing stats) or kv_events (each replica publishes its KV "
        f"events; the router follows them) (default {d['residency']})",
    )
    g.add_argument(
        "--num-cpus", type=at_least(1), metavar="N", help="CPUs Ray may use (default: all)"
    )
    g.add_argument(
        "--torch-threads",
        type=at_least(1),
        metavar="N",
        help="torch threads per replica (default: cores / replicas, at least 1)",
    )
    g.add_argument(
        "--burst",
        type=at_least(1),
        metavar="K",
        help=f"send K identical prompts at once and show where they landed (default {d['burst']})",
    )
    g.add_argument(
        "--max-tokens",
        type=at_least(1),
        metavar="N",
        help=f"tokens each prompt of the burst generates (default {d['max_tokens']})",
    )
    g.add_argument(
        "--keep",
        action="store_true",
        default=None,
        help="keep serving after the burst, until Ctrl-C",
    )


def ray_flags_given(args: argparse.Namespace) -> list[str]:
    """The flags of `RAY_DEFAULTS` on the command line, as given (``--max-tokens 5``)."""
    return [
        as_given(dest, getattr(args, dest))
        for dest in RAY_DEFAULTS
        if getattr(args, dest) is not None
    ]


def as_given(dest: str, value: object) -> str:
    """A flag as a command line gives it, for an error: ``--port 9000``; a switch, or a list
    (API keys are not echoed), as its flag alone."""
    flag = "--" + dest.replace("_", "-")
    return f"{flag} {value}" if isinstance(value, (str, int, float)) and value is not True else flag


def run_ray(args: argparse.Namespace) -> int:
    """Start the replicas, send the burst, print the placement; 0 on success."""
    unset = {dest: value for dest, value in RAY_DEFAULTS.items() if getattr(args, dest) is None}
    args = argparse.Namespace(**{**vars(args), **unset})
    kwargs: dict[str, Any] = {}
    if args.router == "burst":
        kwargs["window_ms"] = args.window_ms
        if args.residency != "none":
            kwargs["residency_source"] = args.residency
    elif args.residency != "none":
        raise UsageError(f"--residency {args.residency} needs --router burst")
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
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
