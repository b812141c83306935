"""`Scheduler`: vLLM's scheduler with prefixflight's eviction, single flight and checks.

``--scheduler-cls prefixflight.vllm.Scheduler`` builds vLLM's own scheduler (the async one
wherever vLLM would use it, the sync one otherwise), then, before its first allocation:

- swaps the free-block queue of its `BlockPool` for a `PolicyQueue` ordered by the policy
  the settings name (`prefixflight.vllm._queue`);
- with ``single_flight``, drives a prefixflight `FlightCoordinator`: a waiting request
  whose prompt shares leading blocks with a request still prefilling them is held back (it
  stays in vLLM's waiting queue, skipped by each step's scheduling) until those blocks are
  computed, the leader ends, or it has waited ``max_wait_s``;
- with ``checked``, checks the live pool and scheduler after every step
  (`prefixflight.vllm._checks`) and logs each violation as one line starting
  ``prefixflight invariant violation:``;
- always: a request vLLM preempts in the step that scheduled it leaves no block cached that
  no step computed (vLLM's priority-preemption finding; `_preempt_request`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import attrs

from prefixflight.core import ConfigError
from prefixflight.core._validate import assert_never
from prefixflight.core.flight import (
    Aborted,
    Arrived,
    Finished,
    FlightConfig,
    FlightCoordinator,
    FlightDecision,
    FlightKey,
    Independent,
    Lead,
    Placement,
    PrefillDone,
    Progress,
    Promote,
    Release,
    RequestId,
    Tick,
    Wait,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VLLMAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VLLMScheduler
from vllm.v1.request import RequestStatus

from ._checks import PoolChecker
from ._config import PluginConfig
from ._queue import PolicyQueue, install

__all__ = ["Scheduler"]

log = logging.getLogger("prefixflight.vllm")
if not log.handlers:  # one plain line per message, whatever vLLM's logging does
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class _Plugin:
    """What both scheduler classes add to vLLM's (mixed in before vLLM's class)."""

    prefixflight: PluginConfig
    prefixflight_queue: PolicyQueue
    _flights: FlightCoordinator | None
    _held: dict[RequestId, Any]
    _tracked: dict[RequestId, Any]
    _checker: PoolChecker | None
    _single: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        config = PluginConfig.from_additional_config(
            getattr(vllm_config, "additional_config", None)
        )
        super().__init__(*args, **kwargs)
        self.prefixflight = config
        manager = self.kv_cache_manager  # type: ignore[attr-defined]
        if not manager.enable_caching:
            raise ConfigError(
                "prefixflight.vllm needs prefix caching: start vLLM with --enable-prefix-caching"
            )
        groups = self.kv_cache_config.kv_cache_groups  # type: ignore[attr-defined]
        if len(groups) != 1:
            raise ConfigError(
                f"prefixflight.vllm supports one KV-cache group (full attention), got {len(groups)}"
            )
        pool = manager.block_pool
        self.prefixflight_queue = install(
            pool,
            config.eviction.build(pool.num_gpu_blocks - 1),
            refresh_on_free=config.eviction.refresh_on_free,
        )
        single = manager.coordinator.single_type_managers[0]
        self._single = single
        self._block_size = single.block_size
        flight = config.single_flight
        self._flights = None
        if flight is not None:
            self._flights = FlightCoordinator(
                FlightConfig(
                    policy=flight.release,
                    max_wait=flight.max_wait_s,
                    min_shared_blocks=flight.min_shared_blocks,
                    block_size=self._block_size,
                )
            )
        self._held = {}
        self._tracked = {}
        self._checker = None
        if config.checked:
            self._checker = PoolChecker(pool, self.prefixflight_queue, single, log)
        log.info(
            "%s (%s, %d blocks of %d tokens)",
            config.describe(),
            type(self).__name__,
            pool.num_gpu_blocks - 1,
            self._block_size,
        )

    # -- single flight ------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        known = request.request_id in self.requests  # type: ignore[attr-defined]
        super().add_request(request)  # type: ignore[misc]
        if self._flights is None or known:
            return
        prompt = request.prompt_token_ids
        if prompt is None:
            return
        lora = request.lora_request.name if request.lora_request else ""
        namespace = f"{lora}\0{request.cache_salt or ''}"
        full = len(prompt) // self._block_size
        rid = request.request_id
        decisions = self._flights.handle(
            Arrived(
                request_id=rid,
                key=FlightKey.of(prompt, namespace=namespace),
                now=time.monotonic(),
                blocks=tuple(request.block_hashes[:full]),
            )
        )
        self._tracked[rid] = request
        self._carry_out(decisions)

    def _carry_out(self, decisions: tuple[FlightDecision, ...]) -> None:
        for d in decisions:
            match d:
                case Wait():
                    self._held[d.request_id] = self._tracked[d.request_id]
                case Release():
                    for rid in d.request_ids:
                        self._held.pop(rid, None)
                case Promote():
                    self._held.pop(d.request_id, None)
                case Lead() | Independent():
                    pass  # admitted as vLLM would
                case _:
                    assert_never(d)

    def _flight_step(self) -> None:
        """Report time, progress and ends to the coordinator, once a step, before it is
        scheduled (what the last step computed, and who left since)."""
        flights = self._flights
        if flights is None:
            return
        now = time.monotonic()
        self._carry_out(flights.handle(Tick(now=now)))
        bs = self._block_size
        for rid, request in list(self._tracked.items()):
            place = flights.placement(rid)
            if request.is_finished() or rid not in self.requests:  # type: ignore[attr-defined]
                aborted = (
                    request.status
                    in (
                        RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR,
                    )
                    or place is Placement.WAITING
                )
                event = (Aborted if aborted else Finished)(request_id=rid, now=now)
                del self._tracked[rid]
                self._held.pop(rid, None)
                if place is not None:
                    self._carry_out(flights.handle(event))
                continue
            if place is not Placement.LEADING or request.status != RequestStatus.RUNNING:
                continue
            prompt = request.num_prompt_tokens
            done = min(request.num_computed_tokens, prompt)
            if done >= prompt:
                self._carry_out(flights.handle(PrefillDone(request_id=rid, now=now)))
            elif done >= bs:
                self._carry_out(
                    flights.handle(Progress(request_id=rid, published_blocks=done // bs, now=now))
                )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._flights is not None:
            self._flight_step()
        held = [r for r in self._held.values() if r.status == RequestStatus.WAITING]
        waiting = self.waiting  # type: ignore[attr-defined]
        if held:
            waiting.remove_requests(held)
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if held:
                waiting.prepend_requests(held)
        if self._checker is not None:
            self._checker.scheduled(output, self.requests)  # type: ignore[attr-defined]
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._checker is not None:
            self._checker.ran(scheduler_output)
        out = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._checker is not None:
            self._checker.check()
        return out

    # -- vLLM's priority-preemption finding ------------------------------------------------
    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """Before vLLM preempts ``request``, uncache its blocks that no step has computed.

        Under ``--scheduling-policy priority`` vLLM can preempt a request in the very
        ``schedule()`` call that scheduled it, after ``allocate_slots`` registered the full
        blocks that step would have computed; the step never runs for it, yet those blocks
        stay cached, and a later hit (the request itself, when it resumes) reads KV nobody
        wrote. Blocks from the one holding position ``num_computed_tokens`` on are exactly
        those: they lose their hash here (vLLM emits ``BlockRemoved``) before vLLM frees them.
        """
        blocks = self._single.req_to_blocks.get(request.request_id, ())
        pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        for block in blocks[request.num_computed_tokens // self._block_size :]:
            if block.block_hash is not None:
                pool._maybe_evict_cached_block(block)
                self.prefixflight_queue.stats.uncomputed_uncached += 1
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        log.info("prefixflight: stats %s", json.dumps(self.prefixflight_stats()))
        return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        log.info("prefixflight: stats %s", json.dumps(self.prefixflight_stats()))
        super().shutdown()  # type: ignore[misc]

    def prefixflight_stats(self) -> dict[str, int]:
        """The queue's counters, the checker's violations and the coordinator's waits."""
        out = attrs.asdict(self.prefixflight_queue.stats)
        if self._checker is not None:
            out["checked_steps"] = self._checker.steps
            out["violations"] = self._checker.violations
        if self._flights is not None:
            s = self._flights.stats
            out["followers"] = s.followers + s.partial_followers
            out["tokens_not_recomputed"] = s.tokens_not_recomputed
        return out


class Scheduler(_Plugin, _VLLMAsyncScheduler):  # type: ignore[misc]
    """vLLM's scheduler with prefixflight inside (``--scheduler-cls
    prefixflight.vllm.Scheduler``); the settings come from ``--additional-config
    '{"prefixflight": {...}}'``.

    Built as vLLM's `AsyncScheduler` when vLLM runs with async scheduling (its default
    wherever it supports it) and as its sync `Scheduler` otherwise, so naming this class
    never turns async scheduling off.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is Scheduler and not vllm_config.scheduler_config.async_scheduling:
            return SyncScheduler(*args, **kwargs)  # not a Scheduler: __init__ runs once
        return object.__new__(cls)


class SyncScheduler(_Plugin, _VLLMScheduler):  # type: ignore[misc]
    """`Scheduler` over vLLM's sync scheduler (what `Scheduler` builds when async
    scheduling is off)."""
