"""What the scheduler reports: a request's metrics when it ends, a step's outcome, the
counters and the pool's page usage. Frozen values; the scheduler makes them, nothing else."""

from __future__ import annotations

from typing import final

import attrs

from .._ids import RequestId
from ._sched_states import FinishReason, Role

__all__ = ["PageUsage", "RequestReport", "SchedulerStats", "StepOutcome"]


@final
@attrs.frozen(kw_only=True)
class RequestReport:
    """Per-request metrics, returned when a request finishes or is aborted.

    Times are the host's ``now`` values (simulated or wall seconds); steps are plan numbers.
    ``cached_tokens`` were reused from the cache; ``computed_prompt_tokens`` were computed
    by this request (they add up to ``prompt_tokens`` once the prefill is done).
    """

    request_id: RequestId
    role: Role
    """What the request did in single flight (see `Role`: a leader nobody followed reports
    `Role.INDEPENDENT`)."""
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    computed_prompt_tokens: int
    output_token_ids: tuple[int, ...]
    arrived_at: float
    flight_wait: float
    """Time spent waiting in a flight (0 unless a follower)."""
    admitted_at: float | None
    first_token_at: float | None
    first_token_step: int | None
    finished_at: float
    finished_step: int | None
    """The step whose result ended the request (``None`` if aborted outside a step)."""

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_at is None else self.first_token_at - self.arrived_at

    @property
    def latency(self) -> float:
        """Arrival to completion."""
        return self.finished_at - self.arrived_at


@final
@attrs.frozen(kw_only=True)
class StepOutcome:
    """What `Scheduler.complete_step` did: the tokens it appended and the requests that ended."""

    step: int
    tokens: tuple[tuple[RequestId, int], ...]
    finished: tuple[RequestReport, ...]


@final
@attrs.frozen(kw_only=True)
class SchedulerStats:
    """Counters since the scheduler was made."""

    steps: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed (after reuse)."""
    decode_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens reused from the cache at admission."""
    published_blocks: int = 0
    duplicate_blocks: int = 0
    """Blocks a request computed although another request had published them first."""
    evicted_blocks: int = 0
    orphans_evicted: int = 0
    """Blocks removed because an ancestor was evicted (unreachable by any lookup)."""
    admission_stalls: int = 0
    """Steps in which the head of the queue could not get pages (backpressure)."""
    finished: int = 0
    aborted: int = 0
    prefix_queries: int = 0
    """Requests looked up in the prefix cache (one lookup per admitted request)."""
    prefix_query_tokens: int = 0
    """Prompt tokens of those lookups; ``cached_tokens`` of them were hits. Together they are
    the engine's prefix-cache traffic (`PrefixCache.stats` counts only replayed requests)."""

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at admission (``cached_tokens``)."""
        return self.cached_tokens

    @property
    def prefix_hit_rate(self) -> float:
        """``prefix_hit_tokens / prefix_query_tokens`` (0.0 before any lookup)."""
        q = self.prefix_query_tokens
        return self.cached_tokens / q if q else 0.0

    def to_dict(self) -> dict[str, int]:
        """Every counter by name (e.g. for metrics exporters)."""
        return attrs.asdict(self)


@final
@attrs.frozen(kw_only=True)
class PageUsage:
    """Where the pool's pages are; ``free + cached + private == total`` always."""

    total: int
    free: int
    cached: int
    """Pages held by cached blocks (pinned or not)."""
    pinned: int
    """Cached blocks pinned by running requests (never evicted)."""
    private: int
    """Pages owned by running requests and not in the cache."""
