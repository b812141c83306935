"""`AsyncEngine`: an asyncio front over the pure `Scheduler` and a `TransformersRunner`.

One task drives the engine loop: ``plan = scheduler.schedule(now)``, run the plan on the
runner in a single worker thread (so the event loop stays responsive while the model
computes), ``scheduler.complete_step(result, now)``, hand each request its tokens. The
scheduler, and through it the `FlightCoordinator` and the `PrefixCache`, are only ever
touched from the event loop; the worker thread only runs the model on the pool. ``now`` is
``time.perf_counter()`` (any monotonic clock can be passed in), so the scheduler's reports
carry wall-clock TTFT and completion times.

A step that fails (the model, the sampler or the scheduler raises) fails the requests of that
step, and only those: each of their streams raises `StepFailedError`, their pages come back,
and the engine goes on with every other request. Only a failure outside a step (the
scheduler cannot plan) stops the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, final

import attrs

from prefixflight.core import (
    ConfigError,
    PrefixflightError,
    PublishMode,
    ReleasePolicy,
    RequestId,
    RequestReport,
    Scheduler,
    SchedulerConfig,
    StepOutcome,
    StepPlan,
    StepResult,
    UsageError,
)
from prefixflight.core.cache import POLICIES, EventSink, make_policy
from prefixflight.core.flight._pages import pages_for
from prefixflight.core.validate import (
    check_int,
    deprecated_alias,
    instance_field,
    int_field,
    optional_int_field,
)

from ._runner import TransformersRunner
from ._sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineClosedError", "EngineConfig", "Generation", "StepFailedError"]

_log = logging.getLogger("prefixflight.engine")


class EngineClosedError(PrefixflightError):
    """The engine was closed (or failed) before this request could finish."""


class StepFailedError(PrefixflightError):
    """The engine step this request was in failed (its ``__cause__`` says why); the engine
    serves on, the request is over."""


def _check_eviction(_i: object, _a: object, value: object) -> None:
    if not isinstance(value, str) or value not in POLICIES:
        names = " or ".join(repr(n) for n in sorted(POLICIES))
        raise ConfigError(f"eviction must be {names}, got {value!r}")


def _check_max_wait(_i: object, _a: object, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
    ):
        raise ConfigError(f"max_wait must be None or a number of seconds >= 0, got {value!r}")


@deprecated_alias("page_size", "block_size")
@attrs.frozen(kw_only=True)
class EngineConfig:
    """How an `AsyncEngine` schedules.

    - ``release_policy``: when followers of a single flight may start (``AFTER_PREFILL``,
      ``ON_COMPLETION``, or ``INDEPENDENT`` for no coordination).
    - ``incremental_publication``: publish each request's completed pages after every step
      (True) or only when it finishes (False: the baseline of the single-flight prefill study
      of mini-vllm-rs).
    - ``num_pages`` / ``block_size``: the KV pool (`AsyncEngine.from_model` allocates it), in
      pages of ``block_size`` tokens. ``page_size`` is the deprecated name of ``block_size``.
    - ``max_batch_tokens``: tokens per step (prefill chunks + one per decode);
      ``max_running``: running requests at most (the decode batch).
    - ``eviction``: the prefix cache's policy, a name of `prefixflight.core.cache.POLICIES`
      (``"lru"``, ``"s3fifo"``).
    - ``max_wait``: seconds a follower waits for its leader before computing on its own.
    - ``min_shared_blocks``: also coordinate requests that share at least this many leading
      blocks with an open flight (partial-prefix mode); ``None`` (default): identical
      prompts only.
    """

    release_policy: ReleasePolicy = attrs.field(
        default=ReleasePolicy.AFTER_PREFILL, validator=instance_field(ReleasePolicy)
    )
    incremental_publication: bool = True
    num_pages: int = attrs.field(default=1024, validator=int_field(1))
    block_size: int = attrs.field(default=16, validator=int_field(1))
    max_batch_tokens: int = attrs.field(default=1024, validator=int_field(1))
    max_running: int = attrs.field(default=16, validator=int_field(1))
    eviction: str = attrs.field(default="lru", validator=_check_eviction)
    max_wait: float | None = attrs.field(default=None, validator=_check_max_wait)
    min_shared_blocks: int | None = attrs.field(default=None, validator=optional_int_field(1))

    def __attrs_post_init__(self) -> None:
        if self.max_batch_tokens < self.max_running:
            raise ConfigError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_running "
                f"({self.max_running}) so every running request can decode each step"
            )

    def scheduler(
        self,
        num_pages: int | None = None,
        *,
        event_sink: EventSink | None = None,
        vocab_size: int | None = None,
    ) -> Scheduler:
        """A fresh scheduler (with its own cache and coordinator) for this configuration.

        ``event_sink`` receives the cache's KV events (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``), e.g. a publisher that puts them on the wire for a router.
        ``vocab_size``: the scheduler rejects token ids outside the model's vocabulary.
        """
        pages = self.num_pages if num_pages is None else num_pages
        policy = make_policy(self.eviction, pages)
        publish = (
            PublishMode.PER_STEP if self.incremental_publication else PublishMode.ON_COMPLETION
        )
        return Scheduler.build(
            SchedulerConfig(
                num_pages=pages,
                block_size=self.block_size,
                max_batch_tokens=self.max_batch_tokens,
                max_running=self.max_running,
                publish=publish,
                vocab_size=vocab_size,
            ),
            eviction=policy,
            release=self.release_policy,
            max_wait=self.max_wait,
            min_shared_blocks=self.min_shared_blocks,
            event_sink=event_sink,
        )


def _eos_of(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's end-of-sequence id(s); for a chat model it is the end-of-turn token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and not isinstance(eos, bool):
        return frozenset((eos,))
    if isinstance(eos, (list, tuple)):
        return frozenset(t for t in eos if isinstance(t, int) and not isinstance(t, bool))
    return frozenset()


class _End(enum.Enum):
    END = "end"


_END = _End.END


@final
class _Stream:
    """The engine's side of one request: its tokens and its end, queued for the consumer.

    The engine holds this, never the caller's `Generation`, so that dropping the Generation
    (``break`` out of ``async for``, garbage collection) can abort the request.
    """

    __slots__ = ("queue", "report", "request_id", "tokens")

    def __init__(self, request_id: RequestId) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[int | _End | BaseException] = asyncio.Queue()
        self.tokens: list[int] = []
        self.report: RequestReport | None = None

    def push(self, token: int) -> None:
        self.tokens.append(token)
        self.queue.put_nowait(token)

    def finish(self, report: RequestReport) -> None:
        self.report = report
        self.queue.put_nowait(_END)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)


@final
class Generation:
    """One request's token stream: ``async for token in generation``.

    It closes like an async generator, and closing an unfinished stream aborts the request
    (its pages are released and, if it led a flight, a follower takes over):

    - ``await generation.aclose()`` (so ``contextlib.aclosing(engine.generate(...))`` works),
      after which iteration stops;
    - ``break`` out of ``async for token in engine.generate(...)``: the loop held the only
      reference, so the stream is garbage and is finalised, as an async generator would be;
    - garbage collection of an unfinished stream;
    - cancelling the task that iterates, `cancel`, or leaving ``async with generation``.

    Finalisation never runs engine code where the collector happens to run: it schedules
    the abort on the engine's event loop (thread-safe), like asyncio's own async-generator
    finaliser. A stream you still hold is not closed by ``break``, just as a held async
    generator is not; use ``aclose``/``aclosing`` for a deterministic close. Finishing the
    iteration (``max_tokens`` or a stop token) sets `report`.
    """

    __slots__ = ("_closed", "_engine", "_stream", "request_id")

    def __init__(self, engine: AsyncEngine, stream: _Stream) -> None:
        self._engine = engine
        self._stream = stream
        self._closed = False
        self.request_id = stream.request_id

    @property
    def tokens(self) -> list[int]:
        """Tokens delivered so far."""
        return self._stream.tokens

    @property
    def report(self) -> RequestReport | None:
        """The scheduler's report (role, cached tokens, TTFT, latency) once finished."""
        return self._stream.report

    @property
    def done(self) -> bool:
        return self._stream.report is not None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        stream = self._stream
        if self._closed or (stream.report is not None and stream.queue.empty()):
            raise StopAsyncIteration
        try:
            item = await stream.queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def result(self) -> RequestReport:
        """Consume the rest of the stream and return the report."""
        async for _ in self:
            pass
        report = self._stream.report
        assert report is not None
        return report

    def cancel(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if self._stream.report is None:
            self._engine._abort(self._stream)

    async def aclose(self) -> None:
        """Abort the request unless it finished, and end the iteration (idempotent)."""
        self.cancel()
        self._closed = True

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        stream = getattr(self, "_stream", None)  # None if __init__ never ran
        if stream is not None and stream.report is None:
            self._engine._abort_soon(stream)


@final
class AsyncEngine:
    """Serves many concurrent requests on one model with prefix reuse and single flight.

    ``async with AsyncEngine(runner, config) as engine:`` then
    ``async for token in engine.generate(prompt, SamplingParams(...))``. Prompts are token
    ids, or text when a ``tokenizer`` is given. The model step runs in one worker thread;
    everything else runs on the event loop that created the engine's task (the first
    `generate` or `start`). `close` aborts what is left and waits for the step in progress.
    """

    __slots__ = (
        "_clock",
        "_closed",
        "_eos",
        "_error",
        "_executor",
        "_flush_events",
        "_ids",
        "_live",
        "_loop",
        "_scheduler",
        "_task",
        "_wake",
        "config",
        "runner",
        "tokenizer",
    )

    def __init__(
        self,
        runner: TransformersRunner,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] | None = None,
        event_sink: EventSink | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        config = EngineConfig() if config is None else config
        pool = runner.pool
        if config.block_size != pool.block_size:
            raise ConfigError(
                f"config block_size {config.block_size} != the runner's pool block_size "
                f"{pool.block_size}"
            )
        if config.num_pages > pool.num_pages:
            raise ConfigError(
                f"config num_pages {config.num_pages} > the runner's pool ({pool.num_pages})"
            )
        eos = _eos_of(tokenizer) if eos_token_ids is None else frozenset(eos_token_ids)
        for t in eos:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < runner.vocab_size:
                raise ConfigError(
                    f"eos token id {t!r} is not in the model's vocabulary [0, {runner.vocab_size})"
                )
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self._eos = eos
        self._clock = clock
        self._scheduler = config.scheduler(event_sink=event_sink, vocab_size=runner.vocab_size)
        # a sink that batches (a KV-event publisher) is flushed after every step: one event
        # batch per engine step, as vLLM publishes
        self._flush_events: Callable[[], object] | None = getattr(event_sink, "flush", None)
        self._live: dict[RequestId, _Stream] = {}
        self._ids: Iterator[int] = itertools.count()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_model(
        cls,
        model: Any,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] | None = None,
        event_sink: EventSink | None = None,
        device: str | None = None,
        dtype: str | None = None,
        attention: str = "paged",
        vllm_library: str | Path | None = None,
    ) -> AsyncEngine:
        """Allocate a pool of ``config.num_pages`` pages for ``model`` and serve it
        (``attention``, ``vllm_library``: the runner's attention path, `TransformersRunner`)."""
        config = EngineConfig() if config is None else config
        runner = TransformersRunner.for_model(
            model,
            num_pages=config.num_pages,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
            attention=attention,
            vllm_library=vllm_library,
        )
        return cls(
            runner, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids, event_sink=event_sink
        )

    # -- views -----------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        """The engine's scheduler, for its stats and views (do not drive it yourself)."""
        return self._scheduler

    @property
    def closed(self) -> bool:
        """True once `close` ran or the engine failed; `generate` then raises."""
        return self._closed or (self._task is not None and self._task.done())

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop on the running event loop (`generate` does it too)."""
        if self.closed:
            raise EngineClosedError("the engine is closed") from self._error
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixflight-step"
        )
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="prefixflight-engine")

    async def close(self) -> None:
        """Abort every unfinished request, wait for the step in progress, stop the loop."""
        self._closed = True
        for stream in list(self._live.values()):
            self._abort(stream, closing=True)
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests --------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Iterable[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: RequestId | None = None,
        namespace: str | bytes = b"",
    ) -> Generation:
        """Submit a request now; iterate the result for its tokens.

        ``namespace`` separates tenants (a cache salt, a user): requests in different
        namespaces never share cached blocks or a flight. Generation stops at
        `eos_token_ids` unless ``sampling.ignore_eos``.

        Raises `UsageError` at once for a bad prompt, a duplicate ``request_id`` or a request
        that can never fit in the pool (the engine is unchanged).
        """
        self.start()
        sampling = self._check_sampling(sampling)
        ids = self._checked_prompt(prompt, sampling)
        rid = self._new_id() if request_id is None else request_id
        return self._submit(rid, ids, sampling, namespace)

    def validate(
        self, prompt: str | Iterable[int], sampling: SamplingParams | None = None
    ) -> tuple[int, ...]:
        """The prompt's token ids if `generate` would accept it with ``sampling``; else the
        `UsageError` `generate` would raise. Submits nothing and starts nothing, so a
        server can check every prompt of a request before it takes any of them."""
        return self._checked_prompt(prompt, self._check_sampling(sampling))

    @property
    def max_model_len(self) -> int | None:
        """Positions the model can attend over (its config's ``max_position_embeddings``),
        if it says: a request's prompt plus its ``max_tokens`` must fit."""
        n = getattr(self.runner.model.config, "max_position_embeddings", None)
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def generate_n(
        self,
        prompt: str | Iterable[int],
        sampling: SamplingParams | None = None,
        n: int = 1,
        *,
        request_ids: Sequence[RequestId] | None = None,
        namespace: str | bytes = b"",
    ) -> tuple[Generation, ...]:
        """``n`` answers to one prompt (OpenAI's ``n``): one prefill, ``n`` decodes.

        The ``n`` requests arrive together with the same prompt and namespace, so the flight
        coordinator elects one leader and the others follow it (with ``release_policy``
        ``INDEPENDENT`` each computes its own prefill). Each samples on its own: with a
        ``seed``, answer ``i`` uses ``seed + i`` (as vLLM's parallel sampling does), so the
        answers differ and are reproducible. All ``n`` are submitted or none.
        """
        self.start()
        check_int("n", n, minimum=1)
        sampling = self._check_sampling(sampling)
        ids = self._checked_prompt(prompt, sampling)
        if request_ids is None:
            rids: list[RequestId] = []
            for _ in range(n):
                rid = self._new_id()
                while rid in rids:  # pragma: no cover - the counter never repeats
                    rid = self._new_id()
                rids.append(rid)
        else:
            rids = list(request_ids)
            if len(rids) != n or len(set(rids)) != n:
                raise UsageError(f"request_ids must be {n} distinct ids, got {request_ids!r}")
        gens: list[Generation] = []
        try:
            for i, rid in enumerate(rids):
                seeded = (
                    sampling
                    if sampling.seed is None
                    else attrs.evolve(sampling, seed=sampling.seed + i)
                )
                gens.append(self._submit(rid, ids, seeded, namespace))
        except PrefixflightError:
            for gen in gens:  # all or nothing
                gen.cancel()
            raise
        return tuple(gens)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end every request (unless ``ignore_eos``): the ones given to the
        engine, else the tokenizer's ``eos_token_id`` (``<|im_end|>`` for SmolLM2)."""
        return self._eos

    def _check_sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise UsageError(f"sampling must be SamplingParams, got {sampling!r}")
        return sampling

    def _prompt_ids(self, prompt: str | Iterable[int]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UsageError("a text prompt needs an engine made with a tokenizer")
            ids: tuple[int, ...] = tuple(self.tokenizer(prompt)["input_ids"])
        else:
            try:  # once: a one-shot iterator is read here and nowhere else
                ids = tuple(prompt)
            except TypeError:
                raise UsageError(
                    f"prompt must be text or an iterable of token ids, got {prompt!r}"
                ) from None
        vocab = self.runner.vocab_size
        bad = [t for t in ids if isinstance(t, int) and not 0 <= t < vocab]
        if bad:  # checked here: inside a step it would fail every live request
            raise UsageError(f"token id {bad[0]!r} is not in [0, {vocab})")
        return ids

    def _checked_prompt(
        self, prompt: str | Iterable[int], sampling: SamplingParams
    ) -> tuple[int, ...]:
        """The checks `Scheduler.add_request` makes, made first: a request of several
        prompts is then taken whole or not at all."""
        ids = self._prompt_ids(prompt)
        if not ids:
            raise UsageError("the request has an empty prompt")
        vocab = self.runner.vocab_size
        bad = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"stop token id {bad[0]!r} is not in [0, {vocab})")
        context = self.max_model_len
        if context is not None and len(ids) + sampling.max_tokens > context:
            raise UsageError(
                f"this model's maximum context length is {context} tokens, but the request "
                f"needs {len(ids) + sampling.max_tokens} ({len(ids)} in the prompt + "
                f"{sampling.max_tokens} max_tokens)"
            )
        cfg = self.config
        need = pages_for(len(ids), sampling.max_tokens, cfg.block_size)
        if need > cfg.num_pages:
            raise UsageError(
                f"the request needs {need} pages ({len(ids)} prompt + {sampling.max_tokens} "
                f"new tokens) but the pool has {cfg.num_pages}"
            )
        return ids

    def _new_id(self) -> RequestId:
        rid = next(self._ids)
        while rid in self._live:  # pragma: no cover - the caller took it
            rid = next(self._ids)
        return rid

    def _submit(
        self,
        rid: RequestId,
        ids: tuple[int, ...],
        sampling: SamplingParams,
        namespace: str | bytes,
    ) -> Generation:
        stop = sampling.stop_token_ids
        if not sampling.ignore_eos and self._eos:
            stop = (*stop, *sorted(self._eos))
        self._scheduler.add_request(
            rid,
            ids,
            max_new_tokens=sampling.max_tokens,
            now=self._clock(),
            namespace=namespace,
            stop_token_ids=stop,
        )
        stream = _Stream(rid)
        self._live[rid] = stream
        if sampling.min_tokens:  # the sampler holds back every token that would end it
            sampling = attrs.evolve(sampling, stop_token_ids=stop)
        self.runner.set_sampling(rid, sampling)
        self._poke()
        return Generation(self, stream)

    def _abort(self, stream: _Stream, *, closing: bool = False) -> None:
        rid = stream.request_id
        if self._live.get(rid) is not stream:
            return  # already ended (or the id was reused since)
        del self._live[rid]
        report = self._scheduler.abort(rid, now=self._clock())
        self.runner.discard(rid)
        if closing:
            stream.report = report
            stream.fail(EngineClosedError(f"request {rid!r}: the engine was closed"))
        else:
            stream.finish(report)
        self._poke()

    def _abort_soon(self, stream: _Stream) -> None:
        """Abort from a finaliser: on the engine's loop, whichever thread collected."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._abort, stream)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self._scheduler
        wake = self._wake
        assert wake is not None
        try:
            while True:
                plan = sched.schedule(self._clock())
                if plan.is_empty:
                    wake.clear()
                    # requests but nothing to run (e.g. followers waiting out max_wait): look
                    # again soon. (A timer, not asyncio.wait_for: up to Python 3.11 that drops
                    # a cancellation landing as the wait ends, and `close` would hang.)
                    soon = loop.call_later(0.005, wake.set) if sched.has_unfinished else None
                    try:
                        await wake.wait()
                    finally:
                        if soon is not None:
                            soon.cancel()
                    continue
                future = loop.run_in_executor(self._executor, self.runner.execute, plan)
                try:
                    result = await asyncio.shield(future)
                    outcome = sched.complete_step(result, self._clock())
                except asyncio.CancelledError:
                    await asyncio.wait([future])  # never leave the worker writing the pool
                    self._settle(future)
                    raise
                except Exception as exc:  # this step failed: its requests end, the rest go on
                    self._fail_step(plan, exc)
                else:
                    self._deliver(outcome)
                if self._flush_events is not None:
                    self._flush_events()
                await asyncio.sleep(0)  # let consumers and new arrivals run between steps
        except Exception as exc:  # the scheduler itself failed: fail every request, stop
            _log.exception("the engine loop failed; every request fails and the engine stops")
            self._error = exc
            self._fail_all(exc)

    def _settle(self, future: asyncio.Future[StepResult]) -> None:
        """Complete the step the loop was cancelled in (by `close`), so that the requests
        aborted during it hand back their pins and pages."""
        exc = None if future.cancelled() else future.exception()
        if exc is not None or future.cancelled():
            self._fail_all(exc if exc is not None else EngineClosedError("the step was cancelled"))
        else:
            self._deliver(self._scheduler.complete_step(future.result(), self._clock()))

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        """Fail the requests of ``plan`` (a step that raised) with `StepFailedError` and close
        the step; every other request goes on."""
        rids = [p.request_id for p in plan.prefills] + [d.request_id for d in plan.decodes]
        _log.error(
            "engine step %d failed (%s: %s); its %d request(s) fail, the engine goes on",
            plan.step,
            type(exc).__name__,
            exc,
            len(rids),
            exc_info=exc,
        )
        error = StepFailedError(f"the engine step failed ({type(exc).__name__}: {exc})")
        error.__cause__ = exc
        reports = self._close_failed_step()
        failed = [s for s in (self._live.pop(rid, None) for rid in rids) if s is not None]
        self._fail(failed, error, reports)

    def _fail_all(self, exc: BaseException) -> None:
        """Abort every live request with ``exc`` and fail the step they were in: nothing the
        failed step computed is used (the blocks it registered leave the cache), and every
        pin and private page is handed back."""
        reports = self._close_failed_step()
        live = list(self._live.values())
        self._live.clear()
        self._fail(live, exc, reports)

    def _close_failed_step(self) -> dict[RequestId, RequestReport]:
        """Fail the outstanding step, if there is one (`Scheduler.fail_step`): its running
        requests are aborted, the blocks it registered for same-step sharing leave the cache
        and its pages come back. The aborted requests' reports, by id."""
        sched = self._scheduler
        if sched.outstanding is None:
            return {}
        with contextlib.suppress(PrefixflightError):
            return {r.request_id: r for r in sched.fail_step(self._clock())}
        return {}

    def _fail(
        self,
        streams: list[_Stream],
        exc: BaseException,
        reports: dict[RequestId, RequestReport],
    ) -> None:
        """Fail ``streams`` (already out of `_live`) with ``exc``; a request the failed step
        did not abort (``reports`` has no entry for it) is aborted here."""
        sched = self._scheduler
        for stream in streams:
            report = reports.get(stream.request_id)
            if report is None:
                with contextlib.suppress(PrefixflightError):
                    report = sched.abort(stream.request_id, now=self._clock())
            if report is not None:
                stream.report = report
            self.runner.discard(stream.request_id)
            stream.fail(exc)

    def _deliver(self, outcome: StepOutcome) -> None:
        live = self._live
        for rid, token in outcome.tokens:
            stream = live.get(rid)
            if stream is not None:
                stream.push(token)
        for report in outcome.finished:
            stream = live.pop(report.request_id, None)
            self.runner.discard(report.request_id)
            if stream is not None:
                stream.finish(report)
