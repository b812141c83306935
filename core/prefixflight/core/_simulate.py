"""A pure, simulated-time engine: `Scheduler` + `FlightCoordinator` + `PrefixCache` + a cost model.

Nothing here is tuned to seed 000's numbers. One documented cost model gives each step a
duration; the scheduler decides everything else (who prefills what, who waits, what is
reused), so the shape of the results comes out of the mechanism.

Cost model (`CostModel`)::

    step_time = step_overhead
              + prefill_per_token  * (prompt tokens computed in the step)
              + decode_per_request * (decodes in the step)

Its defaults are derived (`CostModel.calibrated`) from /work/shared/MODEL.md's measurements
of SmolLM2-135M in fp32 on the 2-vCPU machine: a decode step costs 35 ms at batch 1 and
95 ms at batch 8, so ``decode_per_request = (95 - 35) / 7 ms`` and ``step_overhead = 35 ms -
decode_per_request``; a 500-token prefill costs 0.73 s, so ``prefill_per_token = (0.73 s -
step_overhead) / 500``. The model ignores attention over cached context: it predicts 0.054 s
for a 20-token suffix after a reused 480-token prefix, where 0.081 s was measured.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import attrs

from ._cache import PrefixCache
from ._errors import ConfigError, UsageError
from ._flight import FlightConfig, FlightCoordinator, FlightStats
from ._plan import RequestId, StepPlan, StepResult
from ._policies import LRU
from ._scheduler import RequestReport, Role, Scheduler, SchedulerConfig, SchedulerStats

__all__ = ["Arrival", "CostModel", "SimulationResult", "simulate_engine"]


def _non_negative(_inst: object, a: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{a.name} must be a number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class CostModel:
    """Seconds per step: a fixed overhead, plus prefill tokens, plus decodes (see module)."""

    step_overhead: float = attrs.field(validator=_non_negative)
    prefill_per_token: float = attrs.field(validator=_non_negative)
    decode_per_request: float = attrs.field(validator=_non_negative)

    @classmethod
    def calibrated(
        cls,
        *,
        prefill_seconds: float = 0.73,
        prefill_tokens: int = 500,
        decode_batch1: float = 0.035,
        decode_batch8: float = 0.095,
        overhead_share: float | None = None,
    ) -> CostModel:
        """Derive the three parameters from measured times (defaults: MODEL.md, fp32 CPU).

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
            if not 0.0 <= overhead_share <= 1.0:
                raise ConfigError(f"overhead_share must be in [0, 1], got {overhead_share!r}")
            overhead = decode_batch1 * overhead_share
            per_request = decode_batch1 - overhead
        return cls(
            step_overhead=overhead,
            prefill_per_token=(prefill_seconds - overhead) / prefill_tokens,
            decode_per_request=per_request,
        )

    def step_time(self, plan: StepPlan) -> float:
        prefill = sum(len(p.token_ids) for p in plan.prefills)
        return (
            self.step_overhead
            + self.prefill_per_token * prefill
            + self.decode_per_request * len(plan.decodes)
        )


def _token_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


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
    sched = Scheduler(
        config,
        cache=PrefixCache(LRU(config.num_pages), config.block_size),
        coordinator=FlightCoordinator(flight),
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
