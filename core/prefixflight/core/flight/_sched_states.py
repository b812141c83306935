"""The scheduler's states and its transition tables (after h11's ``_state.py``): every
request is in one `RequestState`, the step in flight is one `StepPhase`, and which calls each
accepts, and where they lead, is one literal table checked before any call changes anything.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

__all__ = [
    "STEP_TRANSITIONS",
    "TRANSITIONS",
    "FinishReason",
    "PublishMode",
    "RequestState",
    "Role",
    "SchedulerCall",
    "StepPhase",
]


class PublishMode(enum.Enum):
    """When a request's computed full blocks become reusable by others."""

    PER_STEP = "per_step"
    """Every full block as soon as it is computed (incremental publication): with same-step
    sharing a prefill's blocks when the step that computes them is planned, otherwise after
    that step; a decode's after its step."""
    ON_COMPLETION = "on_completion"
    """When the request ends (the baseline). A flight leader still publishes its prompt
    blocks when its prefill completes (or, with same-step sharing, when its last chunk is
    planned): that is what releasing its followers means."""


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
    """Where a request is in the scheduler: exactly one of these (see `TRANSITIONS`)."""

    WAITING = "waiting"
    """A follower waiting in a flight (holds no pages)."""
    QUEUED = "queued"
    """Waiting for admission (holds no pages)."""
    RUNNING = "running"
    """Admitted: holds its page table; prefilling or decoding."""
    ABORTING = "aborting"
    """Aborted while the outstanding step includes it: its report is out, but the backend
    may still be writing its pages, so it holds them (and its id) until that step completes
    or fails."""


class SchedulerCall(enum.Enum):
    """The calls that move requests: the columns of `TRANSITIONS` and `STEP_TRANSITIONS`."""

    ADD_REQUEST = "add_request"
    ABORT = "abort"
    SCHEDULE = "schedule"
    COMPLETE_STEP = "complete_step"
    FAIL_STEP = "fail_step"


class StepPhase(enum.Enum):
    """Whether a step is in flight (`Scheduler.phase`)."""

    IDLE = "idle"
    """No step is outstanding: `Scheduler.schedule` may hand out the next plan."""
    OUTSTANDING = "outstanding"
    """A plan is out: `Scheduler.complete_step` (its result) or `Scheduler.fail_step` (no
    result will come) closes it."""


_WAITING, _QUEUED = RequestState.WAITING, RequestState.QUEUED
_RUNNING, _ABORTING = RequestState.RUNNING, RequestState.ABORTING
_ADD, _ABORT = SchedulerCall.ADD_REQUEST, SchedulerCall.ABORT
_SCHEDULE, _COMPLETE, _FAIL = (
    SchedulerCall.SCHEDULE,
    SchedulerCall.COMPLETE_STEP,
    SchedulerCall.FAIL_STEP,
)
_IDLE, _OUTSTANDING = StepPhase.IDLE, StepPhase.OUTSTANDING

TRANSITIONS: Final[
    Mapping[RequestState | None, Mapping[SchedulerCall, frozenset[RequestState | None]]]
] = {
    # state of a request -> {call: where that request may be afterwards} (None: unknown,
    # never seen or ended). add_request and abort name a request: a pair not listed is
    # rejected with `UsageError` before anything changes. schedule, complete_step and
    # fail_step name none (`STEP_TRANSITIONS` says when they are legal): the row says where
    # every request in that state may go.
    None: {
        _ADD: frozenset({_QUEUED, _WAITING}),  # WAITING: it follows an open flight
        _SCHEDULE: frozenset({None}),  # a step call never brings a request in
        _COMPLETE: frozenset({None}),
        _FAIL: frozenset({None}),
    },
    _WAITING: {
        _ABORT: frozenset({None}),
        # released (its leader's last chunk is planned, or it waited max_wait), then
        # admitted in that same step when pages and budget allow
        _SCHEDULE: frozenset({_WAITING, _QUEUED, _RUNNING}),
        _COMPLETE: frozenset({_WAITING, _QUEUED}),  # its leader finished (or its prefill did)
        _FAIL: frozenset({_WAITING, _QUEUED}),  # its leader failed with the step
    },
    _QUEUED: {
        _ABORT: frozenset({None}),
        _SCHEDULE: frozenset({_QUEUED, _RUNNING}),  # admitted, or still waiting for pages
        _COMPLETE: frozenset({_QUEUED}),
        _FAIL: frozenset({_QUEUED}),
    },
    _RUNNING: {
        _ABORT: frozenset({None, _ABORTING}),  # ABORTING if the outstanding step includes it
        _SCHEDULE: frozenset({_RUNNING}),
        _COMPLETE: frozenset({_RUNNING, None}),  # None: it sampled a stop token or its last
        _FAIL: frozenset({_RUNNING, None}),  # None: the failed step included it (aborted)
    },
    _ABORTING: {
        _COMPLETE: frozenset({None}),  # its pages come back with the step
        _FAIL: frozenset({None}),
    },
}
"""The legal (request state x call) pairs of `Scheduler`, and the states each leads to.

One more move happens outside the named request's row: a request ``WAITING`` in a flight
becomes ``QUEUED`` whenever the `FlightCoordinator` releases or promotes it (its leader
aborted, or it waited ``max_wait``), which any call that carries a time can trigger."""

STEP_TRANSITIONS: Final[Mapping[StepPhase, Mapping[SchedulerCall, frozenset[StepPhase]]]] = {
    # phase -> {legal call: the phase afterwards}; a call not listed raises `UsageError`
    _IDLE: {
        _ADD: frozenset({_IDLE}),
        _ABORT: frozenset({_IDLE}),
        _SCHEDULE: frozenset({_IDLE, _OUTSTANDING}),  # an empty plan is not outstanding
    },
    _OUTSTANDING: {
        _ADD: frozenset({_OUTSTANDING}),
        _ABORT: frozenset({_OUTSTANDING}),
        _COMPLETE: frozenset({_IDLE}),
        _FAIL: frozenset({_IDLE}),
    },
}
"""The legal (step phase x call) pairs of `Scheduler`: one plan at a time."""


class FinishReason(enum.Enum):
    LENGTH = "length"
    """``max_new_tokens`` were sampled."""
    STOP = "stop"
    """A stop token was sampled (it is the last output token)."""
    ABORTED = "aborted"
