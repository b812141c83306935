"""The engine loop without the model: continuous batching over a paged KV pool.

The `Scheduler` owns ``num_pages`` page indices (``0 .. num_pages - 1``), shared between
blocks cached in a `PrefixCache` (each cached block holds one page) and running requests.
Per step it hands out a `StepPlan`: which requests prefill which token range on which pages
(reused pages first), which decode one token. The host runs the plan on a backend and
reports the `StepResult`; the scheduler then appends the sampled tokens, publishes newly
completed full blocks (incremental publication), tells the `FlightCoordinator` about
finished prefills and requests, admits released followers, and frees the pages of finished
requests.

Admission gives a request its whole page table at once (``ceil((prompt + max_new_tokens - 1)
/ block_size)`` pages: the cached pages of the longest resident prefix it may reuse, then
private pages), so a running request never waits for a page and admission is the only place
that can run out; then the request at the head of the queue waits (backpressure, first come
first served) and nothing else changes. Reuse is clamped to ``(prompt_tokens - 1) //
block_size`` blocks: the last prompt token is always computed (its logits start decoding)
and is never written into a shared page. Which pages, pins and chain-aware eviction are the
`PagePool`'s (``_pages.py``); this module decides when: admission and step planning.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from typing import final

import attrs

from .._errors import ConfigError, UsageError
from .._validate import (
    assert_never,
    check_instance,
    check_int,
    check_request_id,
    check_time,
    check_token_ids,
    instance_field,
    int_field,
    optional_int_field,
)
from ..cache._cache import PrefixCache
from ..cache._hashing import BlockHash, BlockHasher
from ..cache._policies import LRU
from ._coordinator import (
    Aborted,
    Arrived,
    Finished,
    FlightConfig,
    FlightCoordinator,
    FlightDecision,
    FlightKey,
    Independent,
    Lead,
    PrefillDone,
    Progress,
    Promote,
    Release,
    ReleasePolicy,
    Tick,
    Wait,
)
from ._pages import PagePool, pages_for
from ._plan import DecodeWork, PrefillWork, RequestId, StepPlan, StepResult

__all__ = [
    "FinishReason",
    "PageUsage",
    "PublishMode",
    "RequestReport",
    "RequestState",
    "Role",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepOutcome",
]


class PublishMode(enum.Enum):
    """When a request's computed full blocks become reusable by others."""

    PER_STEP = "per_step"
    """After every step, every newly completed full block (incremental publication)."""
    ON_COMPLETION = "on_completion"
    """When the request ends (the baseline). A flight leader still publishes its prompt
    blocks when its prefill completes: that is what releasing its followers means."""


class Role(enum.Enum):
    """A request's part in single-flight coordination, as its `RequestReport` tells it."""

    LEADER = "leader"
    """It computed a prompt that at least one other request waited for in its flight (a
    follower that arrived while it led, or one still waiting when it was promoted)."""
    FOLLOWER = "follower"
    """It waited in a flight for another request's prompt (then reused it, or was released
    by a timeout, or promoted: a promoted follower that nobody waited for stays a follower
    of the flight it joined)."""
    INDEPENDENT = "independent"
    """Nobody waited for it and it waited for nobody. This includes a request the
    coordinator made a flight leader (`Lead`) that no follower ever joined: `Lead` is the
    decision at arrival (a follower may still come), the role is what happened."""


class RequestState(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    """A follower waiting in a flight (holds no pages)."""
    QUEUED = "queued"
    """Waiting for admission (holds no pages)."""
    RUNNING = "running"
    """Admitted: holds its page table; prefilling or decoding."""


class FinishReason(enum.Enum):
    LENGTH = "length"
    """``max_new_tokens`` were sampled."""
    STOP = "stop"
    """A stop token was sampled (it is the last output token)."""
    ABORTED = "aborted"


@final
@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Pool and batching limits.

    ``max_batch_tokens``: tokens per step (prefill chunk tokens + one per decode); must be at
    least ``max_running`` so every running request can decode in every step.
    ``vocab_size``: if given, every prompt, stop and sampled token id must be below it
    (checked before anything changes); otherwise token ids are ints in ``[0, 2**63)``.
    """

    num_pages: int = attrs.field(validator=int_field(1))
    block_size: int = attrs.field(default=16, validator=int_field(1))
    max_batch_tokens: int = attrs.field(default=512, validator=int_field(1))
    max_running: int = attrs.field(default=64, validator=int_field(1))
    publish: PublishMode = attrs.field(
        default=PublishMode.PER_STEP, validator=instance_field(PublishMode)
    )
    vocab_size: int | None = attrs.field(default=None, validator=optional_int_field(1))

    def __attrs_post_init__(self) -> None:
        check_int("max_batch_tokens", self.max_batch_tokens, minimum=self.max_running)


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


@attrs.define(eq=False, slots=True)
class _Request:
    id: RequestId
    prompt: tuple[int, ...]
    namespace: bytes
    max_new: int
    stop: frozenset[int]
    arrived_at: float
    blocks: tuple[BlockHash, ...]  # full prompt blocks
    key: FlightKey
    hashes: list[BlockHash]  # prompt blocks, then decode blocks as they are hashed
    role: Role = Role.INDEPENDENT  # the coordinator's: LEADER after Lead or Promote
    followed: bool = False  # a follower waited in the flight this request led
    waited: bool = False  # it waited in a flight
    flight: int | None = None  # the flight it leads
    state: RequestState = RequestState.QUEUED
    flight_wait: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    first_token_step: int | None = None
    pages: tuple[int, ...] = ()
    private: set[int] = attrs.Factory(set)
    pinned: list[BlockHash] = attrs.Factory(list)  # a chain prefix of hashes, pinned
    cached: int = 0  # reused prompt tokens
    num_computed: int = 0  # positions whose KV is in the pages
    output: list[int] = attrs.Factory(list)

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= len(self.prompt)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` (prompt, then output)."""
        n = len(self.prompt)
        if end <= n:
            return list(self.prompt[start:end])
        if start >= n:
            return self.output[start - n : end - n]
        return [*self.prompt[start:], *self.output[: end - n]]


@attrs.define(eq=False, slots=True)
class _Counters:
    """The scheduler's share of `SchedulerStats` (same names; the pool counts the rest)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    admission_stalls: int = 0
    finished: int = 0
    aborted: int = 0
    prefix_queries: int = 0
    prefix_query_tokens: int = 0


@final
class Scheduler:
    """Continuous batching with chunked prefill, prefix reuse and single-flight coordination.

    ``cache`` must be empty and use ``config.block_size``; it defaults to an LRU cache with
    room for every page. ``coordinator`` defaults to one with `ReleasePolicy.INDEPENDENT`
    (no coordination). The scheduler is sans-I/O: time is the host's ``now`` value passed to
    every call, and it must never go backwards. A rejected call raises `UsageError` and
    leaves the state unchanged.
    """

    __slots__ = (
        "_aborting",
        "_cache",
        "_config",
        "_coordinator",
        "_flight_waiting",
        "_hashers",
        "_leaders",
        "_live",
        "_next_step",
        "_now",
        "_outstanding",
        "_pool",
        "_queue",
        "_running",
        "_stats",
    )

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        cache: PrefixCache | None = None,
        coordinator: FlightCoordinator | None = None,
    ) -> None:
        check_instance("config", config, SchedulerConfig)
        if cache is None:
            cache = PrefixCache(LRU(config.num_pages), config.block_size)
        elif cache.block_size != config.block_size:
            raise ConfigError(
                f"cache block_size {cache.block_size} != config block_size {config.block_size}"
            )
        elif len(cache):
            raise ConfigError(f"the cache must start empty, it holds {len(cache)} blocks")
        if coordinator is None:
            coordinator = FlightCoordinator(
                FlightConfig(policy=ReleasePolicy.INDEPENDENT, block_size=config.block_size)
            )
        elif coordinator.config.block_size != config.block_size:
            raise ConfigError(
                f"coordinator block_size {coordinator.config.block_size} != "
                f"config block_size {config.block_size}"
            )
        elif known := coordinator.placements():
            raise ConfigError(
                f"the coordinator must start empty, it knows {len(known)} requests "
                f"(e.g. {next(iter(known))!r})"
            )
        self._config = config
        self._cache = cache
        self._coordinator = coordinator
        self._pool = PagePool(config.num_pages, cache)
        self._leaders: dict[int, _Request] = {}  # flight id -> its leader, until the leader ends
        self._hashers: dict[bytes, BlockHasher] = {}
        self._queue: deque[_Request] = deque()
        self._flight_waiting: dict[RequestId, _Request] = {}
        self._running: dict[RequestId, _Request] = {}
        self._live: dict[RequestId, _Request] = {}  # waiting, queued or running
        self._aborting: dict[RequestId, _Request] = {}  # aborted while in the outstanding plan
        self._outstanding: StepPlan | None = None
        self._next_step = 0
        self._now = float("-inf")
        self._stats = _Counters()

    # -- views ---------------------------------------------------------------------------
    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def cache(self) -> PrefixCache:
        return self._cache

    @property
    def coordinator(self) -> FlightCoordinator:
        return self._coordinator

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            **attrs.asdict(self._stats, recurse=False),
            **attrs.asdict(self._pool.counters, recurse=False),
        )

    @property
    def now(self) -> float:
        return self._now

    @property
    def outstanding(self) -> StepPlan | None:
        """The plan handed out and not yet completed, if any."""
        return self._outstanding

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting, queued or running."""
        return bool(self._queue or self._flight_waiting or self._running or self._aborting)

    def state(self, request_id: RequestId) -> RequestState | None:
        """Where ``request_id`` is, or ``None`` if unknown or ended."""
        req = self._live.get(request_id)
        return None if req is None else req.state

    def requests(self) -> dict[RequestId, RequestState]:
        """A copy: every live request and where it is."""
        return {rid: req.state for rid, req in self._live.items()}

    def page_table(self, request_id: RequestId) -> tuple[int, ...]:
        """The page table of a running request."""
        req = self._running.get(request_id)
        if req is None:
            raise UsageError(f"request {request_id!r} is not running")
        return req.pages

    def page_usage(self) -> PageUsage:
        private = sum(len(r.private) for r in self._running.values()) + sum(
            len(r.private) for r in self._aborting.values()
        )
        return PageUsage(
            total=self._config.num_pages,
            free=self._pool.free_pages,
            cached=len(self._cache),
            pinned=self._pool.pinned_blocks,
            private=private,
        )

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: RequestId,
        prompt_token_ids: Sequence[int],
        *,
        max_new_tokens: int,
        now: float,
        namespace: str | bytes = b"",
        stop_token_ids: Iterable[int] = (),
    ) -> RequestState:
        """Accept a request; return where it went (queued, or waiting in a flight).

        ``namespace`` separates tenants (model, LoRA, cache salt): different namespaces never
        share blocks or flights.
        """
        check_request_id("request_id", request_id)
        if request_id in self._live or request_id in self._aborting:
            raise UsageError(f"duplicate request id {request_id!r}: it is already live")
        cfg = self._config
        vocab = cfg.vocab_size
        where = f"request {request_id!r}: "
        prompt = check_token_ids(
            where + "prompt_token_ids", prompt_token_ids, vocab_size=vocab, minimum=0
        )
        if not prompt:
            raise UsageError(f"request {request_id!r} has an empty prompt")
        check_int("max_new_tokens", max_new_tokens, minimum=1, error=UsageError)
        stop = frozenset(
            check_token_ids(where + "stop_token_ids", stop_token_ids, vocab_size=vocab, minimum=0)
        )
        now = self._check_now(now)
        bs = cfg.block_size
        need = pages_for(len(prompt), max_new_tokens, bs)
        if need > cfg.num_pages:
            raise UsageError(
                f"request {request_id!r} needs {need} pages "
                f"({len(prompt)} prompt + {max_new_tokens} new tokens) but the pool has "
                f"{cfg.num_pages}"
            )
        if not isinstance(namespace, (str, bytes)):
            raise UsageError(
                f"request {request_id!r}: namespace must be str or bytes, got {namespace!r}"
            )
        ns = namespace.encode("utf-8") if isinstance(namespace, str) else namespace
        hasher = self._hashers.get(ns)
        if hasher is None:
            hasher = self._hashers[ns] = BlockHasher(bs, namespace=ns)
        blocks = hasher.hash_tokens(prompt)
        key = FlightKey.of(prompt, ns)
        req = _Request(request_id, prompt, ns, max_new_tokens, stop, now, blocks, key, list(blocks))
        partial = self._coordinator.config.min_shared_blocks is not None
        decisions = self._coordinator.handle(
            Arrived(request_id=request_id, key=key, now=now, blocks=blocks if partial else ())
        )
        self._now = now
        self._live[request_id] = req
        for d in decisions:
            match d:
                case Lead() if d.request_id == request_id:
                    req.role = Role.LEADER
                    req.flight = d.flight
                    self._leaders[d.flight] = req
                    self._queue.append(req)
                case Independent() if d.request_id == request_id:
                    self._queue.append(req)
                case Wait() if d.request_id == request_id:
                    req.role = Role.FOLLOWER
                    req.waited = True
                    req.state = RequestState.WAITING
                    self._flight_waiting[request_id] = req
                    leader = self._leaders.get(d.flight)
                    if leader is not None:
                        leader.followed = True
                case _:
                    self._apply(d)
        return req.state

    def abort(self, request_id: RequestId, now: float) -> RequestReport:
        """End a live request now; return its report. Its pages are freed at once, or when
        the outstanding step completes if that step includes it."""
        req = self._live.get(request_id)
        if req is None:
            raise UsageError(f"unknown request id {request_id!r}")
        now = self._check_now(now)
        decisions = self._coordinator.handle(Aborted(request_id=request_id, now=now))
        self._now = now
        self._apply_all(decisions)  # first: a timeout may have released this very request
        del self._live[request_id]
        self._forget_flight(req)
        match req.state:
            case RequestState.WAITING:
                del self._flight_waiting[request_id]
            case RequestState.QUEUED:
                self._queue.remove(req)
            case RequestState.RUNNING:
                del self._running[request_id]
                if self._in_outstanding(request_id):
                    self._aborting[request_id] = req
                else:
                    self._end(req)
            case _:
                assert_never(req.state)
        self._stats.aborted += 1
        return self._report(req, FinishReason.ABORTED, None)

    # -- the step loop -------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """The next step's plan. An empty plan (nothing to run now) needs no
        `complete_step`; otherwise the plan is outstanding until its result is reported."""
        if self._outstanding is not None:
            raise UsageError(
                f"step {self._outstanding.step} is outstanding: report its result first"
            )
        now = self._check_now(now)
        self._apply_all(self._coordinator.handle(Tick(now=now)))
        self._now = now
        cfg = self._config
        budget = cfg.max_batch_tokens
        decodes: list[DecodeWork] = []
        prefills: list[PrefillWork] = []
        prefilling: list[_Request] = []
        for req in self._running.values():
            if req.prompt_done:
                decodes.append(
                    DecodeWork(
                        request_id=req.id,
                        token_id=req.output[-1],
                        position=req.num_computed,
                        pages=req.pages,
                    )
                )
            else:
                prefilling.append(req)
        budget -= len(decodes)
        for req in prefilling:
            if budget <= 0:
                break
            budget -= self._chunk(req, budget, prefills)
        queue = self._queue
        while queue and budget > 0 and len(self._running) < cfg.max_running:
            req = queue[0]
            if not self._admit(req, now):
                self._stats.admission_stalls += 1
                break
            queue.popleft()
            budget -= self._chunk(req, budget, prefills)
        plan = StepPlan(step=self._next_step, prefills=tuple(prefills), decodes=tuple(decodes))
        if not plan.is_empty:
            self._outstanding = plan
            self._next_step += 1
        return plan

    def complete_step(self, result: StepResult, now: float) -> StepOutcome:
        """Report the outstanding plan's result: append tokens, publish, release, finish."""
        plan = self._outstanding
        if plan is None:
            raise UsageError("no step is outstanding")
        if not isinstance(result, StepResult):
            raise UsageError(f"result must be a StepResult, got {result!r}")
        if result.step != plan.step:
            raise UsageError(f"result is for step {result.step!r}, outstanding is {plan.step}")
        sampled: dict[RequestId, int] = {}
        for pair in result.sampled:
            if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], (int, str)):
                raise UsageError(
                    f"step {plan.step}: sampled entries must be (request_id, token), got {pair!r}"
                )
            rid, tok = pair
            if rid in sampled:
                raise UsageError(f"step {plan.step}: request {rid!r} sampled twice")
            sampled[rid] = tok
        self._check_sampled(plan.step, result.sampled)
        expected = {p.request_id for p in plan.prefills if p.sample}
        expected.update(d.request_id for d in plan.decodes)
        if sampled.keys() != expected:
            missing = sorted(map(repr, expected - sampled.keys()))
            extra = sorted(map(repr, sampled.keys() - expected))
            raise UsageError(
                f"step {plan.step}: sampled ids do not match the plan "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        now = self._check_now(now)
        self._now = now
        self._outstanding = None
        stats = self._stats
        stats.steps += 1
        running = self._running
        coord = self._coordinator
        touched: list[_Request] = []
        prefill_done: list[_Request] = []
        tokens: list[tuple[RequestId, int]] = []
        for p in plan.prefills:
            req = running.get(p.request_id)
            if req is None:
                continue  # aborted during the step
            req.num_computed += len(p.token_ids)
            stats.prefill_tokens += len(p.token_ids)
            touched.append(req)
            if p.sample:
                tok = sampled[p.request_id]
                req.output.append(tok)
                req.first_token_at = now
                req.first_token_step = plan.step
                tokens.append((req.id, tok))
                prefill_done.append(req)
        for d in plan.decodes:
            req = running.get(d.request_id)
            if req is None:
                continue
            req.num_computed += 1
            stats.decode_tokens += 1
            tok = sampled[d.request_id]
            req.output.append(tok)
            tokens.append((req.id, tok))
            touched.append(req)
        done: list[tuple[_Request, FinishReason]] = []
        for req in touched:
            if req.output and req.prompt_done:
                if req.output[-1] in req.stop:
                    done.append((req, FinishReason.STOP))
                elif len(req.output) >= req.max_new:
                    done.append((req, FinishReason.LENGTH))
        finishing = {id(r) for r, _ in done}
        bs = self._config.block_size
        per_step = self._config.publish is PublishMode.PER_STEP
        partial = coord.config.min_shared_blocks is not None
        for req in touched:
            if per_step or id(req) in finishing:
                self._publish(req, req.num_computed // bs)
            elif req.role is Role.LEADER and req.prompt_done:
                self._publish(req, len(req.blocks))
            if partial and req.role is Role.LEADER and not req.prompt_done:
                self._apply_all(
                    coord.handle(
                        Progress(
                            request_id=req.id,
                            published_blocks=min(len(req.pinned), len(req.blocks)),
                            now=now,
                        )
                    )
                )
        for req in prefill_done:
            self._apply_all(coord.handle(PrefillDone(request_id=req.id, now=now)))
        reports: list[RequestReport] = []
        for req, reason in done:
            self._apply_all(coord.handle(Finished(request_id=req.id, now=now)))
            del running[req.id]
            del self._live[req.id]
            self._forget_flight(req)
            self._end(req)
            stats.finished += 1
            reports.append(self._report(req, reason, plan.step))
        for req in self._aborting.values():
            self._end(req)
        self._aborting.clear()
        return StepOutcome(step=plan.step, tokens=tuple(tokens), finished=tuple(reports))

    # -- internals: admission and pages ----------------------------------------------------
    def _chunk(self, req: _Request, budget: int, out: list[PrefillWork]) -> int:
        start = req.num_computed
        n = min(len(req.prompt) - start, budget)
        out.append(
            PrefillWork(
                request_id=req.id,
                token_ids=req.prompt[start : start + n],
                start=start,
                pages=req.pages,
                sample=start + n == len(req.prompt),
            )
        )
        return n

    def _admit(self, req: _Request, now: float) -> bool:
        """Give ``req`` its page table; False (and nothing changed) if the pool cannot."""
        bs = self._config.block_size
        n = len(req.prompt)
        got = self._pool.allocate(req.blocks, (n - 1) // bs, pages_for(n, req.max_new, bs))
        if got is None:
            return False
        pages, k = got
        req.pages = pages
        req.private = set(pages[k:])
        req.pinned = list(req.blocks[:k])
        req.cached = k * bs
        req.num_computed = k * bs
        req.admitted_at = now
        req.state = RequestState.RUNNING
        self._running[req.id] = req
        stats = self._stats
        stats.cached_tokens += k * bs
        stats.prefix_queries += 1
        stats.prefix_query_tokens += n
        return True

    def _publish(self, req: _Request, upto: int) -> None:
        """Publish ``req``'s blocks up to ``upto`` (exclusive), hashing new decode blocks
        first; the pool pins them and keeps what it can (see `PagePool.publish`)."""
        start = len(req.pinned)
        if upto <= start:
            return
        if upto > len(req.hashes):  # hash only the new blocks, continuing the chain
            bs = self._config.block_size
            hasher = self._hashers[req.namespace]
            have = len(req.hashes)
            req.hashes.extend(
                hasher.hash_tokens(
                    req.tokens(have * bs, upto * bs), parent=req.hashes[-1] if have else None
                )
            )
        kept = self._pool.publish(req.hashes, req.pages, start, upto, req.tokens)
        req.pinned.extend(req.hashes[start : start + len(kept)])
        private = req.private
        for page in kept:
            if page is not None:
                private.discard(page)

    def _end(self, req: _Request) -> None:
        """Unpin the request's blocks and free its private pages."""
        self._pool.release(req.pinned, req.private)
        req.private = set()
        req.pinned = []

    def _forget_flight(self, req: _Request) -> None:
        """``req`` ended: it leads no flight any more."""
        if req.flight is not None and self._leaders.get(req.flight) is req:
            del self._leaders[req.flight]

    # -- internals: coordinator decisions --------------------------------------------------
    def _apply_all(self, decisions: Iterable[FlightDecision]) -> None:
        for d in decisions:
            self._apply(d)

    def _apply(self, d: FlightDecision) -> None:
        match d:
            case Release():
                for rid in d.request_ids:
                    req = self._flight_waiting.pop(rid)
                    req.flight_wait = self._coordinator.now - req.arrived_at
                    req.state = RequestState.QUEUED
                    self._queue.append(req)
            case Promote():
                req = self._flight_waiting.pop(d.request_id)
                req.flight_wait = self._coordinator.now - req.arrived_at
                req.role = Role.LEADER
                req.flight = d.flight
                self._leaders[d.flight] = req
                _, waiting = self._coordinator.flights().get(d.flight, (None, ()))
                req.followed = bool(waiting)
                req.state = RequestState.QUEUED
                self._queue.appendleft(req)  # it has waited longest: it goes first
            case Lead() | Wait() | Independent():
                raise AssertionError(f"unexpected decision for another request: {d!r}")
            case _:
                assert_never(d)

    # -- internals: checks and reports -----------------------------------------------------
    def _in_outstanding(self, request_id: RequestId) -> bool:
        plan = self._outstanding
        if plan is None:
            return False
        return any(p.request_id == request_id for p in plan.prefills) or any(
            d.request_id == request_id for d in plan.decodes
        )

    def _check_now(self, now: object) -> float:
        return check_time("now", now, after=max(self._now, self._coordinator.now))

    def _check_sampled(self, step: int, sampled: tuple[tuple[RequestId, int], ...]) -> None:
        """Every sampled id is a token id (in the vocabulary, if known), before any change."""
        vocab = self._config.vocab_size
        try:
            check_token_ids("sampled", [tok for _, tok in sampled], vocab_size=vocab, minimum=0)
        except UsageError as exc:
            for rid, tok in sampled:  # name the request, not only the index
                try:
                    check_token_ids("sampled", (tok,), vocab_size=vocab, minimum=0)
                except UsageError:
                    raise UsageError(f"step {step}: request {rid!r}: {exc}") from None
            raise  # pragma: no cover  # one of them failed above

    @staticmethod
    def _role(req: _Request) -> Role:
        """What the request did (see `Role`), not only what the coordinator decided."""
        if req.followed:
            return Role.LEADER
        return Role.FOLLOWER if req.waited else Role.INDEPENDENT

    def _report(self, req: _Request, reason: FinishReason, step: int | None) -> RequestReport:
        computed = min(req.num_computed, len(req.prompt)) - req.cached
        return RequestReport(
            request_id=req.id,
            role=self._role(req),
            finish_reason=reason,
            prompt_tokens=len(req.prompt),
            cached_tokens=req.cached,
            computed_prompt_tokens=max(computed, 0),
            output_token_ids=tuple(req.output),
            arrived_at=req.arrived_at,
            flight_wait=req.flight_wait,
            admitted_at=req.admitted_at,
            first_token_at=req.first_token_at,
            first_token_step=req.first_token_step,
            finished_at=self._now,
            finished_step=step,
        )

    def check_invariants(self) -> None:
        """Raise `AssertionError` if pages, pins or requests are inconsistent."""
        cache = self._cache
        cache.check_invariants()
        self._coordinator.check_invariants()
        live = [*self._running.values(), *self._aborting.values()]
        self._pool.check_invariants((r.id, r.pinned, r.private) for r in live)
        bs = self._config.block_size
        for req in live:
            assert len(req.pages) == pages_for(len(req.prompt), req.max_new, bs)
            for j, h in enumerate(req.pinned):
                assert h == req.hashes[j], "pins are not a chain prefix"
                page = req.pages[j]
                assert page in req.private or cache.page(h) == page, "page table out of sync"
            assert set(req.pages[len(req.pinned) :]) <= req.private
        for flight, leader in self._leaders.items():
            assert leader.flight == flight and leader.id in self._live, "stale flight leader"
        assert len(self._running) <= self._config.max_running
        ids = [r.id for r in self._queue]
        assert len(set(ids)) == len(ids)
        groups = [set(ids), set(self._flight_waiting), set(self._running)]
        assert sum(map(len, groups)) == len(set().union(*groups)), "a request is in two places"
        assert set().union(*groups) == set(self._live), "live index out of sync"
        for rid, req in self._live.items():
            assert req.id == rid
        assert all(req.state is RequestState.QUEUED for req in self._queue)
        assert all(req.state is RequestState.WAITING for req in self._flight_waiting.values())
        assert all(req.state is RequestState.RUNNING for req in self._running.values())
