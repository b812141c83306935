"""The engine loop without the model: continuous batching over a paged KV pool.

The `Scheduler` owns ``num_pages`` page indices (``0 .. num_pages - 1``), shared between
blocks cached in a `PrefixCache` (each cached block holds one page) and running requests.
Per step it hands out a `StepPlan`: which requests prefill which token range on which pages
(reused pages first), which decode one token. The host runs the plan on a backend and
reports the `StepResult`; the scheduler then appends the sampled tokens, publishes newly
completed full blocks (incremental publication), tells the `FlightCoordinator` about
finished prefills and requests, admits released followers, and frees the pages of finished
requests.

Page rules:

- At admission a request gets its whole page table at once: the cached pages of the
  longest resident prefix it may reuse, then private pages for every other position it will
  ever write (``ceil((prompt + max_new_tokens - 1) / block_size)`` pages in all), so a running
  request never waits for a page and admission is the only place that can run out.
- Reuse is clamped to ``(prompt_tokens - 1) // block_size`` blocks: the last prompt token is
  always computed (its logits start decoding) and is never written into a shared page.
- Every cached block a running request depends on is pinned, so it is never evicted; a
  request's private pages are never shared until it publishes them. When the block is
  already cached (another request published it first), the request keeps its own page
  private (no double registration) and frees it when it ends.
- Eviction is chain-aware: when a block leaves the cache, its cached descendants are
  unreachable (a lookup stops at the first miss), so they are removed too and their pages
  freed (counted as ``orphans_evicted``). Pins always cover a whole chain prefix, so an
  evicted block never has a pinned descendant.
- When no page can be freed the request at the head of the queue waits (backpressure,
  first come first served); nothing else changes.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from typing import final

import attrs

from .._errors import CapacityError, ConfigError, UsageError
from .._validate import assert_never, check_int
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
    """A request's part in single-flight coordination."""

    LEADER = "leader"
    FOLLOWER = "follower"
    INDEPENDENT = "independent"


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


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Pool and batching limits.

    ``max_batch_tokens``: tokens per step (prefill chunk tokens + one per decode); must be at
    least ``max_running`` so every running request can decode in every step.
    """

    num_pages: int
    block_size: int = 16
    max_batch_tokens: int = 512
    max_running: int = 64
    publish: PublishMode = PublishMode.PER_STEP

    def __attrs_post_init__(self) -> None:
        check_int("num_pages", self.num_pages, minimum=1)
        check_int("block_size", self.block_size, minimum=1)
        check_int("max_running", self.max_running, minimum=1)
        check_int("max_batch_tokens", self.max_batch_tokens, minimum=self.max_running)
        if not isinstance(self.publish, PublishMode):
            raise ConfigError(f"publish must be a PublishMode, got {self.publish!r}")


@attrs.frozen(kw_only=True)
class RequestReport:
    """Per-request metrics, returned when a request finishes or is aborted.

    Times are the host's ``now`` values (simulated or wall seconds); steps are plan numbers.
    ``cached_tokens`` were reused from the cache; ``computed_prompt_tokens`` were computed
    by this request (they add up to ``prompt_tokens`` once the prefill is done).
    """

    request_id: RequestId
    role: Role
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


@attrs.frozen(kw_only=True)
class StepOutcome:
    """What `Scheduler.complete_step` did: the tokens it appended and the requests that ended."""

    step: int
    tokens: tuple[tuple[RequestId, int], ...]
    finished: tuple[RequestReport, ...]


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


@final
class _Request:
    __slots__ = (
        "admitted_at",
        "arrived_at",
        "blocks",
        "cached",
        "first_token_at",
        "first_token_step",
        "flight_wait",
        "hashes",
        "id",
        "key",
        "max_new",
        "namespace",
        "num_computed",
        "output",
        "pages",
        "pinned",
        "private",
        "prompt",
        "role",
        "state",
        "stop",
    )

    def __init__(
        self,
        request_id: RequestId,
        prompt: tuple[int, ...],
        namespace: bytes,
        max_new: int,
        stop: frozenset[int],
        now: float,
        blocks: tuple[BlockHash, ...],
        key: FlightKey,
    ) -> None:
        self.id = request_id
        self.prompt = prompt
        self.namespace = namespace
        self.max_new = max_new
        self.stop = stop
        self.arrived_at = now
        self.blocks = blocks  # full prompt blocks
        self.key = key
        self.hashes: list[BlockHash] = list(blocks)  # prompt blocks, then decode blocks
        self.role = Role.INDEPENDENT
        self.state = RequestState.QUEUED
        self.flight_wait = 0.0
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.first_token_step: int | None = None
        self.pages: tuple[int, ...] = ()
        self.private: set[int] = set()
        self.pinned: list[BlockHash] = []  # a chain prefix of hashes, pinned in the cache
        self.cached = 0  # reused prompt tokens
        self.num_computed = 0  # positions whose KV is in the pages
        self.output: list[int] = []

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


def _pages_for(num_prompt: int, max_new: int, block_size: int) -> int:
    positions = num_prompt + max_new - 1  # the last sampled token is never computed
    return -(-positions // block_size)


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
        "_children",
        "_config",
        "_coordinator",
        "_flight_waiting",
        "_free",
        "_hashers",
        "_live",
        "_next_step",
        "_now",
        "_outstanding",
        "_parent",
        "_pins",
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
        if not isinstance(config, SchedulerConfig):
            raise ConfigError(f"config must be a SchedulerConfig, got {config!r}")
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
        self._free: list[int] = list(range(config.num_pages - 1, -1, -1))
        self._pins: dict[BlockHash, int] = {}  # mirror of the pins this scheduler holds
        self._parent: dict[BlockHash, BlockHash | None] = {}  # cached block -> parent
        self._children: dict[BlockHash, set[BlockHash]] = {}
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
        return self._stats.freeze()

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
            free=len(self._free),
            cached=len(self._cache),
            pinned=len(self._pins),
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
        if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
            raise UsageError(f"request_id must be an int or a str, got {request_id!r}")
        if request_id in self._live or request_id in self._aborting:
            raise UsageError(f"duplicate request id {request_id!r}: it is already live")
        prompt = tuple(prompt_token_ids)
        if not prompt:
            raise UsageError(f"request {request_id!r} has an empty prompt")
        if set(map(type, prompt)) != {int} or min(prompt) < 0:
            bad = next(t for t in prompt if type(t) is not int or t < 0)
            raise UsageError(f"request {request_id!r}: token ids must be ints >= 0, got {bad!r}")
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        stop = frozenset(stop_token_ids)
        if any(type(t) is not int for t in stop):
            raise UsageError(f"request {request_id!r}: stop token ids must be ints, got {stop!r}")
        self._check_now(now)
        bs = self._config.block_size
        need = _pages_for(len(prompt), max_new_tokens, bs)
        if need > self._config.num_pages:
            raise UsageError(
                f"request {request_id!r} needs {need} pages "
                f"({len(prompt)} prompt + {max_new_tokens} new tokens) but the pool has "
                f"{self._config.num_pages}"
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
        req = _Request(request_id, prompt, ns, max_new_tokens, stop, float(now), blocks, key)
        partial = self._coordinator.config.min_shared_blocks is not None
        decisions = self._coordinator.handle(
            Arrived(request_id=request_id, key=key, now=now, blocks=blocks if partial else ())
        )
        self._now = float(now)
        self._live[request_id] = req
        for d in decisions:
            match d:
                case Lead() if d.request_id == request_id:
                    req.role = Role.LEADER
                    self._queue.append(req)
                case Independent() if d.request_id == request_id:
                    self._queue.append(req)
                case Wait() if d.request_id == request_id:
                    req.role = Role.FOLLOWER
                    req.state = RequestState.WAITING
                    self._flight_waiting[request_id] = req
                case _:
                    self._apply(d)
        return req.state

    def abort(self, request_id: RequestId, now: float) -> RequestReport:
        """End a live request now; return its report. Its pages are freed at once, or when
        the outstanding step completes if that step includes it."""
        req = self._live.get(request_id)
        if req is None:
            raise UsageError(f"unknown request id {request_id!r}")
        self._check_now(now)
        decisions = self._coordinator.handle(Aborted(request_id=request_id, now=now))
        self._now = float(now)
        self._apply_all(decisions)  # first: a timeout may have released this very request
        del self._live[request_id]
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
        self._check_now(now)
        self._apply_all(self._coordinator.handle(Tick(now=now)))
        self._now = float(now)
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
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise UsageError(f"step {plan.step}: request {rid!r} sampled {tok!r}")
            sampled[rid] = tok
        expected = {p.request_id for p in plan.prefills if p.sample}
        expected.update(d.request_id for d in plan.decodes)
        if sampled.keys() != expected:
            missing = sorted(map(repr, expected - sampled.keys()))
            extra = sorted(map(repr, sampled.keys() - expected))
            raise UsageError(
                f"step {plan.step}: sampled ids do not match the plan "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        self._check_now(now)
        self._now = float(now)
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
                req.first_token_at = float(now)
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
        """Give ``req`` its page table, evicting unpinned cached blocks if needed; False
        (and nothing changed) if not enough pages can be freed."""
        cache = self._cache
        bs = self._config.block_size
        n = len(req.prompt)
        k = min(cache.lookup(req.blocks), (n - 1) // bs)
        hit = req.blocks[:k]
        need = _pages_for(n, req.max_new, bs) - k
        self._pin(hit)
        evictable = len(cache) - len(self._pins)
        if len(self._free) + evictable < need:
            self._unpin(hit)
            return False
        while len(self._free) < need:
            victim = cache.evict()
            assert victim is not None, "an unpinned block must be evictable"
            self._reclaim((victim,))
        # a reuse refreshes the blocks' recency, deepest first (all resident: no eviction)
        cache.publish(hit[::-1])
        own = [self._free.pop() for _ in range(need)]
        cached_pages = []
        for h in hit:
            page = cache.page(h)
            assert page is not None
            cached_pages.append(page)
        req.pages = (*cached_pages, *own)
        req.private = set(own)
        req.pinned = list(hit)
        req.cached = k * bs
        req.num_computed = k * bs
        req.admitted_at = float(now)
        req.state = RequestState.RUNNING
        self._running[req.id] = req
        self._stats.cached_tokens += k * bs
        return True

    def _publish(self, req: _Request, upto: int) -> None:
        """Publish ``req``'s blocks up to ``upto`` (exclusive) and pin them.

        Deepest first, so that a parent is always accessed after its children: recency-based
        policies then evict a chain from its tail, never a parent before its descendants.
        If a block cannot be admitted (every victim pinned, or a policy that keeps nothing),
        the deeper blocks of this call are taken back out (they would be unreachable) and
        the shallower ones are tried again.
        """
        start = len(req.pinned)
        if upto <= start:
            return
        cache = self._cache
        bs = self._config.block_size
        if upto > len(req.hashes):  # hash only the new blocks, continuing the chain
            hasher = self._hashers[req.namespace]
            have = len(req.hashes)
            req.hashes.extend(
                hasher.hash_tokens(
                    req.tokens(have * bs, upto * bs), parent=req.hashes[-1] if have else None
                )
            )
        stats = self._stats
        done: list[tuple[BlockHash, int | None]] = []  # (block, own page or None if duplicate)
        for j in range(upto - 1, start - 1, -1):
            h = req.hashes[j]
            if h in cache:  # another request published it first: keep our page private
                cache.publish((h,))
                self._pin((h,))
                done.append((h, None))
                continue
            page = req.pages[j]
            parent = req.hashes[j - 1] if j else None
            try:
                evicted = cache.publish(
                    (h,), (page,), parent=parent, token_ids=req.tokens(j * bs, (j + 1) * bs)
                )
            except CapacityError:
                admitted = False
            else:
                self._reclaim(evicted)
                admitted = cache.page(h) == page
            if not admitted:
                self._take_back(req, done)
                self._publish(req, j)
                return
            self._pin((h,))
            done.append((h, page))
            self._parent[h] = parent
            if parent is not None:
                self._children.setdefault(parent, set()).add(h)
        for h, own in reversed(done):
            req.pinned.append(h)
            if own is None:
                stats.duplicate_blocks += 1
            else:
                req.private.discard(own)
                stats.published_blocks += 1

    def _take_back(self, req: _Request, done: list[tuple[BlockHash, int | None]]) -> None:
        """Undo a partial deepest-first publication: the blocks go back to the request."""
        cache = self._cache
        for h, page in done:
            # never a duplicate: a cached block's parent is cached too, so the block that
            # failed (not cached) has no cached descendant
            assert page is not None
            self._unpin((h,))
            assert h not in self._pins and not self._children.get(h)
            removed = cache.remove(h)
            assert removed == page
            parent = self._parent.pop(h, None)
            if parent is not None:
                siblings = self._children[parent]
                siblings.discard(h)
                if not siblings:
                    del self._children[parent]

    def _reclaim(self, evicted: Iterable[tuple[BlockHash, int | None]]) -> None:
        """Free the pages of evicted blocks and remove their (now unreachable) descendants."""
        cache = self._cache
        free = self._free
        stats = self._stats
        for block, page in evicted:
            assert page is not None, "every cached block holds a page"
            stats.evicted_blocks += 1
            free.append(page)
            parent = self._parent.pop(block, None)
            if parent is not None:
                siblings = self._children[parent]
                siblings.discard(block)
                if not siblings:
                    del self._children[parent]
            stack = list(self._children.pop(block, ()))
            while stack:
                child = stack.pop()
                del self._parent[child]
                stack.extend(self._children.pop(child, ()))
                if child not in cache:
                    continue  # evicted by the policy in this same batch: freed in its turn
                assert child not in self._pins, "a pinned block lost its parent"
                orphan_page = cache.remove(child)
                assert orphan_page is not None
                free.append(orphan_page)
                stats.orphans_evicted += 1

    def _pin(self, blocks: Sequence[BlockHash]) -> None:
        self._cache.pin(blocks)
        pins = self._pins
        for b in blocks:
            pins[b] = pins.get(b, 0) + 1

    def _unpin(self, blocks: Sequence[BlockHash]) -> None:
        self._cache.unpin(blocks)
        pins = self._pins
        for b in blocks:
            c = pins[b]
            if c == 1:
                del pins[b]
            else:
                pins[b] = c - 1

    def _end(self, req: _Request) -> None:
        """Unpin the request's blocks and free its private pages."""
        self._unpin(req.pinned)
        self._free.extend(sorted(req.private, reverse=True))
        req.private = set()
        req.pinned = []

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

    def _check_now(self, now: float) -> None:
        if isinstance(now, bool) or not isinstance(now, (int, float)) or now != now:
            raise UsageError(f"now must be a real number, got {now!r}")
        if now < self._now or now < self._coordinator.now:
            raise UsageError(f"time went backwards: now={now!r} < {self._now!r}")

    def _report(self, req: _Request, reason: FinishReason, step: int | None) -> RequestReport:
        computed = min(req.num_computed, len(req.prompt)) - req.cached
        return RequestReport(
            request_id=req.id,
            role=req.role,
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
        policy = cache.policy
        resident = policy.resident()
        cached_pages: dict[int, BlockHash] = {}
        for b in resident:
            page = cache.page(b)
            assert page is not None, f"cached block {b!r} has no page"
            assert page not in cached_pages, f"page {page} is held by two blocks"
            cached_pages[page] = b
        owners: dict[int, RequestId] = {}
        live = [*self._running.values(), *self._aborting.values()]
        for req in live:
            for page in req.private:
                assert page not in owners, f"page {page} is private to two requests"
                assert page not in cached_pages, f"private page {page} is also cached"
                owners[page] = req.id
        free = self._free
        assert len(set(free)) == len(free), "a page is free twice"
        assert not set(free) & (owners.keys() | cached_pages.keys()), "a used page is free"
        total = len(free) + len(owners) + len(cached_pages)
        assert total == self._config.num_pages, f"pages do not add up: {total}"
        pins: dict[BlockHash, int] = {}
        for req in live:
            n = len(req.prompt)
            bs = self._config.block_size
            assert len(req.pages) == _pages_for(n, req.max_new, bs)
            for j, h in enumerate(req.pinned):
                pins[h] = pins.get(h, 0) + 1
                assert h in resident, f"block {h!r} pinned by {req.id!r} was evicted"
                page = req.pages[j]
                assert page in req.private or cache.page(h) == page, "page table out of sync"
            assert set(req.pages[len(req.pinned) :]) <= req.private
        assert pins == self._pins, "pin mirror out of sync"
        for b, n_pins in pins.items():
            assert policy.pin_count(b) == n_pins, f"block {b!r} pin count differs"
        for b, parent in self._parent.items():
            assert b in resident, f"stale parent link for {b!r}"
            assert parent is None or parent in resident, f"orphan {b!r} left in the cache"
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


@final
class _Counters:
    __slots__ = (
        "aborted",
        "admission_stalls",
        "cached_tokens",
        "decode_tokens",
        "duplicate_blocks",
        "evicted_blocks",
        "finished",
        "orphans_evicted",
        "prefill_tokens",
        "published_blocks",
        "steps",
    )

    def __init__(self) -> None:
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.cached_tokens = 0
        self.published_blocks = 0
        self.duplicate_blocks = 0
        self.evicted_blocks = 0
        self.orphans_evicted = 0
        self.admission_stalls = 0
        self.finished = 0
        self.aborted = 0

    def freeze(self) -> SchedulerStats:
        return SchedulerStats(
            steps=self.steps,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            cached_tokens=self.cached_tokens,
            published_blocks=self.published_blocks,
            duplicate_blocks=self.duplicate_blocks,
            evicted_blocks=self.evicted_blocks,
            orphans_evicted=self.orphans_evicted,
            admission_stalls=self.admission_stalls,
            finished=self.finished,
            aborted=self.aborted,
        )
