"""The Serve deployment: one `AsyncEngine` per replica, behind a deployment-handle API.

``handle.generate.remote(GenerateRequest(prompt_ids=..., max_tokens=...))`` (or the same
fields as keywords) returns a `GenerateResult`: the tokens, the replica that ran it and the
tokens it reused from that replica's prefix cache. Each replica reports its coarse cache
state to the routers through ``record_routing_stats`` (`ROUTING_STATS_KEYS`); Serve polls it
every ``request_routing_stats_period_s`` and hands it to routers as
``RunningReplica.routing_stats``.

torch is imported inside the replica (``__init__``), never in the router's process.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, final

import attrs

from prefixflight.backends import TINY_LLAMA  # the tiny model's shape (torch-free)
from prefixflight.core import ConfigError
from prefixflight.core.flight import RequestState

from ._adapter import FirstToken, GenerateRequest, GenerateResult

if TYPE_CHECKING:
    from ..kv_events import KVEventPublisher, PublisherAddress

__all__ = ["TINY_LLAMA", "CharTokenizer", "EngineReplica", "ModelKind", "ModelSpec"]

_LOOPBACK = "tcp://127.0.0.1:*"

ModelKind: TypeAlias = Literal["llama-config", "smollm2"]


def _check_kind(_i: object, _a: object, value: object) -> None:
    if value not in ("llama-config", "smollm2"):
        raise ConfigError(f"model kind must be 'llama-config' or 'smollm2', got {value!r}")


@attrs.frozen(kw_only=True)
class ModelSpec:
    """Which model each replica builds (a value: it travels to the replica processes).

    ``"llama-config"``: a random-weight ``LlamaForCausalLM`` from ``llama_config`` (keyword
    arguments of ``transformers.LlamaConfig``) and ``seed``; every replica builds the same
    weights. Text prompts use `CharTokenizer`. ``"smollm2"``: the bundled SmolLM2-135M and
    its tokenizer (`load_smollm2`).
    """

    kind: ModelKind = attrs.field(default="llama-config", validator=_check_kind)
    llama_config: Mapping[str, Any] = attrs.field(factory=lambda: dict(TINY_LLAMA))
    seed: int = 0

    @classmethod
    def tiny(cls, seed: int = 0) -> ModelSpec:
        return cls(kind="llama-config", llama_config=dict(TINY_LLAMA), seed=seed)

    @classmethod
    def smollm2(cls) -> ModelSpec:
        return cls(kind="smollm2")


@final
class CharTokenizer:
    """Characters -> ids in [1, vocab): the text tokenizer of random-weight test models."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ConfigError(f"vocab_size must be >= 2, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % (self.vocab_size - 1) + 1 for c in text]}


def _build(spec: ModelSpec) -> tuple[Any, Any]:
    match spec.kind:
        case "llama-config":
            import torch
            import transformers

            config = transformers.LlamaConfig(**dict(spec.llama_config))
            torch.manual_seed(spec.seed)
            model: Any = transformers.LlamaForCausalLM(config)
            model.eval()
            return model, CharTokenizer(int(config.vocab_size))
        case "smollm2":
            from prefixflight.backends.torch import load_smollm2

            loaded = load_smollm2(device="cpu")
            return loaded.model, loaded.tokenizer
        case _:  # pragma: no cover - the validator rejects other kinds
            raise ConfigError(f"unknown model kind {spec.kind!r}")


class EngineReplica:
    """The deployment class (``serve.deployment(EngineReplica)``): one `AsyncEngine`.

    ``engine_config`` is an `EngineConfig` (``None``: its defaults); ``torch_threads`` sets
    ``torch.set_num_threads`` in this replica (give each replica its share of the cores so
    N replicas do not oversubscribe them); ``report_blocks`` caps the resident block hashes
    each stats report carries (0: none). With ``kv_events``, the engine publishes its prefix
    cache's KV events (a `KVEventPublisher` on a free loopback port, with a replay socket,
    flushed after every engine step) and the stats report both endpoints
    (``kv_endpoint``, ``kv_replay_endpoint``), which is how a router with
    ``residency_source="kv_events"`` finds them; loopback means one host (one Ray node).
    """

    def __init__(
        self,
        model: ModelSpec,
        engine_config: Any = None,
        torch_threads: int = 1,
        report_blocks: int = 4096,
        kv_events: bool = False,
    ) -> None:
        self._publisher: KVEventPublisher | None = None
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import torch

        from prefixflight.backends.torch import AsyncEngine, EngineConfig, SamplingParams

        torch.set_num_threads(max(1, int(torch_threads)))
        model_obj, tokenizer = _build(model)
        config = EngineConfig() if engine_config is None else engine_config
        self._name = _replica_name()
        if kv_events:
            from ..kv_events import KVEventPublisher, kv_topic

            self._publisher = KVEventPublisher(
                _LOOPBACK, replay_endpoint=_LOOPBACK, topic=kv_topic(self._name, "prefixflight")
            )
        self._engine = AsyncEngine.from_model(
            model_obj, config, tokenizer=tokenizer, device="cpu", event_sink=self._publisher
        )
        self._sampling = SamplingParams
        self._requests = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._report_blocks = max(0, int(report_blocks))
        self._version = 0

    @property
    def name(self) -> str:
        return self._name

    async def generate(
        self, request: GenerateRequest | None = None, **fields: Any
    ) -> GenerateResult:
        """Run one request to completion (keywords build a `GenerateRequest`)."""
        result: GenerateResult | None = None
        async for event in self._run(GenerateRequest(**fields) if request is None else request):
            if isinstance(event, GenerateResult):
                result = event
        assert result is not None
        return result

    async def stream(
        self, request: GenerateRequest | None = None, **fields: Any
    ) -> AsyncIterator[FirstToken | GenerateResult]:
        """Two events (``handle.options(stream=True).stream.remote(...)``): `FirstToken` as
        soon as the first token exists, then the `GenerateResult`."""
        async for event in self._run(GenerateRequest(**fields) if request is None else request):
            yield event

    async def _run(self, req: GenerateRequest) -> AsyncIterator[FirstToken | GenerateResult]:
        prompt: Any = req.prompt_ids if req.prompt_ids else req.prompt
        sampling = self._sampling(
            max_tokens=req.max_tokens, temperature=req.temperature, seed=req.seed
        )
        gen = self._engine.generate(prompt, sampling, namespace=req.namespace)
        first: float | None = None
        async with gen:
            async for token in gen:
                if first is None:
                    first = time.time()
                    yield FirstToken(replica=self._name, token_id=token, unix=first)
        report = gen.report
        assert report is not None
        self._requests += 1
        self._prompt_tokens += report.prompt_tokens
        self._cached_tokens += report.cached_tokens
        yield GenerateResult(
            replica=self._name,
            token_ids=tuple(gen.tokens),
            prompt_tokens=report.prompt_tokens,
            cached_tokens=report.cached_tokens,
            role=report.role.value,
            ttft=report.ttft,
            first_token_unix=first,
            finished_unix=time.time(),
        )

    async def counters(self) -> dict[str, Any]:
        """The replica's coarse cache state (`ROUTING_STATS_KEYS`); async so that it runs on
        the engine's event loop, never beside a step in another thread."""
        sched = self._engine.scheduler
        states = list(sched.requests().values())
        usage = sched.page_usage()
        return {
            "replica": self._name,
            "running": sum(s is RequestState.RUNNING for s in states),
            "waiting": sum(s in (RequestState.QUEUED, RequestState.WAITING) for s in states),
            "kv_utilization": (usage.total - usage.free) / usage.total if usage.total else 0.0,
            "requests": self._requests,
            "prompt_tokens": self._prompt_tokens,
            "cached_tokens": self._cached_tokens,
            "cached_blocks": len(sched.cache),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this and passes it to routers as ``RunningReplica.routing_stats``:
        the counters plus a snapshot of the resident block hashes (`ROUTING_STATS_KEYS`)."""
        stats = await self.counters()
        self._version += 1
        stats["version"] = self._version
        resident = self._engine.scheduler.cache.policy.resident() if self._report_blocks else ()
        stats["resident_blocks"] = list(itertools.islice(resident, self._report_blocks))
        source = self.kv_event_source()
        if source is not None:
            stats["kv_endpoint"] = source.endpoint
            stats["kv_replay_endpoint"] = source.replay_endpoint
        return stats

    def kv_event_source(self) -> PublisherAddress | None:
        """Where this replica publishes its KV events (``None`` without ``kv_events``)."""
        pub = self._publisher
        if pub is None:
            return None
        from ..kv_events import PublisherAddress

        return PublisherAddress(pub.endpoint, pub.replay_endpoint)

    def close(self) -> None:
        """Close the KV-event publisher, sending what is pending (idempotent)."""
        pub = getattr(self, "_publisher", None)
        if pub is not None:
            self._publisher = None
            pub.close(timeout_s=1.0)

    def __del__(self) -> None:
        """Serve calls this when the replica shuts down."""
        self.close()


def _replica_name() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (a plain instance in a test)
        return f"local-{os.getpid()}"
