"""``prefixflight route``: an OpenAI-compatible HTTP router in front of OpenAI-compatible
engines (vLLM, SGLang, ``prefixflight serve``), with the burst prefix-affinity window and
residency from the engines' KV events.

Needs the ``serve`` extra (FastAPI, uvicorn, httpx, pyzmq; ``--tokenizer`` also needs
transformers), imported inside the command. Flag mistakes exit 2 with one line; a port that
cannot be bound, a tokenizer that cannot be read or a missing extra is a one-line error.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any

from prefixflight.core import BurstConfig, ConfigError, UsageError
from prefixflight.core._extras import missing_extra

from ._args import Option, add_options, at_least, port, positive_float
from ._serve_cmd import add_access_arguments, api_keys

__all__ = ["register", "run"]

POLICIES = ("burst", "prefix", "round_robin")


# fmt: off
_ENGINES: tuple[Option, ...] = (  # (flag, type, default, metavar, help)
    ("--engine-block-size", at_least(1), 16, "B",
     "the backends' KV block size, for residency (vLLM's --block-size)"),
    ("--tokenizer", None, None, "DIR",
     "a Hugging Face tokenizer folder (the backends' model): text prompts are keyed by their "
     "token ids, so KV-event residency applies to them; without it text is keyed by its bytes "
     "and residency needs token-id prompts"),
)
_WINDOW: tuple[Option, ...] = (
    ("--window-ms", at_least(1), 100, "MS", "batch window"),
    ("--lone-wait-ms", at_least(1), None, "MS",
     "adaptive window: release a request that shares its prefix with nothing in its window "
     "after MS instead of at the window's end (default: off, as llm-d)"),
    ("--quiet-ms", at_least(0), 10, "MS",
     "quiet seal: seal the window once no request has joined it for MS, never later than "
     "--window-ms after it opened (default: 10, measured in docs/distributed.md; 0: off, "
     "llm-d's fixed window)"),
    ("--max-per-replica", int, -1, "K",
     "most members of one group per backend; -1 puts a group on one backend"),
    ("--block-size", at_least(1), 64, "N",
     "tokens (or bytes, without --tokenizer) per route-key block"),
    ("--min-colocate-blocks", at_least(0), 0, "N",
     "leading blocks that make different prompts co-locate; 0: identical prompts only"),
    ("--max-batch-size", int, 1000, "N", "most requests per window"),
)
_HTTP: tuple[Option, ...] = (
    ("--host", None, "127.0.0.1", None, "loopback only unless told otherwise"),
    ("--port", port, 8080, None, "0 picks a free port"),
    ("--max-in-flight", at_least(1), 1024, "N", "requests relayed at once; past it 429"),
    ("--timeout-s", positive_float, 600.0, "S",
     "longest wait for the next bytes of a backend's answer (a stream's next chunk)"),
    ("--first-byte-timeout-s", positive_float, 300.0, "S",
     "longest wait for a backend's answer to start (a non-streaming answer starts when it is "
     "complete; default 300): then 504"),
    ("--health-interval-s", positive_float, 2.0, "S",
     "how often every backend's /health is probed (default 2)"),
    ("--health-timeout-s", positive_float, 2.0, "S",
     "a probe not answered 200 within S fails (default 2)"),
    ("--health-failures", at_least(1), 2, "N",
     "failed probes in a row that mark a backend down; requests whose answer has not started "
     "move to another backend (default 2)"),
)
# fmt: on


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "route",
        help="route OpenAI requests across engines with the burst window (serve extra)",
        description=(
            "An OpenAI-compatible router (/v1/completions, /v1/chat/completions with streaming, "
            "/v1/models, /tokenize, /health, /metrics) in front of OpenAI-compatible engines "
            "(vLLM, SGLang, prefixflight serve). The burst policy places requests that share a "
            "prompt and arrive within one window on one engine; requests the window leaves "
            "alone go where their prefix is resident (from the engines' KV events, with "
            "--kv-events), else to llm-d's approximate prefix scorer. Binds loopback by default."
        ),
    )
    p.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="an engine's base URL, e.g. http://127.0.0.1:8000 (repeat for each engine)",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        metavar="ENDPOINT",
        help="where each backend publishes KV events, in --backend order (repeat once per "
        "backend), e.g. tcp://127.0.0.1:5557 for a vLLM started with --kv-events-config "
        "endpoint tcp://*:5557",
    )
    p.add_argument(
        "--kv-events-replay",
        action="append",
        metavar="ENDPOINT",
        help="with --kv-events: each backend's replay endpoint, in --backend order",
    )
    p.add_argument(
        "--kv-events-topic",
        action="append",
        metavar="TOPIC",
        help="with --kv-events: the topic each backend publishes under, in --backend order "
        "(vLLM's kv-events-config topic); events under another are refused (default: the "
        "first topic each backend uses)",
    )
    p.add_argument("--policy", choices=POLICIES, default="burst", help="the routing policy")
    add_options(p, _ENGINES)
    g = p.add_argument_group("burst window (llm-d's burst prefix-affinity parameters)")
    add_options(g, _WINDOW)
    # the flag's name before it matched `prefixflight simulate router --block-size`
    g.add_argument(
        "--block-size-tokens",
        dest="block_size",
        type=at_least(1),
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    h = p.add_argument_group("HTTP")
    add_options(h, _HTTP)
    h.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level",
    )
    h.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_access_arguments(p)  # prefixflight serve's: API keys, body size, timeouts
    p.set_defaults(func=run, parser=p)


def _per_backend(
    parser: argparse.ArgumentParser, flag: str, values: list[str] | None, n: int
) -> list[str | None]:
    if values is None:
        return [None] * n
    if len(values) != n:
        parser.error(f"{flag} was given {len(values)} times for {n} backends: give it once each")
    for v in values:
        if "://" not in v:
            parser.error(f"{flag} must be a ZMQ address like tcp://127.0.0.1:5557, got {v!r}")
    return list(values)


def _codec(path: str) -> Any:
    if not Path(path).is_dir():
        raise UsageError(
            f"--tokenizer {path}: no such folder (give the folder of a Hugging Face tokenizer, "
            "the backends' model)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise UsageError(
            f"--tokenizer needs transformers ({exc}): pip install transformers"
        ) from None
    from prefixflight.serve._text import HFCodec

    try:
        return HFCodec(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--tokenizer {path}: cannot load a tokenizer there ({first})") from None


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    n = len(args.backend)
    kv = _per_backend(parser, "--kv-events", args.kv_events, n)
    replay = _per_backend(parser, "--kv-events-replay", args.kv_events_replay, n)
    if args.kv_events is None and args.kv_events_replay is not None:
        parser.error("--kv-events-replay needs --kv-events")
    if args.kv_events is None and args.kv_events_topic is not None:
        parser.error("--kv-events-topic needs --kv-events")
    topics = args.kv_events_topic or [None] * n
    if len(topics) != n:
        parser.error(
            f"--kv-events-topic was given {len(topics)} times for {n} backends: give it once each"
        )
    keys = api_keys(args)  # a bad keys file fails before anything starts
    try:
        from prefixflight.serve import route
    except ImportError as exc:
        raise missing_extra("`prefixflight route`", "serve", exc) from None
    try:
        config = route.RouteConfig(
            backends=tuple(
                route.Backend(
                    url=url.rstrip("/").removesuffix("/v1"), kv_events=k, kv_replay=r, kv_topic=t
                )
                for url, k, r, t in zip(args.backend, kv, replay, topics, strict=True)
            ),
            policy=args.policy,
            burst=BurstConfig(
                window_ms=args.window_ms,
                lone_wait_ms=args.lone_wait_ms,
                quiet_ms=args.quiet_ms or None,
                max_per_replica=args.max_per_replica,
                block_size=args.block_size,
                min_colocate_blocks=args.min_colocate_blocks,
                max_batch_size=args.max_batch_size,
            ),
            engine_block_size=args.engine_block_size,
            max_in_flight=args.max_in_flight,
            api_keys=keys,
            max_body_bytes=args.max_body_bytes,
            client_timeout=args.client_timeout,
            keep_alive_timeout=args.keep_alive_timeout,
            shutdown_timeout=args.shutdown_timeout,
            timeout_s=args.timeout_s,
            first_byte_timeout_s=args.first_byte_timeout_s,
            health_interval_s=args.health_interval_s,
            health_timeout_s=args.health_timeout_s,
            health_failures=args.health_failures,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    codec = None if args.tokenizer is None else _codec(args.tokenizer)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise UsageError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from None
    with sock:
        app = route.build_route_app(config, codec=codec)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        events = "KV events from each" if args.kv_events else "no KV events"
        policy = args.policy
        if policy == "burst":
            extras = [f"window {args.window_ms} ms"]
            extras += [f"lone wait {args.lone_wait_ms} ms"] if args.lone_wait_ms else []
            extras += [f"quiet seal {args.quiet_ms} ms"] if args.quiet_ms else []
            policy += f" ({', '.join(extras)})"
        print(
            f"prefixflight route: http://{shown}:{port} -> {n} backend(s), policy {policy}, "
            f"{events}",
            file=sys.stderr,
            flush=True,
        )
        route.serve(app, sock, log_level=args.log_level, access_log=args.access_log)
    return 0
