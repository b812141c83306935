"""Per-request sampling: greedy, temperature, top-k, top-p, min-tokens, a seed per request.

Followers of one flight share a prompt's KV but not their answers: each request samples
with its own settings and its own random generator, so its tokens do not depend on which
other requests happen to share its batch.

Every accepted parameter is one the sampler can compute: a temperature below
`GREEDY_BELOW` is greedy (as vLLM's ``SamplingParams`` treats temperatures under its
``_SAMPLING_EPS``), so logits are never divided into infinities, and top-p always keeps the
most likely token, so the distribution sampled from is never empty, whatever ``top_p`` is.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import final

import attrs
import torch

from prefixflight.core import ConfigError

__all__ = ["GREEDY_BELOW", "Sampler", "SamplingParams"]

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy: vLLM's ``_SAMPLING_EPS``. Above it, float32 logits
divided by the temperature stay finite (|logit| < 3e33)."""


def _check_temperature(_i: object, _a: object, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise ConfigError(f"temperature must be a number >= 0, got {value!r}")


def _check_top_p(_i: object, _a: object, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {value!r}")


def _check_nonneg_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")


def _check_top_k(_i: object, _a: object, value: int) -> None:
    _check_nonneg_int("top_k", value)


def _check_max_tokens(_i: object, _a: object, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_tokens must be an int >= 1, got {value!r}")


def _check_seed(_i: object, _a: object, value: int | None) -> None:
    if value is not None:
        _check_nonneg_int("seed", value)


def _check_bool(_i: object, a: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{a.name} must be a bool, got {value!r}")


def _check_stop(_i: object, _a: object, value: tuple[int, ...]) -> None:
    for t in value:
        _check_nonneg_int("stop_token_ids item", t)


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _check_min_tokens(instance: SamplingParams, _a: object, value: int) -> None:
    _check_nonneg_int("min_tokens", value)
    if value > instance.max_tokens:
        raise ConfigError(f"min_tokens ({value}) must be <= max_tokens ({instance.max_tokens})")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature=0`` is greedy (the default), and so is any temperature below
    `GREEDY_BELOW`. Otherwise logits are divided by the temperature, restricted to the
    ``top_k`` most likely tokens (0: no limit) and to the smallest set whose probability
    reaches ``top_p`` (never less than the most likely token), and sampled with a generator
    seeded by ``seed`` (random when ``None``). Generation stops after ``max_tokens`` tokens or
    at a token in ``stop_token_ids`` (which is emitted); an engine also stops at its
    tokenizer's end-of-sequence token unless ``ignore_eos`` (vLLM's name for the same
    switch). The first ``min_tokens`` tokens are never a stop token: an engine hands its
    sampler the whole stop set (``stop_token_ids`` and, unless ``ignore_eos``, the
    end-of-sequence tokens), and the sampler leaves those tokens out until then (vLLM's
    ``min_tokens``).
    """

    max_tokens: int = attrs.field(default=16, validator=_check_max_tokens)
    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_int_tuple, validator=_check_stop
    )
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    min_tokens: int = attrs.field(default=0, validator=_check_min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@final
class Sampler:
    """Picks one request's tokens from its logits; owns the request's random generator."""

    __slots__ = ("_generator", "_held", "_sampled", "params")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._sampled = 0
        # the tokens left out while fewer than min_tokens were sampled
        self._held: list[int] = sorted(set(params.stop_token_ids)) if params.min_tokens else []

    def sample(self, logits: torch.Tensor) -> int:
        """One token id from ``logits`` (``[vocab]``, any device and dtype)."""
        p = self.params
        self._sampled += 1
        if self._held:
            if self._sampled > p.min_tokens:
                self._held = []
            else:
                held = [t for t in self._held if t < logits.shape[-1]]
                if len(held) < logits.shape[-1]:  # never leave nothing to sample
                    logits = logits.index_fill(
                        -1, torch.tensor(held, device=logits.device), float("-inf")
                    )
        if self._generator is None:
            return int(torch.argmax(logits).item())
        x = logits.detach().to(device="cpu", dtype=torch.float32) / p.temperature
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop a token when the tokens before it already reach top_p; the most likely
            # token is always kept (a top_p below float32's smallest number rounds to 0)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            drop[0] = False
            x = x.index_fill(0, order[drop], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
