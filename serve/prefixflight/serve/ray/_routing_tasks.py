"""Routing tasks that never abandon a request: a work-around for Ray Serve 2.59's routing loop.

How Serve routes (``RequestRouter._fulfill_pending_requests`` in
ray/serve/_private/request_router/request_router.py, Ray 2.59): each routing task pops one
pending request off the routing queue, awaits ``choose_replicas`` for it, probes the chosen
replicas and hands the winner to *that* request. Before probing, a task gives up (``break``)
when there are more routing tasks than the *target* (pending requests, counted on a queue that
is cleaned lazily, so the count jumps down when its head is assigned). A task that gives up
this way has already popped its request and nobody routes it again: the request hangs until
its caller times out. Power-of-two routing survives it because any task hands its replica to
the oldest waiting request (FIFO matching); routers that answer for one request (ours, Ray's
own ``PrefixCacheAffinityRouter``) lose the request. The longer ``choose_replicas`` awaits (a
burst window, a prefix-tree actor call), the likelier it is that the head of the queue is
assigned meanwhile. Ray tracks it as "[serve] Prevent routing tasks from abandoning pending
requests" (ray-project/ray PR #66325, open); Ray's experimental ``ConsistentHashRouter``
overrides the same loop for the same reason.

`OwnRequestRoutingMixin` replaces that loop: a task owns the request it popped until the
request is assigned a replica or cancelled, and retires only between requests (when the
routing queue is empty or the task count is over the router's cap). A request on which the
router itself raises fails with that error (Serve's loop would drop it and end the task).
Everything else (the choice, the backoff, the probes, the assignment) is Serve's own code,
called as Serve calls it. It relies on Serve's private routing-queue attributes of the Ray
range the ``ray`` extra pins (2.59.x).

This is the one module of the Ray integration that reaches past Ray's public API; everything
else imports ``ray.serve``, ``ray.serve.config`` and ``ray.serve.request_router``. Besides
the mixin it holds `PrefixCacheAffinityRouter`, Ray's prefix-aware router with the mixin (the
``"prefix"`` router of `run_local` and the benchmarks): the public class lives in
``ray.serve.llm.request_router``, whose package imports ``pyarrow`` (installed by
``ray[llm]``, not by ``ray[serve]``); without it the same class is imported from the module
that defines it. Both go when the PR lands: drop the mixin, import the public class.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

try:  # the public class (its package needs ray[llm]'s pyarrow)
    from ray.serve.llm.request_router import (
        PrefixCacheAffinityRouter as _RayPrefixCacheAffinityRouter,
    )
except ImportError:  # the class it re-exports, from the module that defines it
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # type: ignore[assignment]
        PrefixCacheAffinityRouter as _RayPrefixCacheAffinityRouter,
    )

__all__ = ["OwnRequestRoutingMixin", "PrefixCacheAffinityRouter"]

_log = logging.getLogger("ray.serve")


class OwnRequestRoutingMixin:
    """Mix in before ``RequestRouter``: routing tasks keep their request until it is routed.

    ``class MyRouter(OwnRequestRoutingMixin, RequestRouter)``. For routers whose choice is
    for one request (not FIFO): a task with nothing to route retires at once instead of
    probing replicas on behalf of no request.
    """

    async def _fulfill_pending_requests(self) -> None:
        router: Any = self
        try:
            while len(router._routing_tasks) <= router.max_num_routing_tasks:
                pending = router._get_next_pending_request_to_route()
                if pending is None:
                    break  # nothing to route: retire (a new request starts a new task)
                try:
                    await self._route_until_done(pending)
                except Exception as exc:  # the router failed on it: the caller gets the error
                    _log.exception("Routing request %s failed.", pending.metadata.request_id)
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                    router._remove_pending_request_from_indices(pending)
        except Exception:
            _log.exception("Unexpected error in the routing task.")
        finally:
            task = asyncio.current_task()
            router._routing_tasks.discard(task)
            router.num_routing_tasks_gauge.set(router.curr_num_routing_tasks)

    async def _route_until_done(self, pending: Any) -> None:
        """Route ``pending`` until a replica is assigned to it or it is cancelled."""
        router: Any = self
        attempt = 0
        choices = router._choose_replicas_with_backoff(pending)
        try:
            async for candidates in choices:
                fulfil = router._pending_requests_to_fulfill
                while fulfil and fulfil[0].future.done():  # Serve's lazy clean-up of the head
                    fulfil.popleft()
                if pending.future.done():  # cancelled (or assigned) meanwhile
                    return
                replica = await router._select_from_candidate_replicas(candidates, attempt)
                if replica is not None:
                    router._fulfill_next_pending_request(replica, pending.metadata)
                    if pending.future.done():
                        return
                attempt += 1
                if attempt % 50 == 0:
                    _log.warning(
                        "Request %s not routed after %d attempts; retrying.",
                        pending.metadata.request_id,
                        attempt,
                    )
        finally:
            await choices.aclose()


class PrefixCacheAffinityRouter(OwnRequestRoutingMixin, _RayPrefixCacheAffinityRouter):
    """Ray's ``PrefixCacheAffinityRouter``, unchanged but for `OwnRequestRoutingMixin`: it
    picks a replica for one request, as ours does, and without the mixin 1-3 requests of
    every benchmark round never reached a replica."""
