"""The engine loop without the model: continuous batching over a paged KV pool.

The `Scheduler` owns ``num_pages`` page indices (``0 .. num_pages - 1``), shared between
blocks cached in a `PrefixCache` (each cached block holds one page) and running requests.
Per step it hands out a `StepPlan`: which requests prefill which token range on which pages
(reused pages first), which decode one token. The host runs the plan on a backend and
reports the `StepResult`; the scheduler then appends the sampled tokens, publishes newly
completed full blocks (incremental publication), tells the `FlightCoordinator` about
finished requests, admits released followers, and frees the pages of finished requests.

Same-step sharing (``SchedulerConfig.same_step_sharing``, on by default): the full blocks a
prefill chunk completes are registered in the cache when the chunk is planned, as vLLM
registers a block when it allocates it, and the coordinator hears of the prefill's progress
then. A request admitted later in the same step, or a follower released by that progress,
reuses those blocks while the step writes them: its `PrefillWork.reads_from` names the
writers, and the backend writes their KV before it attends. So requests that arrive together
never compute a shared prefix twice, and a flight's followers start in the step that
finishes their leader's prompt. A step that fails (`Scheduler.fail_step`) takes its
registered blocks back out of the cache.

Admission gives a request its whole page table at once (``ceil((prompt + max_new_tokens - 1)
/ block_size)`` pages: the cached pages of the longest resident prefix it may reuse, then
private pages), so a running request never waits for a page and admission is the only place
that can run out; then the request at the head of the queue waits (backpressure, first come
first served) and nothing else changes. Reuse is clamped to ``(prompt_tokens - 1) //
block_size`` blocks: the last prompt token is always computed (its logits start decoding)
and is never written into a shared page. Which pages, pins and chain-aware eviction are the
`PagePool`'s (``_pages.py``); this module decides when: admission and step planning.

Every request's state is one explicit `RequestState`; which calls each state accepts, and
where they lead, is one literal table, `TRANSITIONS` (and `STEP_TRANSITIONS` for the step
in flight), checked before any call changes anything. The states and tables are in
``_sched_states.py``, the report rows in ``_sched_reports.py``; this module is the class.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, final

import attrs

from .._errors import ConfigError, UsageError
from ..cache._cache import EventSink, PrefixCache
from ..cache._hashing import BlockHash, BlockHasher
from ..cache._policies import LRU, EvictionPolicy
from ..validate import (
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
from ._sched_reports import PageUsage, RequestReport, SchedulerStats, StepOutcome
from ._sched_states import (
    _ABORT,
    _ABORTING,
    _ADD,
    _COMPLETE,
    _FAIL,
    _IDLE,
    _OUTSTANDING,
    _QUEUED,
    _RUNNING,
    _SCHEDULE,
    _WAITING,
    STEP_TRANSITIONS,
    TRANSITIONS,
    FinishReason,
    PublishMode,
    RequestState,
    Role,
    SchedulerCall,
    StepPhase,
)

__all__ = ["Scheduler", "SchedulerConfig"]


@final
@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Pool and batching limits.

    ``max_batch_tokens``: tokens per step (prefill chunk tokens + one per decode); must be at
    least ``max_running`` so every running request can decode in every step.
    ``vocab_size``: if given, every prompt, stop and sampled token id must be below it
    (checked before anything changes); otherwise token ids are ints in ``[0, 2**63)``.
    ``same_step_sharing``: register the blocks a prefill chunk completes when the chunk is
    planned, so a request admitted later in the same step reads them as they are written
    (`PrefillWork.reads_from`; the backend writes them first). ``False`` registers them
    after the step: for a backend that cannot order its rows (every plan then has empty
    ``reads_from``).
    """

    num_pages: int = attrs.field(validator=int_field(1))
    block_size: int = attrs.field(default=16, validator=int_field(1))
    max_batch_tokens: int = attrs.field(default=512, validator=int_field(1))
    max_running: int = attrs.field(default=64, validator=int_field(1))
    publish: PublishMode = attrs.field(
        default=PublishMode.PER_STEP, validator=instance_field(PublishMode)
    )
    vocab_size: int | None = attrs.field(default=None, validator=optional_int_field(1))
    same_step_sharing: bool = attrs.field(default=True, validator=instance_field(bool))

    def __attrs_post_init__(self) -> None:
        check_int("max_batch_tokens", self.max_batch_tokens, minimum=self.max_running)


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


@attrs.define(eq=False, slots=True)
class _Draft:
    """The plan `Scheduler.schedule` is building."""

    budget: int
    prefills: list[PrefillWork] = attrs.Factory(list)
    decodes: list[DecodeWork] = attrs.Factory(list)
    written: dict[BlockHash, RequestId] = attrs.Factory(dict)
    """Blocks registered by this plan whose pages it writes -> the request writing them."""


@final
class Scheduler:
    """Continuous batching with chunked prefill, prefix reuse and single-flight coordination.

    `Scheduler.build` makes one with its own cache and coordinator, both on
    ``config.block_size``. The constructor takes parts made elsewhere: ``cache`` must be empty
    and use ``config.block_size``; it defaults to an LRU cache with room for every page.
    ``coordinator`` must know no request and use ``config.block_size``; it defaults to one
    with `ReleasePolicy.INDEPENDENT` (no coordination). The scheduler is sans-I/O: time is the
    host's ``now`` value passed to every call, and it must never go backwards. A rejected
    call (see `TRANSITIONS` and `STEP_TRANSITIONS`) raises `UsageError` and leaves the state
    unchanged.
    """

    TRANSITIONS: ClassVar[
        Mapping[RequestState | None, Mapping[SchedulerCall, frozenset[RequestState | None]]]
    ] = TRANSITIONS
    STEP_TRANSITIONS: ClassVar[Mapping[StepPhase, Mapping[SchedulerCall, frozenset[StepPhase]]]] = (
        STEP_TRANSITIONS
    )

    __slots__ = (
        "_aborting",
        "_cache",
        "_config",
        "_coordinator",
        "_flight_waiting",
        "_hashers",
        "_leaders",
        "_next_step",
        "_now",
        "_outstanding",
        "_planned",
        "_pool",
        "_queue",
        "_registered",
        "_requests",
        "_running",
        "_stats",
    )

    @classmethod
    def build(
        cls,
        config: SchedulerConfig,
        *,
        eviction: EvictionPolicy | None = None,
        release: ReleasePolicy = ReleasePolicy.INDEPENDENT,
        max_wait: float | None = None,
        min_shared_blocks: int | None = None,
        event_sink: EventSink | None = None,
    ) -> Scheduler:
        """A scheduler with a fresh cache and coordinator, both on ``config.block_size``.

        ``eviction``: the cache's policy (default: LRU with room for every page);
        ``event_sink`` receives the cache's KV events. ``release``, ``max_wait`` and
        ``min_shared_blocks`` are the coordinator's `FlightConfig`.
        """
        check_instance("config", config, SchedulerConfig)
        policy = LRU(config.num_pages) if eviction is None else eviction
        return cls(
            config,
            cache=PrefixCache(policy, config.block_size, event_sink=event_sink),
            coordinator=FlightCoordinator(
                FlightConfig(
                    policy=release,
                    max_wait=max_wait,
                    min_shared_blocks=min_shared_blocks,
                    block_size=config.block_size,
                )
            ),
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
        # every request the scheduler holds, by id, and its place (one per state)
        self._requests: dict[RequestId, _Request] = {}
        self._flight_waiting: dict[RequestId, _Request] = {}  # WAITING
        self._queue: deque[_Request] = deque()  # QUEUED, in admission order
        self._running: dict[RequestId, _Request] = {}  # RUNNING
        self._aborting: dict[RequestId, _Request] = {}  # ABORTING
        self._outstanding: StepPlan | None = None
        self._planned: frozenset[RequestId] = frozenset()  # the outstanding plan's requests
        self._registered: tuple[BlockHash, ...] = ()  # blocks the outstanding plan writes
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
    def phase(self) -> StepPhase:
        """Whether a plan is outstanding (see `STEP_TRANSITIONS`)."""
        return _IDLE if self._outstanding is None else _OUTSTANDING

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting, queued, running or aborting."""
        return bool(self._requests)

    def state(self, request_id: RequestId) -> RequestState | None:
        """Where ``request_id`` is, or ``None`` if unknown or ended."""
        req = self._requests.get(request_id)
        return None if req is None else req.state

    def requests(self) -> dict[RequestId, RequestState]:
        """A copy: every request the scheduler holds and its state (an aborted one stays,
        ``ABORTING``, until the step that includes it completes)."""
        return {rid: req.state for rid, req in self._requests.items()}

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
        self._check_call(_ADD, request_id)
        req = self._new_request(
            request_id, prompt_token_ids, max_new_tokens, namespace, stop_token_ids, now
        )
        self._arrive(req)
        return req.state

    def abort(self, request_id: RequestId, now: float) -> RequestReport:
        """End a live request now; return its report. Its pages are freed at once, or, if
        the outstanding step includes it, when that step completes (it is ``ABORTING``
        until then)."""
        req = self._check_call(_ABORT, request_id)
        assert req is not None
        now = self._check_now(now)
        decisions = self._coordinator.handle(Aborted(request_id=request_id, now=now))
        self._now = now
        self._apply_all(decisions)  # first: a timeout may have released this very request
        return self._drop(req)

    # -- the step loop -------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """The next step's plan. An empty plan (nothing to run now) needs no
        `complete_step`; otherwise the plan is outstanding until its result is reported."""
        self._check_call(_SCHEDULE)
        now = self._check_now(now)
        self._apply_all(self._coordinator.handle(Tick(now=now)))
        self._now = now
        draft = _Draft(budget=self._config.max_batch_tokens)
        prefilling = self._plan_decodes(draft)
        for req in prefilling:
            if draft.budget <= 0:
                break
            self._plan_chunk(req, draft, now)
        self._admit_queued(draft, now)
        plan = StepPlan(
            step=self._next_step, prefills=tuple(draft.prefills), decodes=tuple(draft.decodes)
        )
        if not plan.is_empty:
            self._outstanding = plan
            self._planned = frozenset(
                [*(p.request_id for p in plan.prefills), *(d.request_id for d in plan.decodes)]
            )
            self._registered = tuple(draft.written)
            self._next_step += 1
        return plan

    def complete_step(self, result: StepResult, now: float) -> StepOutcome:
        """Report the outstanding plan's result: append tokens, publish, release, finish."""
        self._check_call(_COMPLETE)
        plan = self._outstanding
        assert plan is not None
        check_instance("result", result, StepResult, error=UsageError)
        sampled = result.tokens_for(plan, vocab_size=self._config.vocab_size)
        now = self._check_now(now)
        # everything is checked: from here on the step is applied
        self._now = now
        self._outstanding = None
        self._stats.steps += 1
        touched, prefilled, tokens = self._advance(plan, sampled, now)
        done = self._ending(touched)
        self._publish_computed(touched, done)
        if not self._config.same_step_sharing:
            self._report_progress(touched, prefilled, now)
        reports = [self._finish(req, reason, plan.step, now) for req, reason in done]
        self._close_step()
        return StepOutcome(step=plan.step, tokens=tuple(tokens), finished=tuple(reports))

    def fail_step(self, now: float) -> tuple[RequestReport, ...]:
        """The outstanding step failed: its result will never come (e.g. the backend
        raised). Every request of the plan that is still running is aborted (their reports
        are returned, in plan order); the blocks the plan registered for same-step sharing
        leave the cache, as their KV may never have been written; the plan's pages come
        back. Requests outside the plan are untouched and scheduling can go on."""
        self._check_call(_FAIL)
        plan = self._outstanding
        assert plan is not None
        now = self._check_now(now)
        self._now = now
        reports = []
        for rid in [*(p.request_id for p in plan.prefills), *(d.request_id for d in plan.decodes)]:
            req = self._running.get(rid)
            if req is not None:  # not aborted already
                self._apply_all(self._coordinator.handle(Aborted(request_id=rid, now=now)))
                reports.append(self._drop(req))
        self._outstanding = None
        self._close_step(failed=True)
        return tuple(reports)

    # -- internals: calls and states -------------------------------------------------------
    def _check_call(
        self, call: SchedulerCall, request_id: RequestId | None = None
    ) -> _Request | None:
        """Reject ``call`` unless the step phase (and the named request's state) allows it;
        return the named request, if it is known."""
        phase = self.phase
        if call not in STEP_TRANSITIONS[phase]:
            plan = self._outstanding
            if plan is not None:
                raise UsageError(f"step {plan.step} is outstanding: report its result first")
            raise UsageError(f"no step is outstanding: {call.value} needs one")
        if request_id is None:
            return None
        req = self._requests.get(request_id)
        state = None if req is None else req.state
        if call not in TRANSITIONS[state]:
            if state is None:
                raise UsageError(f"unknown request id {request_id!r}: it cannot {call.value}")
            if call is _ADD:
                raise UsageError(
                    f"duplicate request id {request_id!r}: it is already {state.value}"
                )
            raise UsageError(f"request {request_id!r} is {state.value}: it cannot {call.value}")
        return req

    def _new_request(
        self,
        request_id: RequestId,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        namespace: str | bytes,
        stop_token_ids: Iterable[int],
        now: float,
    ) -> _Request:
        """Check a new request's inputs and build it; nothing changes here."""
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
        checked_now = self._check_now(now)
        bs = cfg.block_size
        need = pages_for(len(prompt), max_new_tokens, bs)
        if need > cfg.num_pages:
            raise UsageError(
                f"request {request_id!r} needs {need} pages "
                f"({len(prompt)} prompt + {max_new_tokens} new tokens) but the pool has "
                f"{cfg.num_pages}"
            )
        try:
            key = FlightKey.of(prompt, namespace)  # the one check of a namespace
        except UsageError as exc:
            raise UsageError(where + str(exc)) from None
        ns = key.namespace
        hasher = self._hashers.get(ns)
        if hasher is None:
            hasher = self._hashers[ns] = BlockHasher(bs, namespace=ns)
        blocks = hasher.hash_tokens(prompt)
        return _Request(
            request_id, prompt, ns, max_new_tokens, stop, checked_now, blocks, key, list(blocks)
        )

    def _arrive(self, req: _Request) -> None:
        """Tell the coordinator; the request leads, follows or runs on its own."""
        partial = self._coordinator.config.min_shared_blocks is not None
        decisions = self._coordinator.handle(
            Arrived(
                request_id=req.id,
                key=req.key,
                now=req.arrived_at,
                blocks=req.blocks if partial else (),
            )
        )
        self._now = req.arrived_at
        self._requests[req.id] = req
        for d in decisions:
            match d:
                case Lead() if d.request_id == req.id:
                    req.role = Role.LEADER
                    req.flight = d.flight
                    self._leaders[d.flight] = req
                    self._queue.append(req)
                case Independent() if d.request_id == req.id:
                    self._queue.append(req)
                case Wait() if d.request_id == req.id:
                    req.role = Role.FOLLOWER
                    req.waited = True
                    req.state = _WAITING
                    self._flight_waiting[req.id] = req
                    leader = self._leaders.get(d.flight)
                    if leader is not None:
                        leader.followed = True
                case _:
                    self._apply(d)

    def _drop(self, req: _Request) -> RequestReport:
        """Abort ``req`` (the coordinator knows already): out of its place; its pages are
        freed now, or when the outstanding step that includes it ends (``ABORTING``)."""
        rid = req.id
        match req.state:
            case RequestState.WAITING:
                del self._flight_waiting[rid]
                del self._requests[rid]
            case RequestState.QUEUED:
                self._queue.remove(req)
                del self._requests[rid]
            case RequestState.RUNNING:
                del self._running[rid]
                if rid in self._planned:
                    req.state = _ABORTING
                    self._aborting[rid] = req
                else:
                    self._end(req)
                    del self._requests[rid]
            case RequestState.ABORTING:  # pragma: no cover  # the table rejects it
                raise AssertionError(f"request {rid!r} is aborting already")
            case _:
                assert_never(req.state)
        self._forget_flight(req)
        self._stats.aborted += 1
        return self._report(req, FinishReason.ABORTED, None)

    # -- internals: planning a step --------------------------------------------------------
    def _plan_decodes(self, draft: _Draft) -> list[_Request]:
        """Every running request whose prompt is done decodes; return the ones prefilling."""
        prefilling: list[_Request] = []
        for req in self._running.values():
            if req.prompt_done:
                draft.decodes.append(
                    DecodeWork(
                        request_id=req.id,
                        token_id=req.output[-1],
                        position=req.num_computed,
                        pages=req.pages,
                    )
                )
            else:
                prefilling.append(req)
        draft.budget -= len(draft.decodes)
        return prefilling

    def _admit_queued(self, draft: _Draft, now: float) -> None:
        """Admit from the head of the queue while budget, running slots and pages allow."""
        queue = self._queue
        max_running = self._config.max_running
        while queue and draft.budget > 0 and len(self._running) < max_running:
            req = queue[0]
            if not self._admit(req, now):
                self._stats.admission_stalls += 1
                break
            queue.popleft()
            reads: tuple[RequestId, ...] = ()
            if draft.written:  # it may reuse blocks this very step writes
                writers = (draft.written.get(h) for h in req.pinned)
                reads = tuple(dict.fromkeys(w for w in writers if w is not None))
            self._plan_chunk(req, draft, now, reads)

    def _plan_chunk(
        self, req: _Request, draft: _Draft, now: float, reads: tuple[RequestId, ...] = ()
    ) -> None:
        """The next chunk of ``req``'s prompt, as much as the budget allows; with same-step
        sharing its completed blocks are registered now and the coordinator hears of it."""
        start = req.num_computed
        n = min(len(req.prompt) - start, draft.budget)
        end = start + n
        last = end == len(req.prompt)
        draft.prefills.append(
            PrefillWork(
                request_id=req.id,
                token_ids=req.prompt[start:end],
                start=start,
                pages=req.pages,
                sample=last,
                reads_from=reads,
            )
        )
        draft.budget -= n
        if not self._config.same_step_sharing:
            return
        bs = self._config.block_size
        if self._config.publish is PublishMode.PER_STEP:
            upto = end // bs
        elif req.role is Role.LEADER and last:  # releasing followers means publishing
            upto = len(req.blocks)
        else:
            upto = 0
        for j in self._publish(req, upto):
            if (j + 1) * bs > start:  # the step writes this block (a retry may not)
                draft.written[req.hashes[j]] = req.id
        if last:
            self._apply_all(self._coordinator.handle(PrefillDone(request_id=req.id, now=now)))
        elif req.role is Role.LEADER and self._coordinator.config.min_shared_blocks is not None:
            self._progress(req, now)

    # -- internals: completing a step ------------------------------------------------------
    def _advance(
        self, plan: StepPlan, sampled: dict[RequestId, int], now: float
    ) -> tuple[list[_Request], list[_Request], list[tuple[RequestId, int]]]:
        """Count the plan's computed positions and append its sampled tokens; return the
        requests it touched, those whose prompt it finished, and the tokens in plan order.
        Requests aborted during the step are skipped."""
        stats = self._stats
        running = self._running
        touched: list[_Request] = []
        prefilled: list[_Request] = []
        tokens: list[tuple[RequestId, int]] = []
        for p in plan.prefills:
            req = running.get(p.request_id)
            if req is None:
                continue
            req.num_computed += len(p.token_ids)
            stats.prefill_tokens += len(p.token_ids)
            touched.append(req)
            if p.sample:
                tok = sampled[p.request_id]
                req.output.append(tok)
                req.first_token_at = now
                req.first_token_step = plan.step
                tokens.append((req.id, tok))
                prefilled.append(req)
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
        return touched, prefilled, tokens

    @staticmethod
    def _ending(touched: list[_Request]) -> list[tuple[_Request, FinishReason]]:
        """The touched requests that end with this step, and why."""
        done: list[tuple[_Request, FinishReason]] = []
        for req in touched:
            if req.output and req.prompt_done:
                if req.output[-1] in req.stop:
                    done.append((req, FinishReason.STOP))
                elif len(req.output) >= req.max_new:
                    done.append((req, FinishReason.LENGTH))
        return done

    def _publish_computed(
        self, touched: list[_Request], done: list[tuple[_Request, FinishReason]]
    ) -> None:
        """Publish what the step computed: every completed block (``PER_STEP``; with
        same-step sharing a prefill's were registered at planning already), a finishing
        request's blocks, a flight leader's prompt once it is computed."""
        bs = self._config.block_size
        per_step = self._config.publish is PublishMode.PER_STEP
        finishing = {id(r) for r, _ in done}
        for req in touched:
            if per_step or id(req) in finishing:
                self._publish(req, req.num_computed // bs)
            elif req.role is Role.LEADER and req.prompt_done:
                self._publish(req, len(req.blocks))

    def _report_progress(
        self, touched: list[_Request], prefilled: list[_Request], now: float
    ) -> None:
        """Without same-step sharing: tell the coordinator what the step published."""
        if self._coordinator.config.min_shared_blocks is not None:
            for req in touched:
                if req.role is Role.LEADER and not req.prompt_done:
                    self._progress(req, now)
        for req in prefilled:
            self._apply_all(self._coordinator.handle(PrefillDone(request_id=req.id, now=now)))

    def _progress(self, req: _Request, now: float) -> None:
        """A partial-prefix flight's leader published more of its prompt."""
        published = min(len(req.pinned), len(req.blocks))
        self._apply_all(
            self._coordinator.handle(
                Progress(request_id=req.id, published_blocks=published, now=now)
            )
        )

    def _finish(self, req: _Request, reason: FinishReason, step: int, now: float) -> RequestReport:
        """``req`` ended normally in ``step``: out of the scheduler, its pages back."""
        self._apply_all(self._coordinator.handle(Finished(request_id=req.id, now=now)))
        del self._running[req.id]
        del self._requests[req.id]
        self._forget_flight(req)
        self._end(req)
        self._stats.finished += 1
        return self._report(req, reason, step)

    def _close_step(self, *, failed: bool = False) -> None:
        """The outstanding step is over: aborting requests hand their pages back; after a
        failure, the blocks the step registered leave the cache (their KV is not there)."""
        for req in self._aborting.values():
            self._end(req)
            del self._requests[req.id]
        self._aborting.clear()
        if failed:  # every request that pinned them was in the plan, and is gone now
            self._pool.withdraw(self._registered)
        self._planned = frozenset()
        self._registered = ()

    # -- internals: admission and pages ----------------------------------------------------
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
        req.state = _RUNNING
        self._running[req.id] = req
        stats = self._stats
        stats.cached_tokens += k * bs
        stats.prefix_queries += 1
        stats.prefix_query_tokens += n
        return True

    def _publish(self, req: _Request, upto: int) -> list[int]:
        """Publish ``req``'s blocks up to ``upto`` (exclusive), hashing new decode blocks
        first; the pool pins them and keeps what it can (see `PagePool.publish`). Return
        the indices of the blocks now cached on ``req``'s own pages (not duplicates)."""
        start = len(req.pinned)
        if upto <= start:
            return []
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
        own = []
        for i, page in enumerate(kept):
            if page is not None:
                private.discard(page)
                own.append(start + i)
        return own

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
                    req.state = _QUEUED
                    self._queue.append(req)
            case Promote():
                req = self._flight_waiting.pop(d.request_id)
                req.flight_wait = self._coordinator.now - req.arrived_at
                req.role = Role.LEADER
                req.flight = d.flight
                self._leaders[d.flight] = req
                _, waiting = self._coordinator.flights().get(d.flight, (None, ()))
                req.followed = bool(waiting)
                req.state = _QUEUED
                self._queue.appendleft(req)  # it has waited longest: it goes first
            case Lead() | Wait() | Independent():
                raise AssertionError(f"unexpected decision for another request: {d!r}")
            case _:
                assert_never(d)

    # -- internals: checks and reports -----------------------------------------------------
    def _check_now(self, now: object) -> float:
        return check_time("now", now, after=max(self._now, self._coordinator.now))

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
            assert leader.flight == flight, "stale flight leader"
            assert leader.state in (_QUEUED, _RUNNING), "a flight leader ended"
        assert len(self._running) <= self._config.max_running
        places: dict[RequestState, Iterable[_Request]] = {
            _WAITING: self._flight_waiting.values(),
            _QUEUED: self._queue,
            _RUNNING: self._running.values(),
            _ABORTING: self._aborting.values(),
        }
        seen: dict[RequestId, _Request] = {}
        for state, reqs in places.items():
            for req in reqs:
                assert req.state is state, f"{req.id!r} is {req.state} but kept as {state}"
                assert req.id not in seen, f"{req.id!r} is in two places"
                seen[req.id] = req
        assert seen == self._requests, "the request index is out of sync"
        for rid, req in self._flight_waiting.items():
            assert req.id == rid
        for rid, req in self._running.items():
            assert req.id == rid
        if self._outstanding is None:
            assert not self._aborting and not self._planned and not self._registered
        else:
            assert set(self._aborting) <= self._planned
            policy = cache.policy
            for h in self._registered:  # its writer pins it until the step is over
                assert h in cache and policy.pin_count(h) > 0, "a block being written is loose"
