"""The simulated engine: the cost model, the driver, and what follows from the mechanism."""

from __future__ import annotations

import attrs
import pytest

from prefixflight.core import (
    ConfigError,
    DecodeWork,
    FlightConfig,
    PrefillWork,
    PublishMode,
    ReleasePolicy,
    SchedulerConfig,
    StepPlan,
    UsageError,
)
from prefixflight.core.flight import Role
from prefixflight.sim import (
    Arrival,
    CostModel,
    FlightSimConfig,
    simulate_engine,
    simulate_findings,
    simulate_incremental_publication,
    simulate_late_arrival,
    simulate_partial_prefix,
    simulate_single_flight,
)

COST = CostModel.calibrated()
SMALL = FlightSimConfig(num_pages=2048)


def plan(prefill_tokens: int = 0, decodes: int = 0) -> StepPlan:
    prefills: tuple[PrefillWork, ...] = ()
    if prefill_tokens:
        prefills = (
            PrefillWork(
                request_id=0, token_ids=(1,) * prefill_tokens, start=0, pages=(), sample=True
            ),
        )
    return StepPlan(
        step=0,
        prefills=prefills,
        decodes=tuple(
            DecodeWork(request_id=i + 1, token_id=1, position=1, pages=()) for i in range(decodes)
        ),
    )


def test_calibration_reproduces_its_measurements() -> None:
    c = CostModel.calibrated(
        prefill_seconds=0.8, prefill_tokens=400, decode_batch1=0.04, decode_batch8=0.11
    )
    assert c.step_time(plan(prefill_tokens=400)) == pytest.approx(0.8)
    assert c.step_time(plan(decodes=1)) == pytest.approx(0.04)
    assert c.step_time(plan(decodes=8)) == pytest.approx(0.11)
    # a share override keeps the default calibration's batch-1 decode and full prefill
    s = CostModel.calibrated(overhead_share=0.25)
    batch1 = COST.step_time(plan(decodes=1))
    assert s.step_time(plan(decodes=1)) == pytest.approx(batch1)
    assert s.step_overhead == pytest.approx(0.25 * batch1)
    assert s.step_time(plan(prefill_tokens=500)) == pytest.approx(
        COST.step_time(plan(prefill_tokens=500))
    )


def test_plain_transformers_prototype_is_the_first_calibration() -> None:
    m = CostModel.plain_transformers_prototype()
    assert m.step_time(plan(prefill_tokens=500)) == pytest.approx(0.73)
    assert m.step_time(plan(decodes=1)) == pytest.approx(0.035)
    assert m.step_time(plan(decodes=8)) == pytest.approx(0.095)


def test_fit_recovers_the_model_that_produced_the_times() -> None:
    truth = CostModel(step_overhead=0.03, prefill_per_token=0.0014, decode_per_request=0.009)
    shapes = [(n, 0) for n in (16, 128, 500)] + [(0, k) for k in (1, 2, 8)] + [(100, 3)]
    fitted = CostModel.fit((n, k, truth.time(n, k)) for n, k in shapes)
    for name in ("step_overhead", "prefill_per_token", "decode_per_request"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name))
    for n, k in shapes:
        assert fitted.step_time(plan(prefill_tokens=n, decodes=k)) == pytest.approx(
            truth.time(n, k)
        )


def test_fit_keeps_parameters_non_negative() -> None:
    # prefill steps get cheaper as they grow: the unconstrained slope is negative
    samples = [(16, 0, 0.2), (500, 0, 0.1), (0, 1, 0.03), (0, 8, 0.1)]
    unconstrained_slope = (0.1 - 0.2) / (500 - 16)
    assert unconstrained_slope < 0
    fitted = CostModel.fit(samples)
    assert min(fitted.step_overhead, fitted.prefill_per_token, fitted.decode_per_request) >= 0

    # it is the best non-negative fit: no small feasible move lowers the relative residual
    def residual(c: CostModel) -> float:
        return sum(((c.time(n, k) - t) / t) ** 2 for n, k, t in samples)

    base = residual(fitted)
    for dx in (-1e-4, 1e-4):
        for field in ("step_overhead", "prefill_per_token", "decode_per_request"):
            value = getattr(fitted, field) + dx * (1e-2 if field == "prefill_per_token" else 1)
            if value >= 0:
                moved = attrs.evolve(fitted, **{field: value})
                assert residual(moved) >= base - 1e-12


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([(16, 0, 0.1), (500, 0, 0.7)], "cannot determine"),  # decodes never vary
        ([(16, 0, 0.1), (32, 0, 0.2), (0, 1, 0.0)], "> 0"),
        ([(16, 0, 0.1), (-1, 0, 0.2), (0, 1, 0.03)], ">= 0"),
    ],
)
def test_fit_rejects_samples_that_cannot_fit(
    samples: list[tuple[int, int, float]], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        CostModel.fit(samples)


def test_cost_model_is_validated() -> None:
    with pytest.raises(ConfigError, match="step_overhead"):
        CostModel(step_overhead=-1.0, prefill_per_token=0.0, decode_per_request=0.0)
    with pytest.raises(ConfigError, match="overhead_share"):
        CostModel.calibrated(overhead_share=1.5)
    with pytest.raises(ConfigError, match="prefill_tokens"):
        CostModel.calibrated(prefill_tokens=0)


def _run(
    n: int, policy: ReleasePolicy, publish: PublishMode, budget: int = 512, *, sharing: bool = True
) -> list[object]:
    prompt = tuple(range(1, 101))
    work = [Arrival(request_id=i, prompt=prompt, max_new_tokens=8) for i in range(n)]
    config = SchedulerConfig(
        num_pages=512, max_batch_tokens=budget, publish=publish, same_step_sharing=sharing
    )
    res = simulate_engine(
        work,
        config=config,
        flight=FlightConfig(policy=policy),
        cost=COST,
    )
    total = sum(r.prompt_tokens for r in res.reports)
    assert res.scheduler.prefill_tokens + res.scheduler.cached_tokens == total
    for r in res.reports:
        assert r.ttft is not None and 0 < r.ttft <= r.latency
        assert len(r.output_token_ids) == 8
    return list(res.reports)


def test_cold_simultaneous_arrivals_share_only_through_same_step_sharing() -> None:
    """All four are admitted in one step. Without same-step sharing (or when blocks are
    published only on completion) that is a pure race: nobody reuses anything. With it
    (the default, as vLLM does) the first computes the prompt and the others read its
    pages as that step writes them."""
    for publish in PublishMode:
        reports = _run(4, ReleasePolicy.INDEPENDENT, publish, sharing=False)
        assert all(r.cached_tokens == 0 for r in reports)  # type: ignore[attr-defined]
    reports = _run(4, ReleasePolicy.INDEPENDENT, PublishMode.ON_COMPLETION)
    assert all(r.cached_tokens == 0 for r in reports)  # type: ignore[attr-defined]
    reports = _run(4, ReleasePolicy.INDEPENDENT, PublishMode.PER_STEP)
    assert [r.cached_tokens for r in reports] == [0, 96, 96, 96]  # type: ignore[attr-defined]
    assert len({r.first_token_at for r in reports}) == 1  # type: ignore[attr-defined]


def test_incremental_publication_recovers_what_happens_to_be_published() -> None:
    # without same-step sharing, a budget of 256 admits two and a half prompts per step: the
    # fourth request finds the first one's blocks only because they were published after
    # the first step
    reports = _run(4, ReleasePolicy.INDEPENDENT, PublishMode.PER_STEP, budget=256, sharing=False)
    cached = [r.cached_tokens for r in reports]  # type: ignore[attr-defined]
    assert cached[:3] == [0, 0, 0] and cached[3] == 96
    reports = _run(4, ReleasePolicy.INDEPENDENT, PublishMode.ON_COMPLETION, budget=256)
    assert all(r.cached_tokens == 0 for r in reports)  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", [ReleasePolicy.AFTER_PREFILL, ReleasePolicy.ON_COMPLETION])
def test_every_follower_recovers_every_full_prompt_block(policy: ReleasePolicy) -> None:
    reports = _run(4, policy, PublishMode.ON_COMPLETION)
    roles = [r.role for r in reports]  # type: ignore[attr-defined]
    assert roles.count(Role.LEADER) == 1 and roles.count(Role.FOLLOWER) == 3
    for r in reports:
        if r.role is Role.FOLLOWER:  # type: ignore[attr-defined]
            assert r.cached_tokens == (100 - 1) // 16 * 16  # type: ignore[attr-defined]


def test_seed_tables_follow_from_the_mechanism() -> None:
    inc = simulate_incremental_publication(COST, SMALL, followers=(2, 4), output_tokens=32)
    for r in inc:
        full = (r.prompt_tokens - 1) // 16 * 16
        expect = full if r.policy == "publish_per_step" else 0
        assert r.recovered_tokens_per_follower == expect
    by = {(r.policy, r.concurrency): r for r in inc}
    for n in (2, 4):
        assert by["publish_per_step", n].mean_ttft < by["publish_on_completion", n].mean_ttft

    sf = simulate_single_flight(COST, SMALL, output_tokens=32)
    by = {(r.policy, r.concurrency): r for r in sf}
    for n in (2, 4, 8):
        full = (532 - 1) // 16 * 16
        assert by["after_prefill", n].recovered_tokens_per_follower == full
        assert by["on_completion", n].recovered_tokens_per_follower == full
        assert by["independent", n].recovered_tokens_per_follower == 0
        best = by["after_prefill", n].mean_ttft
        assert best < by["on_completion", n].mean_ttft
        assert best < by["independent", n].mean_ttft
        # coordination computes the prompt once, plus one token-block tail per follower
        assert by["after_prefill", n].computed_prompt_tokens == 532 + (n - 1) * (532 - full)


def test_late_arrival_early_release_lowers_mean_ttft() -> None:
    rows = {
        r.policy: r for r in simulate_late_arrival(COST, SMALL, output_tokens=32, after_tokens=4)
    }
    assert rows["after_prefill"].mean_ttft < rows["on_completion"].mean_ttft
    assert rows["after_prefill"].recovered_tokens_per_follower == 528


def test_findings_agree_with_the_rows_they_summarise() -> None:
    for f in simulate_findings((0.0, None), SMALL):
        r = f.ratios
        assert f.on_completion_worse_ttft_at_2 == (r["on_completion_vs_independent_ttft_at_2"] > 1)
        assert f.on_completion_better_completion_at_2 == (
            r["on_completion_vs_independent_completion_at_2"] < 1
        )
        assert f.late_early_release_worse_completion == (
            r["late_after_prefill_vs_on_completion_completion"] > 1
        )
        assert f.after_prefill_best_ttft


def test_partial_prefix_rows() -> None:
    # with same-step sharing (the default) requests that arrive together read the document
    # as the first one writes it: partial coordination has nothing left to add
    exact, partial = simulate_partial_prefix(COST, SMALL, cases=((64, 16),), output_tokens=4)
    assert exact.recovered_tokens_per_follower == partial.recovered_tokens_per_follower == 64
    assert exact.computed_prompt_tokens == partial.computed_prompt_tokens == 64 + 4 * 16
    # without it, only partial coordination keeps them from computing the document 4 times
    unshared = attrs.evolve(SMALL, same_step_sharing=False)
    rows = simulate_partial_prefix(COST, unshared, cases=((64, 16),), output_tokens=4)
    exact, partial = rows
    assert exact.recovered_tokens_per_follower == 0
    assert partial.recovered_tokens_per_follower == 64
    assert partial.computed_prompt_tokens < exact.computed_prompt_tokens


def test_arrivals_triggered_by_tokens() -> None:
    prompt = tuple(range(40))
    work = [
        Arrival(request_id="a", prompt=prompt, max_new_tokens=10),
        Arrival(request_id="b", prompt=prompt, max_new_tokens=2, after=("a", 3), at=0.5),
    ]
    res = simulate_engine(
        work,
        config=SchedulerConfig(num_pages=64),
        flight=FlightConfig(policy=ReleasePolicy.INDEPENDENT),
        cost=COST,
    )
    a, b = res.reports
    assert b.arrived_at > a.first_token_at  # type: ignore[operator]
    assert b.cached_tokens == 32  # per-step publication: a's prompt blocks were ready


def test_workload_errors() -> None:
    cfg = SchedulerConfig(num_pages=64)
    flight = FlightConfig()
    dup = [Arrival(request_id=1, prompt=(1,), max_new_tokens=1)] * 2
    with pytest.raises(UsageError, match="duplicate"):
        simulate_engine(dup, config=cfg, flight=flight, cost=COST)
    with pytest.raises(UsageError, match="no arrivals"):
        simulate_engine([], config=cfg, flight=flight, cost=COST)
    never = [
        Arrival(request_id=1, prompt=(1,), max_new_tokens=1),
        Arrival(request_id=2, prompt=(1,), max_new_tokens=1, after=(1, 5)),
    ]
    with pytest.raises(UsageError, match="never"):
        simulate_engine(never, config=cfg, flight=flight, cost=COST)
    one = [Arrival(request_id=1, prompt=(1,), max_new_tokens=1)]
    with pytest.raises(ConfigError, match="flight block_size 8 != config block_size 16"):
        simulate_engine(one, config=cfg, flight=FlightConfig(block_size=8), cost=COST)
