"""Executes the core's `StepPlan`s with a Hugging Face causal LM on a `PagedKVPool`.

Prefill: the reused pages ``[0, start)`` are gathered into a transformers ``DynamicCache``,
the chunk ``token_ids`` runs on top of it, and the chunk's new keys and values are written
into the pages that cover ``[start, start + n)``. Decode: every request's context is
gathered into one right-padded batch cache, one token per request runs in one forward pass
with a padding mask and explicit positions, and each new token's KV goes into its page.

Only the public transformers surface is used (``DynamicCache(list_of_kv, config=)``,
``cache.layers[i].keys/values``, the ``cache=`` keyword, ``logits_to_keep``): the simple,
exact path that MODEL.md §6 measured. Keys are stored after rotary embedding, as
transformers caches them, so a gathered prefix is exactly what a full prefill would hold.
"""

from __future__ import annotations

from typing import Any, final

import torch
from prefixflight.core import (
    ConfigError,
    DecodeWork,
    PrefillWork,
    RequestId,
    StepPlan,
    StepResult,
    UsageError,
)
from transformers import DynamicCache

from ._pool import PagedKVPool
from ._sampling import Sampler, SamplingParams

__all__ = ["TransformersRunner"]


@final
class TransformersRunner:
    """Runs `StepPlan`s: prefill over reused pages, batched decode, per-request sampling.

    ``model`` is a transformers causal LM (Llama and Qwen2 families are tested) already on
    the pool's device. Requests without `set_sampling` are sampled greedily. After each
    `execute`, `last_logits` holds the logits each sampled request was sampled from.
    """

    __slots__ = ("_config", "_samplers", "_vocab", "last_logits", "model", "pool")

    def __init__(self, model: Any, pool: PagedKVPool) -> None:
        config = model.config
        param = next(model.parameters())
        if param.device != pool.device and not (
            param.device.type == pool.device.type == "cuda" and pool.device.index is None
        ):
            raise ConfigError(f"model is on {param.device} but the pool is on {pool.device}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        shape = (config.num_hidden_layers, kv_heads, head_dim)
        if shape != (pool.num_layers, pool.num_kv_heads, pool.head_dim):
            raise ConfigError(
                f"pool shape (layers, kv_heads, head_dim) = "
                f"{(pool.num_layers, pool.num_kv_heads, pool.head_dim)} does not fit the "
                f"model's {shape}"
            )
        self.model = model.eval()
        self.pool = pool
        self._config = config
        self._vocab: int = int(config.vocab_size)
        self._samplers: dict[RequestId, Sampler] = {}
        self.last_logits: dict[RequestId, torch.Tensor] = {}

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        num_pages: int,
        page_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> TransformersRunner:
        """Move ``model`` to ``device``/``dtype`` (auto: CUDA if present) and give it a pool."""
        pool = PagedKVPool.for_model(
            model.config, num_pages=num_pages, page_size=page_size, device=device, dtype=dtype
        )
        return cls(model.to(device=pool.device, dtype=pool.dtype), pool)

    # -- per-request sampling state -------------------------------------------------------
    def set_sampling(self, request_id: RequestId, params: SamplingParams) -> None:
        """Sample ``request_id``'s tokens with ``params`` (its own seeded generator)."""
        self._samplers[request_id] = Sampler(params)

    def discard(self, request_id: RequestId) -> None:
        """Forget a finished or aborted request's sampler (unknown ids are ignored)."""
        self._samplers.pop(request_id, None)
        self.last_logits.pop(request_id, None)

    # -- execution -------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan and return the sampled tokens, prefills first, in plan order.

        The whole plan is validated first: a bad plan raises `UsageError` and writes nothing.
        """
        self._validate(plan)
        sampled: list[tuple[RequestId, int]] = []
        logits: dict[RequestId, torch.Tensor] = {}
        with torch.inference_mode():
            for prefill in plan.prefills:
                row = self._prefill(prefill)
                if prefill.sample:
                    logits[prefill.request_id] = row
            if plan.decodes:
                rows = self._decode(plan.decodes)
                for decode, row in zip(plan.decodes, rows, strict=True):
                    logits[decode.request_id] = row
            for rid, row in logits.items():
                sampler = self._samplers.get(rid)
                token = sampler.sample(row) if sampler is not None else int(row.argmax().item())
                sampled.append((rid, token))
        self.last_logits = logits
        return StepResult(step=plan.step, sampled=tuple(sampled))

    def _validate(self, plan: StepPlan) -> None:
        seen: set[RequestId] = set()
        pool = self.pool
        works: tuple[PrefillWork | DecodeWork, ...] = (*plan.prefills, *plan.decodes)
        for work in works:
            rid = work.request_id
            if rid in seen:
                raise UsageError(f"step {plan.step}: request {rid!r} appears twice in the plan")
            seen.add(rid)
            what = f"step {plan.step}, request {rid!r}"
            tokens: tuple[int, ...]
            if isinstance(work, PrefillWork):
                if not work.token_ids:
                    raise UsageError(f"{what}: a prefill needs at least one token")
                if work.start < 0:
                    raise UsageError(f"{what}: prefill start must be >= 0, got {work.start!r}")
                tokens = work.token_ids
                end = work.start + len(tokens)
            else:
                if work.position < 0:
                    raise UsageError(f"{what}: decode position must be >= 0, got {work.position!r}")
                tokens = (work.token_id,)
                end = work.position + 1
            bad = [t for t in tokens if not 0 <= t < self._vocab]
            if bad:
                raise UsageError(f"{what}: token id {bad[0]!r} is not in [0, {self._vocab})")
            pool.check_pages(work.pages, end, what=what)

    def _cache(self, kv: torch.Tensor | None) -> DynamicCache:
        """A ``DynamicCache`` over ``kv`` (``[layers, 2, batch, heads, seq, dim]``) or empty."""
        if kv is None:
            return DynamicCache(config=self._config)
        return DynamicCache([(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])], config=self._config)

    def _prefill(self, work: PrefillWork) -> torch.Tensor:
        pool = self.pool
        start, end = work.start, work.start + len(work.token_ids)
        ctx = None
        if start:
            # [L, 2, start, H, D] -> [L, 2, 1, H, start, D]
            ctx = pool.gather(pool.slots(work.pages, 0, start)).permute(0, 1, 3, 2, 4)[:, :, None]
        cache = self._cache(ctx)
        ids = torch.tensor([work.token_ids], dtype=torch.long, device=pool.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        new = torch.stack(
            [
                torch.stack((layer.keys[0, :, start:], layer.values[0, :, start:]))
                for layer in out.cache.layers
            ]
        )  # [L, 2, H, n, D]
        pool.write(pool.slots(work.pages, start, end), new.transpose(2, 3))
        row: torch.Tensor = out.logits[0, -1]
        return row

    def _decode(self, decodes: tuple[DecodeWork, ...]) -> torch.Tensor:
        pool = self.pool
        dev = pool.device
        batch = len(decodes)
        width = max(d.position for d in decodes)
        ctx = None
        mask = torch.zeros((batch, width + 1), dtype=torch.long, device=dev)
        mask[:, width] = 1
        if width:
            slots = torch.zeros((batch, width), dtype=torch.long, device=dev)
            for i, d in enumerate(decodes):
                if d.position:
                    slots[i, : d.position] = pool.slots(d.pages, 0, d.position)
                    mask[i, : d.position] = 1
            gathered = pool.gather(slots.view(-1))  # [L, 2, B*W, H, D]
            ctx = gathered.view(pool.num_layers, 2, batch, width, pool.num_kv_heads, pool.head_dim)
            ctx = ctx.transpose(3, 4)  # [L, 2, B, H, W, D]
        cache = self._cache(ctx)
        ids = torch.tensor([[d.token_id] for d in decodes], dtype=torch.long, device=dev)
        pos = torch.tensor([[d.position] for d in decodes], dtype=torch.long, device=dev)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        new = torch.stack(
            [
                torch.stack((layer.keys[:, :, width], layer.values[:, :, width]))
                for layer in out.cache.layers
            ]
        )  # [L, 2, B, H, D]
        new_slots = torch.cat([pool.slots(d.pages, d.position, d.position + 1) for d in decodes])
        pool.write(new_slots, new)
        rows: torch.Tensor = out.logits[:, -1]
        return rows
