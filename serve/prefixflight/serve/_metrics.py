"""``GET /metrics``: Prometheus text via ``prometheus_client``, vLLM's names where they exist.

vLLM's metrics keep their ``vllm:`` names and labels (``model_name``, ``engine``) so that
existing dashboards and scrapers (llm-d's endpoint picker reads ``vllm:num_requests_waiting``
and ``vllm:kv_cache_usage_perc``) work unchanged; our own metrics are named
``prefixflight:...``. Names, types and meanings as in vLLM's v1 Prometheus logger
(``vllm/v1/metrics/loggers.py``): counters are declared without ``_total`` and exposed with
it, token counters count tokens. docs/serve.md lists every metric and each difference.

Gauges and the engine's own counters are read at scrape time by a collector; the scrape runs
on the event loop that owns the engine, so it reads one consistent state. Per-request
metrics (latencies, cache queries and hits) are recorded by the server as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixflight.core import FinishReason, RequestReport
from prefixflight.core.flight import RequestState, Role

if TYPE_CHECKING:
    from prefixflight.backends.torch import AsyncEngine

__all__ = ["ServeMetrics"]

LABELS = ("model_name", "engine")
# vLLM's histogram buckets for these metrics
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on
_FINISHED = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort",
}


@final
class ServeMetrics:
    """The server's metrics in one registry of their own (so several servers can share a
    process, as tests do)."""

    __slots__ = (
        "_computed",
        "_e2e",
        "_followers_released",
        "_generation_tokens",
        "_hits",
        "_itl",
        "_prompt_tokens",
        "_queries",
        "_rejected",
        "_success",
        "_ttft",
        "_values",
        "registry",
    )

    def __init__(
        self, engine: AsyncEngine, model_name: str, in_progress: Callable[[], int] = lambda: 0
    ) -> None:
        reg = self.registry = CollectorRegistry()
        values = self._values = (model_name, "0")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg)

        self._prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(*values)
        self._computed = counter(
            "prefixflight:computed_prompt_tokens",
            "Prompt tokens computed by the model (the rest were reused from the cache).",
        ).labels(*values)
        self._generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*values)
        self._success = Counter(
            "vllm:request_success",
            "Count of finished requests by finish reason.",
            [*LABELS, "finished_reason"],
            registry=reg,
        )
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(*values)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(*values)
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            E2E_BUCKETS,
        ).labels(*values)
        self._followers_released = counter(
            "prefixflight:followers_released",
            "Requests that waited in a flight and were then admitted to reuse its prefill.",
        ).labels(*values)
        self._rejected = Counter(
            "prefixflight:requests_rejected",
            "Requests turned away before reaching the engine, by reason "
            "(overloaded: 429, unavailable: 503).",
            [*LABELS, "reason"],
            registry=reg,
        )
        Gauge(
            "prefixflight:requests_in_progress",
            "Choices the server admitted that have not ended (the count behind 429).",
            LABELS,
            registry=reg,
        ).labels(*values).set_function(lambda: float(in_progress()))
        for reason in ("overloaded", "unavailable"):
            self._rejected.labels(*values, reason)
        for reason in _FINISHED.values():
            self._success.labels(*values, reason)
        reg.register(_EngineCollector(engine, values))

    # -- recording (on the event loop) --------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(*self._values, reason).inc()

    def finished(self, report: RequestReport) -> None:
        """Count a request that ended (finished or aborted)."""
        if report.admitted_at is not None:  # it looked the cache up and ran
            self._prompt_tokens.inc(report.prompt_tokens)
            self._computed.inc(report.computed_prompt_tokens)
            if report.role is Role.FOLLOWER:
                self._followers_released.inc()
        self._generation_tokens.inc(len(report.output_token_ids))
        self._success.labels(*self._values, _FINISHED[report.finish_reason]).inc()
        self._e2e.observe(report.latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@final
class _EngineCollector(Collector):
    """Gauges and engine counters, read from the scheduler at scrape time."""

    def __init__(self, engine: AsyncEngine, values: tuple[str, str]) -> None:
        self._engine = engine
        self._values = list(values)

    def collect(self) -> Iterator[Metric]:
        sched = self._engine.scheduler
        values = self._values
        states = list(sched.requests().values())
        running = sum(s is RequestState.RUNNING for s in states)
        # queued for pages or following a flight; not ABORTING (it only holds its pages
        # until its step ends)
        waiting = sum(s in (RequestState.QUEUED, RequestState.WAITING) for s in states)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float, **extra: str) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=[*LABELS, *extra])
            c.add_metric([*values, *extra.values()], value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", running
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed (queued for pages, or waiting in a "
            "flight for its leader's prefill).",
            waiting,
        )
        usage = sched.page_usage()
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (pages held by running requests; "
            "cached pages nobody uses are free to evict and count as free, as in vLLM).",
            (usage.pinned + usage.private) / usage.total,
        )
        pages = GaugeMetricFamily(
            "prefixflight:kv_pages",
            "Pages of the KV pool by state (free + cached + private = total; pinned is the "
            "part of cached that running requests hold).",
            labels=[*LABELS, "state"],
        )
        for state, n in (
            ("free", usage.free),
            ("cached", usage.cached),
            ("pinned", usage.pinned),
            ("private", usage.private),
        ):
            pages.add_metric([*values, state], n)
        yield pages
        flight = sched.coordinator.stats
        yield counter(
            "prefixflight:flights_opened", "Single-flight groups opened.", flight.flights_opened
        )
        yield counter(
            "prefixflight:flight_followers",
            "Requests that joined an open flight as followers (exact or partial prefix).",
            flight.followers + flight.partial_followers,
        )
        yield counter(
            "prefixflight:tokens_not_recomputed",
            "Prompt tokens that followers reused instead of computing them again.",
            flight.tokens_not_recomputed,
        )
        stats = sched.stats
        # the scheduler counts one lookup per admitted request, as vLLM counts its queries
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_hit_tokens,
        )
        policy = self._engine.config.eviction
        yield counter(
            "prefixflight:evicted_blocks",
            "Cached blocks evicted, by eviction policy.",
            stats.evicted_blocks,
            policy=policy,
        )
        yield counter(
            "prefixflight:orphans_evicted",
            "Cached blocks removed because an ancestor was evicted, by eviction policy.",
            stats.orphans_evicted,
            policy=policy,
        )
        yield counter(
            "prefixflight:duplicate_blocks",
            "Blocks a request computed although another request had published them first.",
            stats.duplicate_blocks,
        )
