"""`AsyncEngine`: an asyncio front over the pure `Scheduler` and a `TransformersRunner`.

One task drives the engine loop: ``plan = scheduler.schedule(now)``, run the plan on the
runner in a single worker thread (so the event loop stays responsive while the model
computes), ``scheduler.complete_step(result, now)``, hand each request its tokens. The
scheduler, and through it the `FlightCoordinator` and the `PrefixCache`, are only ever
touched from the event loop; the worker thread only runs the model on the pool. ``now`` is
``time.perf_counter()`` (any monotonic clock can be passed in), so the scheduler's reports
carry wall-clock TTFT and completion times.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, final

import attrs

from prefixflight.core import (
    LRU,
    S3FIFO,
    ConfigError,
    FlightConfig,
    FlightCoordinator,
    PrefixCache,
    PrefixflightError,
    PublishMode,
    ReleasePolicy,
    RequestId,
    RequestReport,
    Scheduler,
    SchedulerConfig,
    StepOutcome,
    StepResult,
    UsageError,
)
from prefixflight.core._validate import check_int

from ._runner import TransformersRunner
from ._sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineClosedError", "EngineConfig", "Generation"]


class EngineClosedError(PrefixflightError):
    """The engine was closed (or failed) before this request could finish."""


def _check_policy(_i: object, _a: object, value: object) -> None:
    if not isinstance(value, ReleasePolicy):
        raise ConfigError(f"release_policy must be a ReleasePolicy, got {value!r}")


def _check_eviction(_i: object, _a: object, value: object) -> None:
    if value not in ("lru", "s3fifo"):
        raise ConfigError(f"eviction must be 'lru' or 's3fifo', got {value!r}")


def _check_max_wait(_i: object, _a: object, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
    ):
        raise ConfigError(f"max_wait must be None or a number of seconds >= 0, got {value!r}")


def _positive(name: str) -> Callable[[object, object, object], None]:
    def check(_i: object, _a: object, value: object) -> None:
        check_int(name, value, minimum=1)

    return check


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How an `AsyncEngine` schedules.

    - ``release_policy``: when followers of a single flight may start (``AFTER_PREFILL``,
      ``ON_COMPLETION``, or ``INDEPENDENT`` for no coordination).
    - ``incremental_publication``: publish each request's completed pages after every step
      (True) or only when it finishes (False, the seed's baseline).
    - ``num_pages`` / ``page_size``: the KV pool (`AsyncEngine.from_model` allocates it).
    - ``max_batch_tokens``: tokens per step (prefill chunks + one per decode);
      ``max_running``: running requests at most (the decode batch).
    - ``eviction``: the prefix cache's policy, ``"lru"`` or ``"s3fifo"``.
    - ``max_wait``: seconds a follower waits for its leader before computing on its own.
    """

    release_policy: ReleasePolicy = attrs.field(
        default=ReleasePolicy.AFTER_PREFILL, validator=_check_policy
    )
    incremental_publication: bool = True
    num_pages: int = attrs.field(default=1024, validator=_positive("num_pages"))
    page_size: int = attrs.field(default=16, validator=_positive("page_size"))
    max_batch_tokens: int = attrs.field(default=1024, validator=_positive("max_batch_tokens"))
    max_running: int = attrs.field(default=16, validator=_positive("max_running"))
    eviction: str = attrs.field(default="lru", validator=_check_eviction)
    max_wait: float | None = attrs.field(default=None, validator=_check_max_wait)

    def __attrs_post_init__(self) -> None:
        if self.max_batch_tokens < self.max_running:
            raise ConfigError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_running "
                f"({self.max_running}) so every running request can decode each step"
            )

    def scheduler(self, num_pages: int | None = None) -> Scheduler:
        """A fresh scheduler (with its own cache and coordinator) for this configuration."""
        pages = self.num_pages if num_pages is None else num_pages
        policy = LRU(pages) if self.eviction == "lru" else S3FIFO(pages)
        publish = (
            PublishMode.PER_STEP if self.incremental_publication else PublishMode.ON_COMPLETION
        )
        return Scheduler(
            SchedulerConfig(
                num_pages=pages,
                block_size=self.page_size,
                max_batch_tokens=self.max_batch_tokens,
                max_running=self.max_running,
                publish=publish,
            ),
            cache=PrefixCache(policy, self.page_size),
            coordinator=FlightCoordinator(
                FlightConfig(
                    policy=self.release_policy, max_wait=self.max_wait, block_size=self.page_size
                )
            ),
        )


class _End(enum.Enum):
    END = "end"


_END = _End.END


@final
class Generation:
    """One request's token stream: ``async for token in generation``.

    Finishing the iteration (``max_tokens`` or a stop token) sets `report`. Cancelling the
    task that iterates aborts the request: its pages are released and, if it led a flight,
    a follower takes over. `cancel` does the same without a task; ``async with`` cancels an
    unfinished request on exit.
    """

    __slots__ = ("_engine", "_queue", "report", "request_id", "tokens")

    def __init__(self, engine: AsyncEngine, request_id: RequestId) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[int | _End | BaseException] = asyncio.Queue()
        self.request_id = request_id
        self.tokens: list[int] = []
        """Tokens delivered so far."""
        self.report: RequestReport | None = None
        """The scheduler's report (role, cached tokens, TTFT, latency) once finished."""

    @property
    def done(self) -> bool:
        return self.report is not None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        if self.report is not None and self._queue.empty():
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
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
        assert self.report is not None
        return self.report

    def cancel(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if self.report is None:
            self._engine._abort(self)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    # called by the engine, on the event loop
    def _push(self, token: int) -> None:
        self.tokens.append(token)
        self._queue.put_nowait(token)

    def _finish(self, report: RequestReport) -> None:
        self.report = report
        self._queue.put_nowait(_END)

    def _fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)


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
        "_error",
        "_executor",
        "_ids",
        "_live",
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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        config = EngineConfig() if config is None else config
        pool = runner.pool
        if config.page_size != pool.page_size:
            raise ConfigError(
                f"config page_size {config.page_size} != the runner's pool page_size "
                f"{pool.page_size}"
            )
        if config.num_pages > pool.num_pages:
            raise ConfigError(
                f"config num_pages {config.num_pages} > the runner's pool ({pool.num_pages})"
            )
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self._clock = clock
        self._scheduler = config.scheduler()
        self._live: dict[RequestId, Generation] = {}
        self._ids: Iterator[int] = itertools.count()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._closed = False

    @classmethod
    def from_model(
        cls,
        model: Any,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> AsyncEngine:
        """Allocate a pool of ``config.num_pages`` pages for ``model`` and serve it."""
        config = EngineConfig() if config is None else config
        runner = TransformersRunner.for_model(
            model,
            num_pages=config.num_pages,
            page_size=config.page_size,
            device=device,
            dtype=dtype,
        )
        return cls(runner, config, tokenizer=tokenizer)

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
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prefixflight-engine")

    async def close(self) -> None:
        """Abort every unfinished request, wait for the step in progress, stop the loop."""
        self._closed = True
        for gen in list(self._live.values()):
            self._abort(gen, closing=True)
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

        Raises `UsageError` at once for a bad prompt, a duplicate ``request_id`` or a request
        that can never fit in the pool (the engine is unchanged).
        """
        self.start()
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise UsageError(f"sampling must be SamplingParams, got {sampling!r}")
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
        rid = next(self._ids) if request_id is None else request_id
        while request_id is None and rid in self._live:  # pragma: no cover - user took it
            rid = next(self._ids)
        self._scheduler.add_request(
            rid,
            ids,
            max_new_tokens=sampling.max_tokens,
            now=self._clock(),
            namespace=namespace,
            stop_token_ids=sampling.stop_token_ids,
        )
        gen = Generation(self, rid)
        self._live[rid] = gen
        self.runner.set_sampling(rid, sampling)
        self._poke()
        return gen

    def _abort(self, gen: Generation, *, closing: bool = False) -> None:
        if self._live.pop(gen.request_id, None) is None:
            return
        report = self._scheduler.abort(gen.request_id, now=self._clock())
        self.runner.discard(gen.request_id)
        if closing:
            gen.report = report
            gen._fail(EngineClosedError(f"request {gen.request_id!r}: the engine was closed"))
        else:
            gen._finish(report)
        self._poke()

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
                    if sched.has_unfinished:  # e.g. followers waiting out max_wait
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(wake.wait(), timeout=0.005)
                    else:
                        await wake.wait()
                    continue
                future = loop.run_in_executor(self._executor, self.runner.execute, plan)
                try:
                    result = await asyncio.shield(future)
                except asyncio.CancelledError:
                    await asyncio.wait([future])  # never leave the worker writing the pool
                    self._settle(future)
                    raise
                self._deliver(sched.complete_step(result, self._clock()))
                await asyncio.sleep(0)  # let consumers and new arrivals run between steps
        except Exception as exc:  # a model or backend failure: fail every request, stop
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

    def _fail_all(self, exc: BaseException) -> None:
        """Abort every live request with ``exc`` and close the step they were in: nothing
        the failed step computed is used, and every pin and private page is handed back."""
        sched = self._scheduler
        live = list(self._live.values())
        self._live.clear()
        for gen in live:
            with contextlib.suppress(PrefixflightError):
                gen.report = sched.abort(gen.request_id, now=self._clock())
            self.runner.discard(gen.request_id)
            gen._fail(exc)
        plan = sched.outstanding
        if plan is not None:
            # every request of the plan is aborted now, so the scheduler discards what this
            # result says; it only closes the step (the aborted requests' pages come back)
            sampled = [(p.request_id, 0) for p in plan.prefills if p.sample]
            sampled += [(d.request_id, 0) for d in plan.decodes]
            result = StepResult(step=plan.step, sampled=tuple(sampled))
            with contextlib.suppress(PrefixflightError):
                sched.complete_step(result, self._clock())

    def _deliver(self, outcome: StepOutcome) -> None:
        live = self._live
        for rid, token in outcome.tokens:
            gen = live.get(rid)
            if gen is not None:
                gen._push(token)
        for report in outcome.finished:
            gen = live.pop(report.request_id, None)
            self.runner.discard(report.request_id)
            if gen is not None:
                gen._finish(report)
