"""The contract between the pure scheduler and a backend that runs a model.

Per step the scheduler hands out a `StepPlan`; the host runs it on a backend (for example
``prefixflight.backends.torch``) and reports a `StepResult`. Pages are indices into the
backend's KV pool; the core decides which page holds what, the backend only stores and
gathers. Positions ``[0, start)`` of a prefill (or ``[0, position)`` of a decode) are already
in the listed pages; the work writes KV for its own positions into the pages that cover them.
Pages written by a step are never shared with another request during that step.
"""

from __future__ import annotations

from typing import TypeAlias, final

import attrs

__all__ = ["DecodeWork", "PrefillWork", "RequestId", "StepPlan", "StepResult"]

RequestId: TypeAlias = int | str
"""Request ids are the host's; the core never invents them."""


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


@final
@attrs.frozen(kw_only=True)
class StepResult:
    """What the backend computed: the token sampled for every prefill with ``sample=True``
    and for every decode of the plan, as ``(request_id, token_id)`` pairs."""

    step: int
    sampled: tuple[tuple[RequestId, int], ...] = ()
