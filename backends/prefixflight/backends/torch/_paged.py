"""Paged attention over a `PagedKVPool`: one forward pass's rows attend over their pages.

A `PagedStep` describes one forward pass of the paged runner: the pool slot of every new
token (flattened, row after row), each row's position and page table. Every attention layer
calls `PagedStep.attend` with its new queries, keys and values: the keys and values of every
row are written into the pool first (so a row may read pages another row of the same pass
writes), then each row's queries attend over its pages. No per-row Python work in a layer:

- one row (a prompt chunk, or a lone decode): its context is a slice of the pool when its
  pages are consecutive, else one page-granular gather. On a CPU, where `FLASH_MIN` says
  so (fp32), torch's fused attention kernel runs it
  without a mask: ``is_causal`` when the row has no cached prefix; otherwise one call over
  the prefix (every query sees all of it) and one causal call over the new tokens, merged
  exactly through the log-sum-exps the kernel returns. Elsewhere the queries run in blocks
  of `BLOCK` rows, each block a batched matrix product against the keys it can see (causal
  blocks skip the keys after them, the block's own triangle is masked);
- several rows (decodes and short chunks): the pages a group of rows starts with (a GRPO
  group's prompt, a shared system prompt) read once per group and multiplied with the
  group's queries, every group in one batched product; one page-granular gather of the rest
  of every row's pages into ``[kv_heads, rows, tokens, head_dim]``, and one batched matrix
  product over all rows and KV heads, with each KV head's query heads folded into the rows
  of its product (no repeated keys for grouped-query attention); a precomputed additive
  mask keeps each query on its own row's keys up to its position. Where `PER_ROW_MIN` says
  so (fp32 rows reading 1,024 keys or more past their group's shared pages) the rows run
  one by one instead, as lone rows through the fused kernel (a decode: one call, no mask):
  in fp32 the batched product of a few query rows per row is up to 3.3x slower there.

In the products, scores and probabilities are in the queries' dtype (``softmax``
accumulates in fp32), as in transformers' eager attention; on CPUs they run on oneDNN's
matrix products, which in bf16 are as fast as torch's fused CPU attention kernel or faster
(it computes its blocks in fp32). In fp32 the kernel is faster: the masked products took
1.4-2.2x its CPU time from 1,024 tokens up. See docs/performance.md.

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
from ._vllm_cpu import VllmCpuAttention

__all__ = ["ATTENTION_NAME", "BLOCK", "STEP_KWARG", "PagedStep", "register_paged_attention"]

ATTENTION_NAME = "prefixflight_paged"
STEP_KWARG = "prefixflight_step"
BLOCK = 256
"""Query rows per block of a long chunk's causal attention (256 measured fastest at 900 and
4,000 tokens on 2 cores: larger blocks compute more masked scores, smaller ones more calls)."""


@final
class _Lone:
    """A row attended on its own: a long chunk (or the step's only row), causal blocks."""

    __slots__ = ("begin", "context", "end", "pages", "per_row", "span", "start")

    def __init__(self, begin: int, end: int, start: int) -> None:
        self.begin, self.end, self.start = begin, end, start
        self.per_row = False  # one of the rows a step would attend together (`PER_ROW_MIN`)
        self.context = 0  # keys read from the pool: start + n (0: only the new ones)
        self.span: int | None = None  # first slot of consecutive pages
        self.pages: torch.Tensor | None = None  # else the pages to gather


@final
class _Batch:
    """Rows attended together: their queries padded to ``[rows, q]`` (right-aligned), one
    page-granular gather, one batched product, an additive mask.

    Rows whose tables start with the same page form a group (the requests of a GRPO group,
    or every chat sharing a system prompt): the pages all of a group's tables start with, up
    to the first query of any of its rows, are its `shared` pages (rows in no group: none).
    Every query of the group sees all of them, so they are read once per group (a slice of
    the pool when there is one group and its pages are consecutive, else one gather for all
    groups) and multiplied with all the group's queries in one product, every group in the
    same batched product (groups padded to the largest, their shared keys to the longest,
    masked); only the rest of each row's pages is gathered per row. Both parts' scores go
    through one softmax, so the result is the same attention.
    """

    __slots__ = (
        "allowed",
        "bias",
        "group_rows",
        "groups",
        "index",
        "pages",
        "q",
        "real",
        "row_slots",
        "rows",
        "shared",
        "shared_bias",
        "shared_pages",
        "shared_seen",
        "shared_span",
    )

    def __init__(
        self,
        rows: Sequence[tuple[int, int]],
        tables: Sequence[Sequence[int]],
        index: torch.Tensor | None,
        block_size: int,
        dev: torch.device,
    ) -> None:
        self.rows = len(rows)
        self.q = q = max(n for _, n in rows)
        self.index = index  # the rows' tokens among the step's (None: all of them, in order)
        groups, counts = _groups(rows, tables, block_size)
        shared = max(counts, default=0)
        of_row = [0] * self.rows  # each row's shared pages
        for g, members in enumerate(groups):
            for i in members:
                of_row[i] = counts[g]
        self.shared = shared  # shared pages of the longest group (0: none)
        self.groups = len(groups)
        self.shared_span: int | None = None
        self.shared_pages: torch.Tensor | None = None
        self.shared_bias: dict[torch.dtype, torch.Tensor] = {}
        self.shared_seen: torch.Tensor | None = None  # [1, groups, 1, shared keys]
        # groups padded to the largest: slot g * most + k is row groups[g][k] (a padding
        # slot repeats the group's first row; its output is never read)
        self.group_rows: torch.Tensor | None = None
        self.row_slots: torch.Tensor | None = None
        if shared:
            self._share(groups, counts, tables, block_size, dev)
        width = max(len(t) - c for t, c in zip(tables, of_row, strict=True))
        rest = [[*t[c:]] + [0] * (width - len(t) + c) for t, c in zip(tables, of_row, strict=True)]
        self.pages = torch.tensor(rest, dtype=torch.long).view(-1).to(dev)
        lengths = [n for _, n in rows]
        self.real = _real(lengths, q, dev) if any(n != q for n in lengths) else None
        # query positions [rows, q]; a padding query gets position 0 (it sees key 0, shared
        # or its row's first page, so no row of scores is empty; its output is dropped)
        qpos = [[0] * (q - n) + list(range(start, start + n)) for start, n in rows]
        columns = torch.arange(width * block_size, device=dev)
        keys = columns + torch.tensor(of_row, device=dev).unsqueeze(-1) * block_size  # [rows, W]
        qp = torch.tensor(qpos, dtype=torch.long, device=dev)
        self.allowed = keys.unsqueeze(1) <= qp.unsqueeze(-1)  # [rows, q, W]
        self.bias: dict[torch.dtype, torch.Tensor] = {}

    def _share(
        self,
        groups: list[list[int]],
        counts: list[int],
        tables: Sequence[Sequence[int]],
        block_size: int,
        dev: torch.device,
    ) -> None:
        """Where the groups' shared pages are read from (one consecutive span, or pages to
        gather, padded to the longest), the rows' slots among the padded groups, and the mask
        of a group's keys past its own shared pages."""
        shared = self.shared
        if len(groups) == 1 and all(b == a + 1 for a, b in itertools.pairwise(tables[0][:shared])):
            self.shared_span = tables[0][0] * block_size
        else:
            padded = [
                [*tables[m[0]][:c]] + [0] * (shared - c)
                for m, c in zip(groups, counts, strict=True)
            ]
            self.shared_pages = torch.tensor(padded, dtype=torch.long, device=dev).view(-1)
        most = max(map(len, groups))
        slots = [m[k] if k < len(m) else m[0] for m in groups for k in range(most)]
        where = [0] * self.rows
        for g, members in enumerate(groups):
            for k, i in enumerate(members):
                where[i] = g * most + k
        if slots != list(range(self.rows)):  # else: one group, rows in order
            self.group_rows = torch.tensor(slots, dtype=torch.long, device=dev)
            self.row_slots = torch.tensor(where, dtype=torch.long, device=dev)
        if min(counts) < shared:  # a group's keys past its shared pages are masked
            cols = torch.arange(shared * block_size, device=dev)
            seen = torch.tensor(counts, device=dev).unsqueeze(-1) * block_size
            self.shared_seen = (cols.unsqueeze(0) < seen).view(
                1, len(groups), 1, shared * block_size
            )

    def bias_of(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[1, rows, 1, q, W]`` in ``dtype`` (0 or -inf), built once."""
        bias = self.bias.get(dtype)
        if bias is None:
            bias = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            bias.masked_fill_(~self.allowed, float("-inf"))
            bias = self.bias[dtype] = bias.unsqueeze(0).unsqueeze(2)
        return bias

    def shared_bias_of(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask ``[1, groups, 1, shared keys]`` of the groups' shared keys
        (None: every group has them all), built once per dtype."""
        seen = self.shared_seen
        if seen is None:
            return None
        bias = self.shared_bias.get(dtype)
        if bias is None:
            bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
            bias = self.shared_bias[dtype] = bias.masked_fill_(~seen, float("-inf"))
        return bias

    def to_groups(self, per_row: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, rows, ...]`` -> ``[kv_heads, groups * largest group, ...]``, each
        group's rows together (as is when there is one group and its rows are in order)."""
        return per_row if self.group_rows is None else per_row.index_select(1, self.group_rows)

    def from_groups(self, grouped: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_groups`: ``[kv_heads, rows, ...]`` in row order."""
        return grouped if self.row_slots is None else grouped.index_select(1, self.row_slots)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        return _pad(flat, self.rows, self.q, self.real)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return _unpad(padded, self.rows, self.q, self.real)


def _groups(
    rows: Sequence[tuple[int, int]], tables: Sequence[Sequence[int]], block_size: int
) -> tuple[list[list[int]], list[int]]:
    """The groups of rows whose tables start with the same page, and each group's shared
    pages: those all its tables start with, up to the first query of any of its rows. Rows
    in no group are one more group, with no shared pages, when any group shares some."""
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        by_first.setdefault(t[0], []).append(i)
    groups = [members for members in by_first.values() if len(members) > 1]
    counts = [0] * len(groups)
    for g, members in enumerate(groups):
        first = tables[members[0]]
        limit = min(
            min(rows[i][0] for i in members) // block_size, *(len(tables[i]) for i in members)
        )
        while counts[g] < limit and all(tables[i][counts[g]] == first[counts[g]] for i in members):
            counts[g] += 1
    alone = [m[0] for m in by_first.values() if len(m) == 1]
    if alone and any(counts):
        groups.append(alone)
        counts.append(0)
    return groups, counts


def _real(lengths: Sequence[int], q: int, dev: torch.device) -> torch.Tensor:
    """Where each row's ``n`` tokens sit among ``rows * q`` padded ones (right-aligned)."""
    flat = [t for i, n in enumerate(lengths) for t in range(i * q + q - n, (i + 1) * q)]
    return torch.tensor(flat, dtype=torch.long, device=dev)


def _pad(flat: torch.Tensor, rows: int, q: int, real: torch.Tensor | None) -> torch.Tensor:
    if real is None:
        return flat.view(rows, q, *flat.shape[1:])
    out = flat.new_zeros((rows * q, *flat.shape[1:]))
    return out.index_copy_(0, real, flat).view(rows, q, *flat.shape[1:])


def _unpad(padded: torch.Tensor, rows: int, q: int, real: torch.Tensor | None) -> torch.Tensor:
    flat = padded.reshape(rows * q, *padded.shape[2:])
    return flat if real is None else flat.index_select(0, real)


@final
class PagedStep:
    """One forward pass over rows of a `PagedKVPool` (see the module docstring).

    Built from ``rows``, each ``(start, n, pages)``: a chunk of ``n`` new tokens at positions
    ``start ..`` under the page table ``pages``; `tokens` is their total (``T``), flattened
    in row order. Rows of ``alone`` tokens or more (and the only row of a one-row pass) are
    attended on their own, in causal blocks; all other rows (decodes, short chunks)
    together, padded to the longest of them.

    For a forward pass over padded inputs (the model's own modules), `padded_inputs`,
    `pad` and `unpad` convert between the flattened tokens and ``[rows, q]`` with every
    row's chunk right-aligned (`real` selects the real tokens of the padded ``rows * q``).
    """

    __slots__ = (
        "_kernel",
        "_lone",
        "_masks",
        "_plan",
        "_rows",
        "_together",
        "_together_lone",
        "_together_rows",
        "last",
        "pool",
        "positions",
        "q",
        "real",
        "rows",
        "tokens",
        "write",
    )

    def __init__(
        self,
        pool: PagedKVPool,
        rows: Sequence[tuple[int, int, Sequence[int]]],
        *,
        alone: int = 64,
        kernel: VllmCpuAttention | None = None,
    ) -> None:
        self.pool = pool
        dev = pool.device
        ps = pool.block_size
        self.rows = len(rows)
        lengths = [n for _, n, _ in rows]
        self.tokens = sum(lengths)
        self.q = q = max(lengths)
        ends = [start + n for start, n, _ in rows]
        need = [-(-e // ps) for e in ends]
        table = [[*pages[:k]] for (_, _, pages), k in zip(rows, need, strict=True)]
        # plain Python for the index lists (a step has few rows; a long chunk's slots are
        # one pass over its positions), then one tensor each
        positions: list[int] = []
        write: list[int] = []
        for (start, n, _), pages in zip(rows, table, strict=True):
            span = range(start, start + n)
            positions.extend(span)
            write.extend(pages[p // ps] * ps + p % ps for p in span)
        self.positions = torch.tensor(positions, dtype=torch.long, device=dev)
        self.write = torch.tensor(write, dtype=torch.long, device=dev)
        offsets = [0, *itertools.accumulate(lengths)]
        self.last = torch.tensor([o - 1 for o in offsets[1:]], dtype=torch.long, device=dev)
        self.real: torch.Tensor | None = None
        if any(n != q for n in lengths):
            self.real = _real(lengths, q, dev)
        self._masks: dict[int, torch.Tensor] = {}
        self._lone: list[_Lone] = []
        self._together: _Batch | None = None
        self._together_lone: list[_Lone] | None = None
        # (begin, end, start, pages) of every row, for rows made lone later (`_as_lone`)
        self._rows = [
            (offsets[i], offsets[i + 1], start, table[i]) for i, (start, _, _) in enumerate(rows)
        ]
        self._together_rows: list[int] = []
        self._kernel = kernel
        self._plan = None if kernel is None else kernel.plan(offsets, ends, table, self.write)
        if kernel is not None:  # vLLM's kernel attends every row: nothing to plan here
            return
        together: list[int] = []
        for i, (_, n, _) in enumerate(rows):
            if self.rows > 1 and (n < alone or n == 1):
                together.append(i)
                continue
            self._lone.append(self._as_lone(i))
        self._together_rows = together
        if together:
            index = None
            if len(together) < self.rows:
                picked = [t for i in together for t in range(offsets[i], offsets[i + 1])]
                index = torch.tensor(picked, dtype=torch.long, device=dev)
            self._together = _Batch(
                [(rows[i][0], rows[i][1]) for i in together],
                [table[i] for i in together],
                index,
                ps,
                dev,
            )

    def _as_lone(self, i: int) -> _Lone:
        """Row ``i`` attended on its own."""
        begin, end, start, used = self._rows[i]
        lone = _Lone(begin, end, start)
        if start:
            lone.context = start + end - begin
            if all(b == a + 1 for a, b in itertools.pairwise(used)):
                lone.span = used[0] * self.pool.block_size
            else:
                lone.pages = torch.tensor(used, dtype=torch.long, device=self.pool.device)
        return lone

    # -- helpers for a forward pass over padded inputs ------------------------------------
    def padded_inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` and positions as ``[rows, q]`` (right-aligned, zero padding)."""
        return self.pad(ids), self.pad(self.positions)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """The tokens' ``[T, ...]`` -> ``[rows, q, ...]`` (right-aligned, zero padding)."""
        return _pad(flat, self.rows, self.q, self.real)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``[rows, q, ...]`` -> the real tokens' ``[T, ...]``."""
        return _unpad(padded, self.rows, self.q, self.real)

    # -- attention -------------------------------------------------------------------------
    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write ``key``/``value`` (``[T, kv_heads, D]``) into the pool, attend ``query``
        (``[T, heads, D]``); returns the attention output ``[T, heads, D]``."""
        pool = self.pool
        k_pool, v_pool = pool.layer_views(layer)  # [kv_heads, slots, D]
        k_pool.index_copy_(1, self.write, key.transpose(0, 1).to(pool.dtype))
        v_pool.index_copy_(1, self.write, value.transpose(0, 1).to(pool.dtype))
        if self._kernel is not None:
            assert self._plan is not None
            return self._kernel.attend(self._plan, layer, query, key, value, scale).to(query.dtype)
        together = self._together
        lones = self._lone
        if together is not None and self._per_row(together, query):
            if self._together_lone is None:
                self._together_lone = [self._as_lone(i) for i in self._together_rows]
                for lone in self._together_lone:
                    lone.per_row = True
            lones, together = [*lones, *self._together_lone], None
        if together is not None and not lones:
            return self._batched(together, query, k_pool, v_pool, scale)
        if together is None and len(lones) == 1:
            return self._alone(lones[0], query, key, value, k_pool, v_pool, scale)
        out = torch.empty_like(query)
        for lone in lones:
            b, e = lone.begin, lone.end
            out[b:e] = self._alone(lone, query[b:e], key[b:e], value[b:e], k_pool, v_pool, scale)
        if together is not None:
            assert together.index is not None
            part = self._batched(
                together, query.index_select(0, together.index), k_pool, v_pool, scale
            )
            out.index_copy_(0, together.index, part)
        return out

    def _per_row(self, batch: _Batch, query: torch.Tensor) -> bool:
        """Whether the batched rows run one by one through the fused kernel instead: where
        `PER_ROW_MIN` says so for the dtype, when the keys each row reads on its own (past
        the shared pages) are that many or more."""
        least = PER_ROW_MIN.get(query.dtype)
        return (
            least is not None
            and batch.allowed.shape[-1] >= least
            and query.device.type == "cpu"
            and _FLASH is not None
            and self.pool.dtype == query.dtype
        )

    def _alone(
        self,
        lone: _Lone,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        dt = query.dtype
        if not lone.context:
            keys, values = key.transpose(0, 1), value.transpose(0, 1)  # [kv_heads, n, D]
        elif lone.span is not None:
            end = lone.span + lone.context
            keys, values = k_pool[:, lone.span : end], v_pool[:, lone.span : end]
        else:
            assert lone.pages is not None
            keys = _gather(k_pool, lone.pages, self.pool.block_size)[:, : lone.context]
            values = _gather(v_pool, lone.pages, self.pool.block_size)[:, : lone.context]
        keys, values = keys.to(dt), values.to(dt)
        if (query.shape[0] > 1 or lone.per_row) and _flash_fits(query, keys):
            return _flash(query, keys, values, lone.start, scale)
        return self._causal(query, keys, values, lone.start, scale)

    def _batched(
        self,
        batch: _Batch,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Several rows: ``[kv_heads, rows, W, D]`` from their pages, one product over all
        rows, each KV head's query heads folded into its rows (each group's shared pages:
        one product over the group's queries, every group in one batched product)."""
        _, heads, dim = query.shape
        kv_heads = k_pool.shape[0]
        group = heads // kv_heads
        rows, q = batch.rows, batch.q
        dt = query.dtype
        ps = self.pool.block_size
        width = batch.allowed.shape[-1]
        keys = _gather(k_pool, batch.pages, ps).view(kv_heads * rows, width, dim).to(dt)
        values = _gather(v_pool, batch.pages, ps).view(kv_heads * rows, width, dim).to(dt)
        qp = batch.pad(query * scale if scale != 1.0 else query)  # [rows, q, heads, D]
        qg = qp.view(rows, q, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
        qg = qg.reshape(kv_heads, rows * group * q, dim)  # [kv_heads, rows * group * q, D]
        own = torch.bmm(qg.view(kv_heads * rows, group * q, dim), keys.transpose(1, 2))
        own.view(kv_heads, rows, group, q, width).add_(batch.bias_of(dt))
        if not batch.shared:
            probs = torch.softmax(own, dim=-1)
            out = torch.bmm(probs, values).view(kv_heads, rows, group, q, dim)
            return batch.unpad(out.permute(1, 3, 0, 2, 4).reshape(rows, q, heads, dim))
        wide = batch.shared * ps
        groups = batch.groups
        if batch.shared_span is not None:
            first = batch.shared_span
            s_keys, s_values = k_pool[:, first : first + wide], v_pool[:, first : first + wide]
        else:
            assert batch.shared_pages is not None
            s_keys = _gather(k_pool, batch.shared_pages, ps)  # [kv_heads, groups * wide, D]
            s_values = _gather(v_pool, batch.shared_pages, ps)
        s_keys = s_keys.to(dt).reshape(kv_heads * groups, wide, dim)
        s_values = s_values.to(dt).reshape(kv_heads * groups, wide, dim)
        per_row = batch.to_groups(qg.view(kv_heads, rows, group * q, dim))
        slots = per_row.shape[1]
        shared = torch.bmm(per_row.reshape(kv_heads * groups, -1, dim), s_keys.transpose(1, 2))
        s_bias = batch.shared_bias_of(dt)
        if s_bias is not None:
            shared.view(kv_heads, groups, -1, wide).add_(s_bias)
        shared = batch.from_groups(shared.view(kv_heads, slots, group * q, wide))
        scores = torch.cat(
            (
                shared.reshape(kv_heads, rows * group * q, wide),
                own.view(kv_heads, rows * group * q, width),
            ),
            dim=-1,
        )
        probs = torch.softmax(scores, dim=-1)
        p_shared = batch.to_groups(probs[..., :wide].view(kv_heads, rows, group * q, wide))
        out = torch.bmm(p_shared.reshape(kv_heads * groups, -1, wide), s_values)
        out = batch.from_groups(out.view(kv_heads, slots, group * q, dim))
        out = out.reshape(kv_heads * rows, group * q, dim)
        out.baddbmm_(probs[..., wide:].reshape(kv_heads * rows, group * q, width), values)
        out = out.view(kv_heads, rows, group, q, dim)
        return batch.unpad(out.permute(1, 3, 0, 2, 4).reshape(rows, q, heads, dim))

    def _causal(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """One row: ``query [n, heads, D]`` at positions ``start ..`` over ``keys`` and
        ``values [kv_heads, start + n, D]``; causal, in blocks of `BLOCK` query rows."""
        n, heads, dim = query.shape
        kv_heads = keys.shape[0]
        group = heads // kv_heads
        qs = (query * scale if scale != 1.0 else query).reshape(n, kv_heads, group, dim)
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
            own.masked_fill_(self._upper(c, query.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            block = torch.bmm(probs, values[:, :kw]).view(kv_heads, group, c, dim)
            out[s0:e] = block.permute(2, 0, 1, 3)
        return out.view(n, heads, dim)

    def _upper(self, c: int, dev: torch.device) -> torch.Tensor:
        """``[c, c]`` strictly upper triangle (True = masked), built once per size."""
        mask = self._masks.get(c)
        if mask is None:
            mask = self._masks[c] = torch.ones((c, c), dtype=torch.bool, device=dev).triu(1)
        return mask


_FLASH: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_MIN = {torch.float32: 0}
"""Per dtype, the fewest keys (cached and new) over which a lone row of two or more queries
runs torch's fused CPU attention kernel (`_flash`) instead of the blocked products of
`PagedStep._causal`; a dtype not here: always the products. Measured on 2 AVX-512 cores
(benchmarks/engine/attention_flash.py, docs/performance.md): in fp32 the kernel is faster at
every size from 1,024 tokens (1.4-2.2x CPU time on the attention call); in bf16 it computes
in fp32 while the products run at oneDNN's bf16 rate, and with SmolLM2's heads the products
were faster up to 8,192 keys (the kernel 0.63-0.75x), so bf16 keeps the products."""


PER_ROW_MIN = {torch.float32: 1024}
"""Per dtype, the fewest keys per row (past its group's shared pages) from which the rows a
step would attend together (decodes, short chunks) each run alone through the fused kernel
instead (`_flash`; a decode: one call without a mask); a dtype not here: always together.
Measured (CPU time per layer, SmolLM2's heads, rows without shared pages): in fp32 32
decode rows at 2,000-2,031 keys took 24 ms one by one against 81 ms together, 8 rows at
4,000-4,007 keys 12.8 against 13.3 ms, 32 rows at 500 keys 8.6 against 6.9 ms (so below
1,024 keys they stay together); in bf16 together was 5-6x faster at every size."""


def _flash_fits(query: torch.Tensor, keys: torch.Tensor) -> bool:
    least = FLASH_MIN.get(query.dtype)
    return (
        least is not None
        and keys.shape[1] >= least
        and query.device.type == "cpu"
        and _FLASH is not None
        and keys.dtype == query.dtype
    )


def _flash(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """One row, no mask: ``query [n, heads, D]`` at positions ``start ..`` over ``keys`` and
    ``values [kv_heads, start + n, D]`` through torch's fused CPU attention kernel (which
    takes grouped-query keys as they are). Without a cached prefix: one causal call. With
    one: the prefix (every query sees all of it, no mask) and the new tokens (causal) are
    two calls, merged exactly through their log-sum-exps: ``out = o2 + (o1 - o2) *
    sigmoid(lse1 - lse2)``, in fp32."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, n, D] (a view)
    k, v = keys.unsqueeze(0), values.unsqueeze(0)
    if query.shape[0] == 1:  # a decode sees every key: no mask, one call
        one: torch.Tensor = _FLASH(q, k, v, scale=scale)[0]
        return one[0].transpose(0, 1)
    if not start:
        out: torch.Tensor = _FLASH(q, k, v, is_causal=True, scale=scale)[0]
        return out[0].transpose(0, 1)  # [n, heads, D]
    o1, l1 = _FLASH(q, k[:, :, :start], v[:, :, :start], scale=scale)
    o2, l2 = _FLASH(q, k[:, :, start:], v[:, :, start:], is_causal=True, scale=scale)
    w = torch.sigmoid(l1[0] - l2[0]).transpose(0, 1).unsqueeze(-1)  # [n, heads, 1]
    a, b = o1[0].transpose(0, 1), o2[0].transpose(0, 1)
    if a.dtype != torch.float32:
        a, b = a.float(), b.float()
    merged = torch.lerp(b, a, w)
    return merged if merged.dtype == query.dtype else merged.to(query.dtype)


def _gather(pool_view: torch.Tensor, pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole pages of one layer's ``[kv_heads, slots, D]``: ``[kv_heads, pages * size, D]``."""
    kv_heads, slots, dim = pool_view.shape
    paged = pool_view.view(kv_heads, slots // block_size, block_size, dim)
    return paged.index_select(1, pages).view(kv_heads, -1, dim)


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
    # [rows, heads, q, D] padded -> the real tokens' [T, heads, D], and back
    q, k, v = (step.unpad(x.transpose(1, 2)) for x in (query, key, value))
    scale = kwargs.get("scaling")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return step.pad(step.attend(module.layer_idx, q, k, v, float(scale))), None


_registered = False


def register_paged_attention() -> str:
    """Register the paged attention function and its mask function once; return the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME
