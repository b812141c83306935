"""What the TTFT benchmark runs (`prefixflight bench ttft`, the experiments of `_bench`):
its sizes and the interleaved run order. No torch here, so the command's flags can name the
experiments without the torch extra."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from prefixflight.core import ConfigError

__all__ = ["EXPERIMENTS", "BenchRun", "TTFTBenchConfig", "plan_runs"]

EXPERIMENTS = ("warm_prefix", "incremental_publication", "single_flight", "late_arrival")


@attrs.frozen(kw_only=True)
class TTFTBenchConfig:
    """Sizes of the experiments (the study's by default) and how often to repeat them."""

    repetitions: int = 3
    output_tokens: int = 128
    warm_prompt_tokens: int = 904
    warm_cached_tokens: int = 880
    incremental_prompt_tokens: int = 493
    incremental_followers: tuple[int, ...] = (2, 4, 8)
    flight_prompt_tokens: int = 532
    flight_concurrency: tuple[int, ...] = (2, 4, 8)
    late_prompt_tokens: int = 532
    experiments: tuple[str, ...] = EXPERIMENTS
    block_size: int = 16
    max_batch_tokens: int = 1024
    max_running: int = 16

    def __attrs_post_init__(self) -> None:
        bad = [e for e in self.experiments if e not in EXPERIMENTS]
        if bad:
            raise ConfigError(f"unknown experiment {bad[0]!r} (choose from {sorted(EXPERIMENTS)})")
        for name in ("repetitions", "output_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.warm_cached_tokens < self.warm_prompt_tokens:
            raise ConfigError(
                f"warm_cached_tokens must be in (0, {self.warm_prompt_tokens}), "
                f"got {self.warm_cached_tokens!r}"
            )

    @property
    def num_pages(self) -> int:
        """Enough pages for the largest experiment's requests plus its cached prompt."""
        ps = self.block_size
        longest = max(
            self.warm_prompt_tokens,
            self.incremental_prompt_tokens,
            self.flight_prompt_tokens,
            self.late_prompt_tokens,
        )
        per_request = -(-(longest + self.output_tokens) // ps)
        most = max((*self.incremental_followers, *self.flight_concurrency, 2)) + 1
        return per_request * (most + 1) + 8


@attrs.frozen
class BenchRun:
    """One measured run: an experiment, a strategy, a concurrency and a repetition."""

    experiment: str
    policy: str
    concurrency: int
    repetition: int


def plan_runs(config: TTFTBenchConfig) -> list[BenchRun]:
    """Every run, repetitions outermost, strategies rotated per repetition (interleaving)."""
    runs: list[BenchRun] = []
    for rep in range(config.repetitions):
        for exp in config.experiments:
            if exp == "warm_prefix":
                runs.append(BenchRun(exp, "warm", 1, rep))
                continue
            if exp == "incremental_publication":
                policies = ["publish_on_completion", "publish_per_step"]
                sizes: Sequence[int] = config.incremental_followers
            elif exp == "single_flight":
                policies = ["independent", "on_completion", "after_prefill"]
                sizes = config.flight_concurrency
            else:
                policies = ["on_completion", "after_prefill"]
                sizes = (2,)
            for n in sizes:
                k = rep % len(policies)
                for policy in policies[k:] + policies[:k]:
                    runs.append(BenchRun(exp, policy, n, rep))
    return runs
