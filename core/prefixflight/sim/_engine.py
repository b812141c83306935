"""A pure, simulated-time engine: `Scheduler` + `FlightCoordinator` + `PrefixCache` + a cost model.

Nothing here is tuned to the numbers of the single-flight prefill study of mini-vllm-rs. One
documented cost model gives each step a duration; the scheduler decides everything else (who
prefills what, who waits, what is reused), so the shape of the results comes out of the mechanism.

Cost model (`CostModel`)::

    step_time = step_overhead
              + prefill_per_token  * (prompt tokens computed in the step)
              + decode_per_request * (decodes in the step)

Its defaults (`CostModel.calibrated`) were measured with prefixflight's own torch backend:
``prefixflight bench calibrate --repetitions 9`` (2 torch threads, fp32 SmolLM2-135M-Instruct
on `TransformersRunner`, OMP_WAIT_POLICY=PASSIVE), run on a
2-vCPU machine (AMD EPYC; other processes used 0.00 cores while it measured), fits
``step_overhead`` = 68.2 ms, ``prefill_per_token`` = 1.825 ms and ``decode_per_request`` =
24.9 ms to the medians of cold prefills of 16-500 tokens and decode steps at batch 1, 2, 4 and
8 over 496 cached tokens (`CostModel.fit`). The linear model is a compromise: measured
prefills cost 97 ms + 1.66 ms/token alone, and a batch-1 decode (76 ms) skips the padding
mask that batches of 2 or more pay for (141 ms at batch 2, 267 ms at batch 8). It also
ignores attention over cached context: it predicts 105 ms for a 20-token suffix after a
reused 480-token prefix, where 146 ms was measured. `CostModel.plain_transformers_prototype`
keeps the first calibration, of a plain-transformers prototype without a paged pool on a
faster CPU: 26.4 ms + 1.407 ms per prefill token + 8.57 ms per decode.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import final

import attrs

from prefixflight.core import (
    ConfigError,
    FlightConfig,
    RequestId,
    RequestReport,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    UsageError,
)
from prefixflight.core.flight import FlightStats, Role, SchedulerStats
from prefixflight.core.validate import check_ratio, is_int, is_real, number_field

__all__ = ["Arrival", "CostModel", "SimulationResult", "simulate_engine"]


@final
@attrs.frozen(kw_only=True)
class CostModel:
    """Seconds per step: a fixed overhead, plus prefill tokens, plus decodes (see module)."""

    step_overhead: float = attrs.field(validator=number_field(minimum=0))
    prefill_per_token: float = attrs.field(validator=number_field(minimum=0))
    decode_per_request: float = attrs.field(validator=number_field(minimum=0))

    @classmethod
    def calibrated(
        cls,
        *,
        prefill_seconds: float = 0.98059,
        prefill_tokens: int = 500,
        decode_batch1: float = 0.09312,
        decode_batch8: float = 0.26751,
        overhead_share: float | None = None,
    ) -> CostModel:
        """Derive the three parameters from measured times.

        ``decode_per_request = (decode_batch8 - decode_batch1) / 7``, ``step_overhead =
        decode_batch1 - decode_per_request`` and ``prefill_per_token = (prefill_seconds -
        step_overhead) / prefill_tokens``. The defaults are the step times that
        ``prefixflight bench calibrate --repetitions 9`` fitted (a
        2-vCPU machine, 2 torch threads, fp32; its last output line prints these four
        values): 68.2 ms + 1.825 ms per prefill token + 24.9 ms per decode. See the module
        docstring, and `plain_transformers_prototype` for the earlier calibration.

        ``overhead_share`` overrides the split of the batch-1 decode step between the fixed
        overhead and the per-request part (0: decode batching gains nothing; 1: a batch of
        any size costs one batch-1 step), keeping the batch-1 decode and prefill times.
        """
        if prefill_tokens <= 0:
            raise ConfigError(f"prefill_tokens must be > 0, got {prefill_tokens!r}")
        if overhead_share is None:
            per_request = (decode_batch8 - decode_batch1) / 7
            overhead = decode_batch1 - per_request
        else:
            check_ratio("overhead_share", overhead_share)
            overhead = decode_batch1 * overhead_share
            per_request = decode_batch1 - overhead
        return cls(
            step_overhead=overhead,
            prefill_per_token=(prefill_seconds - overhead) / prefill_tokens,
            decode_per_request=per_request,
        )

    @classmethod
    def plain_transformers_prototype(cls) -> CostModel:
        """The first calibration: SmolLM2-135M step times of a plain-transformers prototype
        (no paged pool, a faster CPU than the defaults'): 500-token prefill 0.73 s, decode
        35 ms at batch 1 and 95 ms at batch 8."""
        return cls.calibrated(
            prefill_seconds=0.73, prefill_tokens=500, decode_batch1=0.035, decode_batch8=0.095
        )

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> CostModel:
        """Least-squares fit of the three parameters to measured steps.

        ``samples`` are ``(prefill_tokens, decodes, seconds)``: one step that computed that
        many prompt tokens and decoded that many requests, taking ``seconds``. Errors are
        weighted relative to the measured time, so a 30 ms decode step counts as much as a
        0.7 s prefill. Parameters are constrained to be >= 0 (with three parameters the
        exact non-negative optimum is the best feasible fit over the subsets of free
        parameters). Raises `ConfigError` when the samples cannot determine the three
        parameters (the steps must vary prefill tokens and decodes independently).
        """
        rows = []
        for sample in samples:
            n, k, t = sample
            if not is_real(t) or not t > 0:
                raise ConfigError(f"a sample's time must be a number > 0, got {sample!r}")
            if not (is_int(n) and is_int(k) and n >= 0 and k >= 0):
                raise ConfigError(
                    f"a sample's token and decode counts must be ints >= 0, got {sample!r}"
                )
            rows.append((1.0 / t, n / t, k / t))  # minimise sum (x . beta - 1)^2
        if _least_squares(rows, (0, 1, 2)) is None:
            raise ConfigError(
                f"{len(rows)} samples cannot determine the cost model: it needs steps of "
                "steps whose prefill tokens and decodes vary independently"
            )
        best: tuple[float, list[float]] | None = None
        for free in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            beta = _least_squares(rows, free)
            if beta is None or min(beta) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for i, v in zip(free, beta, strict=True):
                full[i] = v
            residual = sum(
                (sum(x * b for x, b in zip(r, full, strict=True)) - 1) ** 2 for r in rows
            )
            if best is None or residual < best[0]:
                best = (residual, full)
        assert best is not None  # the overhead alone always fits with a positive value
        overhead, per_token, per_request = best[1]
        return cls(
            step_overhead=overhead, prefill_per_token=per_token, decode_per_request=per_request
        )

    def step_time(self, plan: StepPlan) -> float:
        prefill = sum(len(p.token_ids) for p in plan.prefills)
        return self.time(prefill, len(plan.decodes))

    def time(self, prefill_tokens: int, decodes: int) -> float:
        """Seconds for a step computing ``prefill_tokens`` prompt tokens and ``decodes``
        decodes."""
        return (
            self.step_overhead
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_request * decodes
        )


def _least_squares(
    rows: list[tuple[float, float, float]], free: tuple[int, ...]
) -> list[float] | None:
    """Minimise ``sum((row[free] . beta - 1)^2)``; None if the columns are dependent."""
    m = len(free)
    a = [[sum(r[i] * r[j] for r in rows) for j in free] + [sum(r[i] for r in rows)] for i in free]
    for col in range(m):  # Gauss-Jordan elimination with partial pivoting
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        scale = max(abs(a[i][col]) for i in range(m))
        if scale == 0 or abs(a[pivot][col]) <= 1e-10 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(m):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][m] / a[i][i] for i in range(m)]


def _token_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


@final
@attrs.frozen(kw_only=True)
class Arrival:
    """A request of the workload. It arrives at ``at`` seconds, or, with ``after=(rid, n)``,
    ``at`` seconds after request ``rid`` has produced ``n`` output tokens."""

    request_id: RequestId
    prompt: tuple[int, ...] = attrs.field(converter=_token_tuple)
    max_new_tokens: int
    at: float = 0.0
    after: tuple[RequestId, int] | None = None
    namespace: bytes = b""


@final
@attrs.frozen(kw_only=True)
class SimulationResult:
    """Per-request reports (in arrival order) and the components' stats."""

    reports: tuple[RequestReport, ...]
    scheduler: SchedulerStats
    flights: FlightStats
    end: float

    def ttfts(self, *, followers_only: bool = False) -> list[float]:
        out = []
        for r in self.reports:
            if followers_only and r.role is not Role.FOLLOWER:
                continue
            assert r.ttft is not None
            out.append(r.ttft)
        return out

    @property
    def mean_ttft(self) -> float:
        t = self.ttfts()
        return sum(t) / len(t)

    @property
    def slowest_completion(self) -> float:
        """The longest arrival-to-completion latency."""
        return max(r.latency for r in self.reports)


def simulate_engine(
    arrivals: Iterable[Arrival],
    *,
    config: SchedulerConfig,
    flight: FlightConfig,
    cost: CostModel,
    sampled_token: int = 0,
) -> SimulationResult:
    """Run the workload to completion in simulated time; every sampled token is
    ``sampled_token`` (never a stop token). Arrivals during a step join at their own time."""
    if flight.block_size != config.block_size:
        raise ConfigError(
            f"flight block_size {flight.block_size} != config block_size {config.block_size}"
        )
    sched = Scheduler.build(
        config,
        release=flight.policy,
        max_wait=flight.max_wait,
        min_shared_blocks=flight.min_shared_blocks,
    )
    timed: list[tuple[float, int, Arrival]] = []
    triggered: dict[RequestId, list[tuple[int, int, Arrival]]] = {}
    order: dict[RequestId, int] = {}
    for i, a in enumerate(arrivals):
        if a.request_id in order:
            raise UsageError(f"duplicate request id {a.request_id!r} in the workload")
        order[a.request_id] = i
        if a.after is None:
            timed.append((a.at, i, a))
        else:
            triggered.setdefault(a.after[0], []).append((a.after[1], i, a))
    if not order:
        raise UsageError("the workload has no arrivals")
    heapq.heapify(timed)
    produced: dict[RequestId, int] = {}
    reports: dict[RequestId, RequestReport] = {}
    now = 0.0

    def arrive_until(t: float) -> None:
        while timed and timed[0][0] <= t:
            at, _, a = heapq.heappop(timed)
            sched.add_request(
                a.request_id, a.prompt, max_new_tokens=a.max_new_tokens, now=max(at, sched.now),
                namespace=a.namespace,
            )  # fmt: skip

    while True:
        arrive_until(now)
        if not sched.has_unfinished and not timed:
            break
        plan = sched.schedule(now)
        if plan.is_empty:
            if not timed:
                raise UsageError("the workload is stuck: arrivals wait for tokens never produced")
            now = max(now, timed[0][0])
            continue
        end = now + cost.step_time(plan)
        arrive_until(end)  # these arrive while the step runs
        sampled = [(p.request_id, sampled_token) for p in plan.prefills if p.sample]
        sampled += [(d.request_id, sampled_token) for d in plan.decodes]
        outcome = sched.complete_step(StepResult(step=plan.step, sampled=tuple(sampled)), end)
        for rid, _ in outcome.tokens:
            n = produced[rid] = produced.get(rid, 0) + 1
            for need, i, a in triggered.get(rid, ()):
                if need == n:
                    heapq.heappush(timed, (end + a.at, i, a))
        for r in outcome.finished:
            reports[r.request_id] = r
        now = end
    missing = [rid for rid in order if rid not in reports]
    if missing:
        raise UsageError(f"requests never arrived (their trigger never fired): {missing[:3]!r}")
    return SimulationResult(
        reports=tuple(sorted(reports.values(), key=lambda r: order[r.request_id])),
        scheduler=sched.stats,
        flights=sched.coordinator.stats,
        end=now,
    )
