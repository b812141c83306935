"""The experiments of the single-flight prefill study of mini-vllm-rs, run on the simulated
engine (`simulate_engine`).

Each function builds the workload the study describes, runs it under each policy and returns
one row per (policy, concurrency). Nothing is typed in: recovered tokens, TTFTs and
completions are whatever the scheduler, coordinator and cost model produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import attrs

from prefixflight.core import FlightConfig, PublishMode, ReleasePolicy, SchedulerConfig

from ._engine import Arrival, CostModel, SimulationResult, simulate_engine

__all__ = [
    "FindingsRow",
    "FlightRow",
    "FlightSimConfig",
    "simulate_findings",
    "simulate_incremental_publication",
    "simulate_late_arrival",
    "simulate_partial_prefix",
    "simulate_single_flight",
]


@final
@attrs.frozen(kw_only=True)
class FlightSimConfig:
    """Engine shape shared by every experiment (block size as in the study: 16).
    ``same_step_sharing``: `SchedulerConfig.same_step_sharing` (False: the engine before it,
    where requests admitted in one step never read each other's blocks)."""

    block_size: int = 16
    num_pages: int = 8192
    max_batch_tokens: int = 2048
    max_running: int = 64
    same_step_sharing: bool = True

    def scheduler(self, publish: PublishMode) -> SchedulerConfig:
        return SchedulerConfig(
            num_pages=self.num_pages,
            block_size=self.block_size,
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            publish=publish,
            same_step_sharing=self.same_step_sharing,
        )

    def flight(self, policy: ReleasePolicy, **kw: Any) -> FlightConfig:
        return FlightConfig(policy=policy, block_size=self.block_size, **kw)


@final
@attrs.frozen(kw_only=True)
class FlightRow:
    """One measured configuration. Times are simulated seconds."""

    policy: str
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    recovered_tokens_per_follower: float
    """Mean cached (reused) prompt tokens of every request but the first to arrive."""
    mean_ttft: float
    slowest_completion: float
    """The longest arrival-to-completion latency."""
    computed_prompt_tokens: int
    """Prompt tokens computed by all requests together."""

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((i * 7919 + salt * 104729) % 49152 for i in range(n))


def _row(
    policy: str, concurrency: int, prompt: int, out: int, res: SimulationResult, *,
    ttft_of_followers: bool = False,
) -> FlightRow:  # fmt: skip
    later = res.reports[1:]
    ttfts = res.ttfts()
    if ttft_of_followers:
        ttfts = ttfts[1:]
    return FlightRow(
        policy=policy,
        concurrency=concurrency,
        prompt_tokens=prompt,
        output_tokens=out,
        recovered_tokens_per_follower=(
            sum(r.cached_tokens for r in later) / len(later) if later else 0.0
        ),
        mean_ttft=sum(ttfts) / len(ttfts),
        slowest_completion=res.slowest_completion,
        computed_prompt_tokens=res.scheduler.prefill_tokens,
    )


def simulate_incremental_publication(
    cost: CostModel,
    sim: FlightSimConfig = FlightSimConfig(),
    *,
    followers: Sequence[int] = (2, 4, 8),
    prompt_tokens: int = 493,
    output_tokens: int = 128,
) -> list[FlightRow]:
    """The study's incremental publication: start one request; when it returns its first token,
    submit ``n`` more with the same prompt while it keeps decoding. No single flight. ``mean_ttft``
    is the followers'."""
    prompt = _prompt(prompt_tokens)
    rows = []
    for n in followers:
        for publish, name in (
            (PublishMode.ON_COMPLETION, "publish_on_completion"),
            (PublishMode.PER_STEP, "publish_per_step"),
        ):
            work = [Arrival(request_id=0, prompt=prompt, max_new_tokens=output_tokens)]
            work += [
                Arrival(request_id=i, prompt=prompt, max_new_tokens=output_tokens, after=(0, 1))
                for i in range(1, n + 1)
            ]
            res = simulate_engine(
                work,
                config=sim.scheduler(publish),
                flight=sim.flight(ReleasePolicy.INDEPENDENT),
                cost=cost,
            )
            rows.append(_row(name, n, prompt_tokens, output_tokens, res, ttft_of_followers=True))
    return rows


_POLICY_NAMES = {
    ReleasePolicy.INDEPENDENT: "independent",
    ReleasePolicy.ON_COMPLETION: "on_completion",
    ReleasePolicy.AFTER_PREFILL: "after_prefill",
}


def simulate_single_flight(
    cost: CostModel,
    sim: FlightSimConfig = FlightSimConfig(),
    *,
    concurrency: Sequence[int] = (2, 4, 8),
    prompt_tokens: int = 532,
    output_tokens: int = 128,
    publish: PublishMode = PublishMode.ON_COMPLETION,
) -> list[FlightRow]:
    """The study's single flight: ``n`` identical requests arrive together. The baseline is the
    study's
    "independent execution, publish on completion"; the flights publish the leader's prompt
    when its prefill ends."""
    prompt = _prompt(prompt_tokens)
    rows = []
    for n in concurrency:
        for policy in (
            ReleasePolicy.INDEPENDENT,
            ReleasePolicy.ON_COMPLETION,
            ReleasePolicy.AFTER_PREFILL,
        ):
            work = [
                Arrival(request_id=i, prompt=prompt, max_new_tokens=output_tokens) for i in range(n)
            ]
            res = simulate_engine(
                work, config=sim.scheduler(publish), flight=sim.flight(policy), cost=cost
            )
            rows.append(_row(_POLICY_NAMES[policy], n, prompt_tokens, output_tokens, res))
    return rows


def simulate_late_arrival(
    cost: CostModel,
    sim: FlightSimConfig = FlightSimConfig(),
    *,
    prompt_tokens: int = 532,
    output_tokens: int = 128,
    after_tokens: int = 16,
    publish: PublishMode = PublishMode.ON_COMPLETION,
) -> list[FlightRow]:
    """The study's late arrival: a second identical request arrives once the first has produced
    ``after_tokens`` tokens (it is decoding)."""
    prompt = _prompt(prompt_tokens)
    rows = []
    for policy in (
        ReleasePolicy.INDEPENDENT,
        ReleasePolicy.ON_COMPLETION,
        ReleasePolicy.AFTER_PREFILL,
    ):
        work = [
            Arrival(request_id=0, prompt=prompt, max_new_tokens=output_tokens),
            Arrival(
                request_id=1, prompt=prompt, max_new_tokens=output_tokens, after=(0, after_tokens)
            ),
        ]
        res = simulate_engine(
            work, config=sim.scheduler(publish), flight=sim.flight(policy), cost=cost
        )
        rows.append(_row(_POLICY_NAMES[policy], 2, prompt_tokens, output_tokens, res))
    return rows


@final
@attrs.frozen(kw_only=True)
class FindingsRow:
    """Whether the single-flight study's subtler findings hold under one cost model."""

    overhead_share: float
    """Fixed share of a batch-1 decode step (0: batching decodes gains nothing)."""
    step_overhead: float
    decode_per_request: float
    prefill_per_token: float
    on_completion_worse_ttft_at_2: bool
    """At 2 requests ON_COMPLETION has a worse mean TTFT than INDEPENDENT ..."""
    on_completion_better_completion_at_2: bool
    """... yet a better slowest completion."""
    late_early_release_better_ttft: bool
    """Late arrival: AFTER_PREFILL lowers mean TTFT vs ON_COMPLETION ..."""
    late_early_release_worse_completion: bool
    """... but raises the slowest completion."""
    after_prefill_best_ttft: bool
    """AFTER_PREFILL has the best mean TTFT at 2, 4 and 8 requests."""
    ratios: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def simulate_findings(
    shares: Sequence[float | None] = (0.0, 0.25, 0.5, None, 1.0),
    sim: FlightSimConfig = FlightSimConfig(),
    *,
    calibration: dict[str, Any] | None = None,
) -> list[FindingsRow]:
    """Evaluate the findings while the batch-1 decode step's fixed share varies (``None``:
    the calibrated split). Batch-1 decode and 500-token prefill times stay as measured."""
    rows = []
    for share in shares:
        cost = CostModel.calibrated(overhead_share=share, **(calibration or {}))
        sf = {(r.policy, r.concurrency): r for r in simulate_single_flight(cost, sim)}
        late = {r.policy: r for r in simulate_late_arrival(cost, sim)}
        ind2, onc2 = sf["independent", 2], sf["on_completion", 2]
        best = all(
            sf["after_prefill", n].mean_ttft
            < min(sf["independent", n].mean_ttft, sf["on_completion", n].mean_ttft)
            for n in (2, 4, 8)
        )
        lo, la = late["on_completion"], late["after_prefill"]
        total = cost.step_overhead + cost.decode_per_request
        rows.append(
            FindingsRow(
                overhead_share=cost.step_overhead / total if total else 0.0,
                step_overhead=cost.step_overhead,
                decode_per_request=cost.decode_per_request,
                prefill_per_token=cost.prefill_per_token,
                on_completion_worse_ttft_at_2=onc2.mean_ttft > ind2.mean_ttft,
                on_completion_better_completion_at_2=(
                    onc2.slowest_completion < ind2.slowest_completion
                ),
                late_early_release_better_ttft=la.mean_ttft < lo.mean_ttft,
                late_early_release_worse_completion=la.slowest_completion > lo.slowest_completion,
                after_prefill_best_ttft=best,
                ratios={
                    "on_completion_vs_independent_ttft_at_2": onc2.mean_ttft / ind2.mean_ttft,
                    "on_completion_vs_independent_completion_at_2": (
                        onc2.slowest_completion / ind2.slowest_completion
                    ),
                    "late_after_prefill_vs_on_completion_ttft": la.mean_ttft / lo.mean_ttft,
                    "late_after_prefill_vs_on_completion_completion": (
                        la.slowest_completion / lo.slowest_completion
                    ),
                },
            )
        )
    return rows


def simulate_partial_prefix(
    cost: CostModel,
    sim: FlightSimConfig = FlightSimConfig(),
    *,
    requests: int = 4,
    cases: Sequence[tuple[int, int]] = ((512, 16), (64, 448)),
    output_tokens: int = 32,
    min_shared_blocks: int = 1,
) -> list[FlightRow]:
    """Requests that share a document of ``shared`` tokens and differ in a ``tail``-token
    question, arriving together. ``exact_only``: single flight on exact prompts only (no
    flight forms); ``partial``: they wait for the leader's shared blocks. Both publish per
    step. ``prompt_tokens`` is shared + tail; ``concurrency`` the number of requests."""
    rows = []
    for shared, tail in cases:
        doc = _prompt(shared)
        work = [
            Arrival(
                request_id=i,
                prompt=doc + _prompt(tail, salt=i + 1),
                max_new_tokens=output_tokens,
            )
            for i in range(requests)
        ]
        for name, kw in (("exact_only", {}), ("partial", {"min_shared_blocks": min_shared_blocks})):
            res = simulate_engine(
                work,
                config=sim.scheduler(PublishMode.PER_STEP),
                flight=sim.flight(ReleasePolicy.AFTER_PREFILL, **kw),
                cost=cost,
            )
            rows.append(
                _row(f"{name}:{shared}+{tail}", requests, shared + tail, output_tokens, res)
            )
    return rows
