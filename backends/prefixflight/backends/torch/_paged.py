"""Paged attention over a `PagedKVPool`: one forward pass's rows attend over their pages.

A `PagedStep` describes one forward pass of the paged runner: the pool slot of every new
token (flattened, row after row), each row's position and page table. Every attention layer
calls `PagedStep.attend` with its new queries, keys and values: the keys and values of every
row are written into the pool first (so a row may read pages another row of the same pass
writes), then each row's queries attend over its pages. No per-row Python work in a layer:

- one row (a prompt chunk, or a lone decode): its context is a slice of the pool when its
  pages are consecutive, else one page-granular gather; the queries run in blocks of
  `BLOCK` rows, each block a batched matrix product against the keys it can see (causal
  blocks skip the keys after them), with keys and values read where they lie;
- several rows (decodes and short chunks): one page-granular gather of every row's pages
  into ``[kv_heads, rows, tokens, head_dim]``, and one batched matrix product over all rows
  and KV heads, with each KV head's query heads folded into the rows of its product (no
  repeated keys for grouped-query attention); a precomputed additive mask keeps each query
  on its own row's keys up to its position.

Scores and probabilities are in the queries' dtype (``softmax`` accumulates in fp32), as in
transformers' eager attention. On CPUs this runs on oneDNN's matrix products, which in bf16
are several times faster than torch's fused CPU attention kernel at these sizes (that
kernel computes its blocks in fp32); see docs/performance.md.

The same step serves two forward implementations: the runner's fused forward
(`_fused.FusedForward`, which passes flattened queries) and the model's own modules through
an attention function registered with transformers' ``AttentionInterface`` (padded
``[batch, heads, q, head_dim]`` queries, as in vLLM's transformers backend and
transformers' continuous batching, whose allocator also writes with ``index_copy_`` and
reads with ``index_select``). The registered function falls back to plain ``sdpa`` when a
forward pass carries no step, and the same name is registered in ``AttentionMaskInterface``
with transformers' ``sdpa_mask``, so such a pass gets exactly the masks ``sdpa`` would.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, final

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ._pool import PagedKVPool

__all__ = ["ATTENTION_NAME", "BLOCK", "STEP_KWARG", "PagedStep", "register_paged_attention"]

ATTENTION_NAME = "prefixflight_paged"
STEP_KWARG = "prefixflight_step"
BLOCK = 256
"""Query rows per block of a long chunk's causal attention (256 measured fastest at 900 and
4,000 tokens on 2 cores: larger blocks compute more masked scores, smaller ones more calls)."""


@final
class PagedStep:
    """One forward pass over rows of a `PagedKVPool` (see the module docstring).

    Built from ``rows``, each ``(start, n, pages)``: a chunk of ``n`` new tokens at positions
    ``start ..`` under the page table ``pages``; `tokens` is their total (``T``), in row
    order. Queries are padded to ``[rows, q, ...]`` (each row's chunk right-aligned) only
    when rows differ in length; `real` selects the real ones from the padded ``rows * q``.
    """

    __slots__ = (
        "_allowed",
        "_bias",
        "_dev",
        "_masks",
        "context",
        "last",
        "pages",
        "pool",
        "positions",
        "q",
        "real",
        "rows",
        "span",
        "start",
        "tokens",
        "write",
    )

    def __init__(self, pool: PagedKVPool, rows: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        self.pool = pool
        dev = self._dev = pool.device
        ps = pool.page_size
        self.rows = len(rows)
        lengths = [n for _, n, _ in rows]
        self.tokens = sum(lengths)
        self.q = max(lengths)
        ends = [start + n for start, n, _ in rows]
        need = [-(-e // ps) for e in ends]
        width = max(need)
        table = [
            [*pages[:k]] + [0] * (width - k) for (_, _, pages), k in zip(rows, need, strict=True)
        ]
        tables = torch.tensor(table, dtype=torch.long)  # [rows, pages]
        pos = torch.cat([torch.arange(start, start + n) for start, n, _ in rows])
        row_of = torch.repeat_interleave(torch.arange(self.rows), torch.tensor(lengths))
        self.positions = pos.to(dev)
        self.write = (tables[row_of, pos // ps] * ps + pos % ps).to(dev)
        self.last = (torch.tensor(lengths).cumsum(0) - 1).to(dev)  # each row's last token
        self._bias: dict[torch.dtype, torch.Tensor] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self._allowed: torch.Tensor | None = None
        self.real: torch.Tensor | None = None
        self.span: int | None = None  # first slot of a lone row's consecutive pages
        self.pages: torch.Tensor | None = None
        self.start = rows[0][0] if self.rows == 1 else 0
        self.context = 0  # a lone row's keys: start + n (0: only the new ones)
        if self.rows == 1:
            if self.start:
                self.context = ends[0]
                used = table[0]
                if all(b == a + 1 for a, b in itertools.pairwise(used)):
                    self.span = used[0] * ps
                else:
                    self.pages = tables[0].to(dev)
            return
        self.pages = tables.view(-1).to(dev)
        q = self.q
        if any(n != q for n in lengths):
            flat: list[int] = []
            for i, n in enumerate(lengths):
                flat.extend(range(i * q + q - n, (i + 1) * q))
            self.real = torch.tensor(flat, dtype=torch.long, device=dev)
        # query positions [rows, q], right-aligned; a padding query gets position 0 (it sees
        # key 0 of its row's first page, so no row of scores is empty; its output is dropped)
        qpos = torch.zeros((self.rows, q), dtype=torch.long)
        for i, (start, n, _) in enumerate(rows):
            qpos[i, q - n :] = torch.arange(start, start + n)
        keys = torch.arange(width * ps)
        self._allowed = (keys.view(1, 1, -1) <= qpos.unsqueeze(-1)).to(dev)  # [rows, q, W]

    # -- helpers for the forward passes ----------------------------------------------------
    def padded_inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` and positions as ``[rows, q]`` (right-aligned, zero padding)."""
        return self.pad(ids), self.pad(self.positions)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """The real tokens' ``[T, ...]`` -> ``[rows, q, ...]`` (right-aligned, zero padding)."""
        if self.real is None:
            return flat.view(self.rows, self.q, *flat.shape[1:])
        out = flat.new_zeros((self.rows * self.q, *flat.shape[1:]))
        return out.index_copy_(0, self.real, flat).view(self.rows, self.q, *flat.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``[rows, q, ...]`` -> the real tokens' ``[T, ...]``."""
        flat = padded.reshape(self.rows * self.q, *padded.shape[2:])
        return flat if self.real is None else flat.index_select(0, self.real)

    # -- attention -------------------------------------------------------------------------
    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write ``key``/``value`` (``[T, kv_heads, D]``) into the pool, attend ``query``.

        ``query`` is ``[rows, q, heads, D]`` (padded as `padded_inputs`); returns the
        attention output in the same shape.
        """
        pool = self.pool
        k_pool, v_pool = pool.layer_views(layer)  # [kv_heads, slots, D]
        k_pool.index_copy_(1, self.write, key.transpose(0, 1).to(pool.dtype))
        v_pool.index_copy_(1, self.write, value.transpose(0, 1).to(pool.dtype))
        rows, q, heads, dim = query.shape
        kv_heads = key.shape[1]
        dt = query.dtype
        if self.rows == 1:
            if not self.context:
                keys, values = key.transpose(0, 1), value.transpose(0, 1)  # [kv_heads, n, D]
            elif self.span is not None:
                end = self.span + self.context
                keys, values = k_pool[:, self.span : end], v_pool[:, self.span : end]
            else:
                assert self.pages is not None
                keys = self._gather(k_pool)[:, : self.context]
                values = self._gather(v_pool)[:, : self.context]
            out = self._causal(query[0], keys.to(dt), values.to(dt), scale)
            return out.unsqueeze(0)
        # several rows: [kv_heads, rows, W, D] from their pages, one product over all rows
        group = heads // kv_heads
        assert self._allowed is not None
        width = self._allowed.shape[-1]
        keys = self._gather(k_pool).view(kv_heads * rows, width, dim).to(dt)
        values = self._gather(v_pool).view(kv_heads * rows, width, dim).to(dt)
        qg = (query * scale).reshape(rows, q, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
        scores = torch.bmm(qg.reshape(kv_heads * rows, group * q, dim), keys.transpose(1, 2))
        scores.view(kv_heads, rows, group, q, width).add_(self._bias_of(dt))
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values).view(kv_heads, rows, group, q, dim)
        return out.permute(1, 3, 0, 2, 4).reshape(rows, q, heads, dim)

    def _gather(self, pool_view: torch.Tensor) -> torch.Tensor:
        """This step's pages of one layer's ``[kv_heads, slots, D]``: ``[kv_heads, n, D]``."""
        assert self.pages is not None
        kv_heads, slots, dim = pool_view.shape
        ps = self.pool.page_size
        paged = pool_view.view(kv_heads, slots // ps, ps, dim).index_select(1, self.pages)
        return paged.view(kv_heads, -1, dim)

    def _bias_of(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[1, rows, 1, q, W]`` in ``dtype`` (0 or -inf), built once."""
        bias = self._bias.get(dtype)
        if bias is None:
            allowed = self._allowed
            assert allowed is not None
            bias = torch.zeros(allowed.shape, dtype=dtype, device=self._dev)
            bias.masked_fill_(~allowed, float("-inf"))
            bias = self._bias[dtype] = bias.unsqueeze(0).unsqueeze(2)
        return bias

    def _causal(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """A lone row: ``query [n, heads, D]`` at positions ``start ..`` over ``keys`` and
        ``values [kv_heads, start + n, D]``; causal, in blocks of `BLOCK` query rows."""
        n, heads, dim = query.shape
        kv_heads = keys.shape[0]
        group = heads // kv_heads
        start = self.start
        qs = (query * scale).reshape(n, kv_heads, group, dim)
        if n == 1:  # a decode: every key is visible
            qb = qs.reshape(kv_heads, group, dim)
            probs = torch.softmax(torch.bmm(qb, keys.transpose(1, 2)), dim=-1)
            return torch.bmm(probs, values).view(1, heads, dim)
        out = query.new_empty((n, kv_heads, group, dim))
        for s0 in range(0, n, BLOCK):
            e = min(n, s0 + BLOCK)
            c, kw = e - s0, start + e
            qb = qs[s0:e].permute(1, 2, 0, 3).reshape(kv_heads, group * c, dim)
            scores = torch.bmm(qb, keys[:, :kw].transpose(1, 2))  # [kv_heads, group * c, kw]
            # the block's own keys are the last c columns: query i sees the first i + 1
            own = scores.view(kv_heads, group, c, kw)[..., kw - c :]
            own.masked_fill_(self._upper(c), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            block = torch.bmm(probs, values[:, :kw]).view(kv_heads, group, c, dim)
            out[s0:e] = block.permute(2, 0, 1, 3)
        return out.view(n, heads, dim)

    def _upper(self, c: int) -> torch.Tensor:
        """``[c, c]`` strictly upper triangle (True = masked), built once per size."""
        mask = self._masks.get(c)
        if mask is None:
            mask = self._masks[c] = torch.ones((c, c), dtype=torch.bool, device=self._dev).triu(1)
        return mask


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
    # [rows, heads, q, D] padded -> the real tokens' keys and values, [T, kv_heads, D]
    k = step.unpad(key.transpose(1, 2))
    v = step.unpad(value.transpose(1, 2))
    scale = kwargs.get("scaling")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return step.attend(module.layer_idx, query.transpose(1, 2), k, v, float(scale)), None


_registered = False


def register_paged_attention() -> str:
    """Register the paged attention function and its mask function once; return the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME
