"""Paged attention over a `PagedKVPool`, registered through transformers' `AttentionInterface`.

The runner's paged path runs the model without any transformers cache. Each attention layer
receives the step's new keys and values (after rotary embedding), writes them straight into
the pool's slots for that layer, reads every row's context plus its new tokens back from
the pool with one ``index_select`` (or a plain slice when a row's pages are consecutive),
and attends with transformers' own ``sdpa_attention_forward`` under the step's mask. No
whole-context gather into a ``DynamicCache``, no ``DynamicCache`` concatenation, and no
separate write of the new KV after the pass.

This is the index-based scheme of transformers' continuous batching (its full-attention
cache allocator writes with ``index_copy_`` and reads with ``index_select`` per layer,
``generation/continuous_batching/cache_allocators/full_attention.py``) and of vLLM's
transformers backend (an attention function registered under a custom name); the layout
here is ours: rows right-padded to the step's widest context, queries right-aligned, as
in the gather path, so both paths attend over identical keys under identical masks.

The registered function falls back to plain ``sdpa`` when a forward pass carries no step
(the same model can still be used with a ``DynamicCache``), and the same name is
registered in ``AttentionMaskInterface`` with transformers' ``sdpa_mask``, so such a pass
gets exactly the masks ``sdpa`` would.
"""

from __future__ import annotations

from typing import Any, final

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ._pool import PagedKVPool

__all__ = ["ATTENTION_NAME", "STEP_KWARG", "PagedStep", "register_paged_attention"]

ATTENTION_NAME = "prefixflight_paged"
STEP_KWARG = "prefixflight_step"


@final
class PagedStep:
    """What one forward pass's attention layers need to use the pool directly.

    - ``write``: the slot of each real query token, in flattened ``[batch * q]`` order of
      the real tokens; ``real`` selects those tokens from the flattened queries (None: every
      query is real, no padding).
    - ``read``: ``[batch * width]`` slots each row attends over (context, then its chunk), or
      ``span`` ``(first_slot, width)`` when one row's slots are consecutive (a slice, no
      copy), or neither when no row has context (the new keys are all there is).
    - ``mask``: the ``[batch, 1, q, width]`` boolean mask, or None for plain causal attention
      (one row, keys = queries, or a single query).
    """

    __slots__ = ("mask", "pool", "read", "real", "span", "width", "write")

    def __init__(
        self,
        pool: PagedKVPool,
        *,
        write: torch.Tensor,
        real: torch.Tensor | None,
        read: torch.Tensor | None,
        span: tuple[int, int] | None,
        width: int,
        mask: torch.Tensor | None,
    ) -> None:
        self.pool = pool
        self.write = write
        self.real = real
        self.read = read
        self.span = span
        self.width = width
        self.mask = mask

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new ``[B, H, q, D]`` keys/values, return ``[B, H, width, D]``."""
        k_pool, v_pool = self.pool.layer_views(layer)  # [slots, H, D] each
        batch, heads, q, dim = key.shape
        for new, dst in ((key, k_pool), (value, v_pool)):
            flat = new.transpose(1, 2).reshape(batch * q, heads, dim)
            if self.real is not None:
                flat = flat.index_select(0, self.real)
            dst.index_copy_(0, self.write, flat.to(dst.dtype))
        if self.span is not None:
            first, width = self.span
            k = k_pool[first : first + width].unsqueeze(0).transpose(1, 2)
            v = v_pool[first : first + width].unsqueeze(0).transpose(1, 2)
        elif self.read is not None:
            shape = (batch, self.width, heads, dim)
            k = k_pool.index_select(0, self.read).view(shape).transpose(1, 2)
            v = v_pool.index_select(0, self.read).view(shape).transpose(1, 2)
        else:
            return key, value
        return k.to(key.dtype), v.to(value.dtype)


def paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``prefixflight_paged``."""
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:  # a plain forward (e.g. with a DynamicCache): exactly sdpa
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )
        return out
    assert isinstance(step, PagedStep)
    key, value = step.update(module.layer_idx, key, value)
    out = sdpa_attention_forward(module, query, key, value, step.mask, **kwargs)
    return out


_registered = False


def register_paged_attention() -> str:
    """Register the paged attention function and its mask function once; return the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME
