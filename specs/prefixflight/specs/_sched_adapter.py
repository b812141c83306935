"""The adapter protocol of `SchedulerConformance`: a continuous-batching scheduler under test,
and the views it returns. Needs only attrs (no Hypothesis): an adapter module imports this,
so it can be imported (and declare itself) without the ``specs`` extra.

The machine plays the model runner. Per step it asks the adapter for the step's rows (what
the scheduler tells the runner to compute, translated into `ScheduledRow`), writes and reads KV
itself on pages that hold token ids, samples a token for every row that ends its known
tokens, and hands those back (`SchedulerAdapter.complete`); the adapter returns what the
scheduler delivered to its clients (`Delivery`). `SchedulerPages` is where every page is, as
the scheduler's own allocator sees it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs

__all__ = ["Delivery", "ScheduledRow", "SchedulerAdapter", "SchedulerLimits", "SchedulerPages"]


@attrs.frozen(kw_only=True)
class SchedulerLimits:
    """What the machine draws for one example: the factory builds a scheduler with these.

    ``block_size`` tokens per page, ``pages`` pages in the KV pool (the adapter numbers them
    ``0 .. pages - 1``), at most ``max_running`` requests and ``max_batch_tokens`` tokens per
    step, admission order ``policy`` (``"fcfs"``, or ``"priority"``: a lower
    `SchedulerAdapter.add` ``priority`` goes first, as in vLLM).
    """

    block_size: int
    pages: int
    max_running: int
    max_batch_tokens: int
    policy: str = "fcfs"


@attrs.frozen(kw_only=True)
class ScheduledRow:
    """One request's work in one step, as the model runner sees it.

    Compute ``token_ids`` at positions ``start .. start + len(token_ids) - 1``, attending to
    positions ``[0, start)``, whose KV is in ``pages`` (the request's page table as the runner
    holds it: position ``p`` is in ``pages[p // block_size]``). ``sample``: the row reaches
    the end of the request's known tokens and samples the next one. ``reads_from`` (only for
    ``same_step_reads="declared"``): the requests whose rows come earlier in the step and
    write some of this row's context pages.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    pages: tuple[int, ...]
    sample: bool
    reads_from: tuple[str, ...] = ()

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@attrs.frozen(kw_only=True)
class Delivery:
    """What the scheduler handed its client for one request after a step: new output tokens,
    in order, and ``finished`` (``"stop"``: a stop token was sampled, it is the last output;
    ``"length"``: ``max_new_tokens`` were sampled) when the request ended with them."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: Literal["stop", "length"] | None = None


@attrs.frozen(kw_only=True)
class SchedulerPages:
    """Where every page is, as the scheduler's allocator sees it.

    ``free``: pages it can hand out without preempting anyone (empty, or caching a block no
    request holds: evictable); ``cached``: page -> the key of the block it caches (the
    tokens from the start of the sequence to the block's end), held or not; ``held``:
    request id -> the pages that request holds: its page table, in order, then any other
    page it keeps from eviction (a cached copy of a block it computed too, pinned); ``refs``
    (optional): page -> the allocator's reference count, checked against ``held``.
    """

    free: frozenset[int]
    cached: Mapping[int, tuple[int, ...]]
    held: Mapping[str, tuple[int, ...]]
    refs: Mapping[int, int] | None = None


@runtime_checkable
class SchedulerAdapter(Protocol):
    """A scheduler behind the calls `SchedulerConformance` makes.

    ``factory(limits)`` builds one over a fresh pool (raise `Unsupported` for limits it
    cannot take: the example is discarded). ``close`` is called when present.
    """

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        priority: int,
    ) -> None:
        """A new request (``priority`` matters only under ``policy="priority"``)."""
        ...

    def abort(self, request_id: str) -> None:
        """The client went away: end the request now (it may be in the outstanding step)."""
        ...

    def schedule(self) -> Sequence[ScheduledRow]:
        """Plan the next step; its rows, in the scheduler's order (empty: nothing to run)."""
        ...

    def complete(self, sampled: Mapping[str, int]) -> Sequence[Delivery]:
        """The outstanding step ran: ``sampled`` has the token of every row that samples.
        Returns what the scheduler delivered to its clients."""
        ...

    def pages(self) -> SchedulerPages:
        """Where every page is now."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is still queued, running or preempted."""
        ...
