"""The contract between the pure scheduler and a backend that runs a model.

Per step the scheduler hands out a `StepPlan`; the host runs it on a backend (for example
``prefixflight.backends.torch``) and reports a `StepResult`. Pages are indices into the
backend's KV pool; the core decides which page holds what, the backend only stores and
gathers. The work of a step writes KV for its own positions into the pages that cover them.
Positions ``[0, start)`` of a prefill (or ``[0, position)`` of a decode) are in the listed
pages: computed by an earlier step, or, for a prefill whose `PrefillWork.reads_from` names
other requests, written by those requests' prefills in this same step (same-step sharing).

The backend's one ordering duty follows from that: a row that reads pages written in the
same step attends only after its writers have written them. A backend that writes every
row's new keys and values in a layer before any row attends in that layer (vLLM does; so
does the torch backend's paged attention) meets it within one forward pass; otherwise the
writers' rows run in an earlier pass. Apart from those declared reads, a page written by a
step is used by no other request of that step.
"""

from __future__ import annotations

from typing import Any, cast, final

import attrs

from .._errors import UsageError
from .._ids import RequestId
from ..validate import check_instance, check_request_id, check_token_ids, int_field

__all__ = ["DecodeWork", "PrefillWork", "RequestId", "StepPlan", "StepResult"]


@final
@attrs.frozen(kw_only=True)
class PrefillWork:
    """Compute ``token_ids`` at positions ``start .. start + len(token_ids) - 1``."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    """Page table of the request covering at least ``[0, start + len(token_ids))``; reused
    (cached) pages first."""
    sample: bool
    """True when this chunk ends the prompt: sample the request's first output token."""
    reads_from: tuple[RequestId, ...] = ()
    """Requests whose prefill comes earlier in this plan and writes some of this request's
    context pages ``[0, start)`` in this same step (same-step sharing): the backend writes
    their KV, layer by layer, before this request attends. Empty: the context was computed
    by earlier steps."""


@final
@attrs.frozen(kw_only=True)
class DecodeWork:
    """Compute one token (the last one sampled) at ``position`` and sample the next."""

    request_id: RequestId
    token_id: int
    position: int
    pages: tuple[int, ...]
    """Page table covering at least ``[0, position + 1)``."""


@final
@attrs.frozen(kw_only=True)
class StepPlan:
    """What to run in one forward pass (a batch of prefill chunks and decodes)."""

    step: int
    prefills: tuple[PrefillWork, ...] = ()
    decodes: tuple[DecodeWork, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    def sampling_ids(self) -> list[RequestId]:
        """The requests that sample a token in this step, in plan order: every prefill that
        ends its prompt, then every decode."""
        out = [p.request_id for p in self.prefills if p.sample]
        out.extend(d.request_id for d in self.decodes)
        return out


def _check_sampled(inst: StepResult, _attribute: Any, value: object) -> None:
    """``sampled`` is a tuple of ``(request_id, token_id)`` pairs, each id at most once."""
    step = inst.step
    check_instance(f"step {step}: sampled", value, tuple, error=UsageError)
    seen: set[RequestId] = set()
    for pair in cast("tuple[object, ...]", value):
        try:
            check_instance("entry", pair, tuple, error=UsageError)
            if len(cast("tuple[object, ...]", pair)) != 2:
                raise UsageError("not a pair")
            rid = cast("tuple[RequestId, int]", pair)[0]
            check_request_id("request_id", rid)
        except UsageError:
            raise UsageError(
                f"step {step}: sampled entries must be (request_id, token), got {pair!r}"
            ) from None
        if rid in seen:
            raise UsageError(f"step {step}: request {rid!r} sampled twice")
        seen.add(rid)
    _check_tokens(step, cast("tuple[tuple[RequestId, int], ...]", value), None)


def _check_tokens(
    step: int, sampled: tuple[tuple[RequestId, int], ...], vocab_size: int | None
) -> None:
    """Every sampled id is a token id (below ``vocab_size`` if given), naming the request."""
    try:
        check_token_ids("sampled", [tok for _, tok in sampled], vocab_size=vocab_size, minimum=0)
    except UsageError as exc:
        for rid, tok in sampled:  # name the request, not only the index
            try:
                check_token_ids("sampled", (tok,), vocab_size=vocab_size, minimum=0)
            except UsageError:
                raise UsageError(f"step {step}: request {rid!r}: {exc}") from None
        raise  # pragma: no cover  # one of them failed above


@final
@attrs.frozen(kw_only=True)
class StepResult:
    """What the backend computed: the token sampled for every prefill with ``sample=True``
    and for every decode of the plan, as ``(request_id, token_id)`` pairs.

    Checked when made: ``step`` is an int >= 0, every entry a pair of a request id and a
    token id (an int in ``[0, 2**63)``), no request twice. `tokens_for` checks it against
    the plan it answers.
    """

    step: int = attrs.field(validator=int_field(0, error=UsageError))
    sampled: tuple[tuple[RequestId, int], ...] = attrs.field(default=(), validator=_check_sampled)

    def tokens_for(self, plan: StepPlan, *, vocab_size: int | None = None) -> dict[RequestId, int]:
        """The sampled token of each request of ``plan`` that samples (see
        `StepPlan.sampling_ids`), once the result is checked to answer exactly that plan:
        the same step, exactly those requests, token ids below ``vocab_size`` if given.
        Raises `UsageError` naming the first mismatch."""
        if self.step != plan.step:
            raise UsageError(f"result is for step {self.step!r}, the plan is step {plan.step}")
        sampled = dict(self.sampled)
        expected = set(plan.sampling_ids())
        if sampled.keys() != expected:
            missing = sorted(map(repr, expected - sampled.keys()))
            extra = sorted(map(repr, sampled.keys() - expected))
            raise UsageError(
                f"step {plan.step}: sampled ids do not match the plan "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        if vocab_size is not None:
            _check_tokens(plan.step, self.sampled, vocab_size)
        return sampled
