"""``prefixflight serve``: the bundled model behind an OpenAI-compatible HTTP server.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client) and the torch backend; both
are imported inside the command, so the rest of the CLI never needs them. Flag mistakes exit
2 with one line (argparse's usage error); a missing extra or a port that cannot be bound is
a one-line error too, never a traceback.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Any

from prefixflight.core import UsageError

from ._args import at_least
from ._bench_cmd import prepare_torch_process
from ._serve_ray_cmd import add_ray_arguments, run_ray

__all__ = ["kv_publisher", "register", "run"]

MODELS = ("smollm2", "tiny")
RELEASE_POLICIES = ("after_prefill", "on_completion", "independent")  # ReleasePolicy's values


def _port(value: str) -> int:
    n = at_least(0)(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value!r}")
    return int(n)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the bundled model over an OpenAI-compatible HTTP API (serve extra)",
        description=(
            "Serve SmolLM2-135M-Instruct with prefixflight's engine (prefix caching, single "
            "flight, continuous batching) behind /v1/completions, /v1/chat/completions, "
            "/v1/models, /health, /tokenize and Prometheus /metrics. Binds loopback by default."
        ),
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        default="smollm2",
        help="smollm2: the bundled SmolLM2-135M-Instruct; tiny: a random-weight 2-layer Llama "
        "per replica (with --replicas, to try a deployment quickly)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the name clients use (default: the model's name, SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="default 8000; 0 picks a free port")
    p.add_argument(
        "--num-pages",
        type=at_least(1),
        default=512,
        metavar="N",
        help="KV pool pages (default 512)",
    )
    p.add_argument(
        "--block-size",
        type=at_least(1),
        default=16,
        metavar="B",
        help="tokens per page and cached block (default 16)",
    )
    p.add_argument(
        "--release-policy",
        choices=RELEASE_POLICIES,
        default="after_prefill",
        metavar="POLICY",
        help="single flight: after_prefill (default), on_completion or independent (off)",
    )
    p.add_argument(
        "--min-shared-blocks",
        type=at_least(1),
        default=None,
        metavar="K",
        help="also share a flight's prefix with requests that share K leading "
        "blocks (default: identical prompts only)",
    )
    p.add_argument(
        "--max-running",
        type=at_least(1),
        default=16,
        metavar="N",
        help="requests decoding at once (default 16)",
    )
    p.add_argument(
        "--max-waiting",
        type=at_least(0),
        default=64,
        metavar="N",
        help="requests that may queue beyond --max-running before 429 (default 64)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=at_least(1),
        default=1024,
        metavar="N",
        help="tokens per engine step (default 1024)",
    )
    p.add_argument("--eviction", choices=("lru", "s3fifo"), default="lru", help="default lru")
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish the prefix cache's KV events on vLLM's ZMQ wire at this endpoint "
        "(e.g. tcp://*:5557; docs/kv-events.md)",
    )
    p.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="with --kv-events: serve replays of missed event batches here (e.g. tcp://*:5558)",
    )
    p.add_argument(
        "--kv-events-pod",
        metavar="NAME",
        help="with --kv-events: the pod in the topic kv@POD@MODEL (default: this host's name)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument(
        "--dtype",
        default=None,
        help="bfloat16 (default on CUDA and on CPUs with native bf16) or float32 (elsewhere)",
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's choice)",
    )
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_ray_arguments(p)
    p.set_defaults(func=run, parser=p)


def kv_publisher(args: argparse.Namespace, model: str) -> Any:
    """The `KVEventPublisher` for ``--kv-events``, on topic ``kv@<pod>@<model>``."""
    from prefixflight.serve.kv_events import KVEventPublisher, kv_topic

    pod = args.kv_events_pod or socket.gethostname()
    try:
        return KVEventPublisher(
            args.kv_events,
            topic=kv_topic(pod, model),
            replay_endpoint=args.kv_events_replay,
        )
    except UsageError as exc:
        raise UsageError(f"--kv-events {args.kv_events}: {exc}") from None
    except OSError as exc:  # zmq.ZMQError is an OSError: the address cannot be used
        raise UsageError(f"--kv-events {args.kv_events}: {exc}") from None


def _imports() -> tuple[Any, Any]:
    prepare_torch_process()  # before anything imports torch
    try:
        from prefixflight.serve import http
    except ImportError as exc:
        raise UsageError(
            f"`prefixflight serve` needs the serve extra ({exc}); install it with "
            "`pip install 'prefixflight[serve]'`"
        ) from None
    try:
        from prefixflight.backends import torch as backend
    except ImportError as exc:
        raise UsageError(
            f"`prefixflight serve` needs the torch backend ({exc}); install it with "
            "`pip install torch==2.13.0 'prefixflight[torch]'`"
        ) from None
    return http, backend


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.replicas is not None:
        prepare_torch_process()
        return run_ray(args)
    if args.model == "tiny":
        parser.error("--model tiny has no tokenizer to serve text over HTTP: give --replicas")
    if args.max_batch_tokens < args.max_running:
        parser.error(
            f"--max-batch-tokens ({args.max_batch_tokens}) must be >= --max-running "
            f"({args.max_running})"
        )
    if args.served_model_name is not None and not args.served_model_name.strip():
        parser.error("--served-model-name must not be empty")
    kv_flags = (("--kv-events", args.kv_events), ("--kv-events-replay", args.kv_events_replay))
    for flag, value in kv_flags:
        if value is not None and "://" not in value:
            parser.error(f"{flag} must be a ZMQ address like tcp://*:5557, got {value!r}")
    if args.kv_events is None and (args.kv_events_replay or args.kv_events_pod):
        parser.error("--kv-events-replay and --kv-events-pod need --kv-events")
    http, backend = _imports()
    from prefixflight.core import ReleasePolicy
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise UsageError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from None
    with sock:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        started = time.perf_counter()
        loaded = backend.load_smollm2(
            device=None if args.device == "auto" else args.device, dtype=args.dtype
        )
        config = backend.EngineConfig(
            release_policy=ReleasePolicy(args.release_policy),
            num_pages=args.num_pages,
            page_size=args.block_size,
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            eviction=args.eviction,
            min_shared_blocks=args.min_shared_blocks,
        )
        name = args.served_model_name or loaded.name
        publisher = None if args.kv_events is None else kv_publisher(args, name)
        engine = backend.AsyncEngine.from_model(
            loaded.model,
            config,
            tokenizer=loaded.tokenizer,
            event_sink=publisher,
            device=str(loaded.model.device),
            dtype=str(loaded.model.dtype).removeprefix("torch."),
        )
        app = http.build_app(
            engine,
            http.HFCodec(loaded.tokenizer),
            http.ServerConfig(model_name=name, max_waiting=args.max_waiting),
        )
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(
            f"prefixflight serve: {name} on http://{shown}:{port} "
            f"(loaded in {time.perf_counter() - started:.1f} s; {args.num_pages} pages of "
            f"{args.block_size} tokens, release policy {args.release_policy})",
            file=sys.stderr,
            flush=True,
        )
        try:
            http.serve(app, sock, log_level=args.log_level, access_log=args.access_log)
        finally:
            if publisher is not None:
                publisher.close()
    return 0
