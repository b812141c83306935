"""A paged KV pool: every layer's keys and values in one preallocated tensor.

The pool only stores and gathers. Which page holds which tokens is decided by the core
(`PrefixCache` pages, `StepPlan` page tables); a page table maps a request's position ``p``
to slot ``pages[p // block_size] * block_size + p % block_size``.

Layout: ``[layers, 2, kv_heads, num_pages * block_size, head_dim]`` (2 = keys, values),
head-major like vLLM's CPU cache: within one layer and head a page is one contiguous run of
``block_size * head_dim`` values, so the paged attention gathers whole pages (one index per
page, not per token) into ``[kv_heads, rows, tokens, head_dim]``, the layout its batched
matrix products read without another copy. Writing a request's new tokens into their pages
and gathering a request's context are still one ``index_copy_`` and one ``index_select``
over all layers at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, final

import torch

from prefixflight.core import CapacityError, UsageError
from prefixflight.core.validate import check_int, renamed, renamed_attribute

from ._device import resolve_device, resolve_dtype

__all__ = ["PagedKVPool"]


@final
class PagedKVPool:
    """Preallocated KV storage for ``num_pages`` pages of ``block_size`` tokens.

    ``device`` defaults to CUDA when available, else CPU; ``dtype`` to bf16 on CUDA and on
    CPUs with native bf16, else fp32. ``page_size`` is the deprecated name of ``block_size``.
    """

    __slots__ = (
        "_followers",
        "_kv",
        "block_size",
        "device",
        "dtype",
        "head_dim",
        "num_kv_heads",
        "num_layers",
        "num_pages",
        "version",
    )

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        block_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        page_size: int | None = None,
    ) -> None:
        block_size = renamed(
            "PagedKVPool", "page_size", page_size, "block_size", block_size, block_size != 16
        )
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.version = 0  # bumped by every write and copy: cached gathers compare it
        self._followers: list[Callable[[torch.Tensor], None]] = []
        shape = (num_layers, 2, num_kv_heads, num_pages * block_size, head_dim)
        try:
            self._kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch raises RuntimeError (or OOM error)
            raise CapacityError(
                f"cannot allocate {num_pages} pages of {block_size} tokens "
                f"({_bytes(shape, self.dtype) / 2**20:.0f} MiB): {exc}"
            ) from None

    @classmethod
    def for_model(
        cls,
        config: Any,
        *,
        num_pages: int,
        block_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        page_size: int | None = None,
    ) -> PagedKVPool:
        """A pool shaped for a transformers model config (Llama, Qwen2 and alike)."""
        block_size = renamed(
            "PagedKVPool", "page_size", page_size, "block_size", block_size, block_size != 16
        )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            num_pages=num_pages,
            block_size=block_size,
            device=device,
            dtype=dtype,
        )

    page_size = renamed_attribute("PagedKVPool", "page_size", "block_size")

    # -- sizes -----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self._kv.element_size()

    @property
    def nbytes(self) -> int:
        return self._kv.numel() * self._kv.element_size()

    def __repr__(self) -> str:
        return (
            f"PagedKVPool(num_pages={self.num_pages}, block_size={self.block_size}, "
            f"layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"device={self.device}, dtype={self.dtype}, {self.nbytes / 2**20:.0f} MiB)"
        )

    # -- addressing ------------------------------------------------------------------------
    def check_pages(self, pages: Sequence[int], length: int, *, what: str = "request") -> None:
        """Raise `UsageError` unless ``pages`` are valid pages covering ``length`` tokens."""
        need = -(-length // self.block_size)
        if len(pages) < need:
            raise UsageError(
                f"{what}: {len(pages)} pages cover {len(pages) * self.block_size} tokens, "
                f"need {length}"
            )
        for p in pages[:need]:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_pages:
                raise UsageError(f"{what}: page {p!r} is not in [0, {self.num_pages})")

    def slots(self, pages: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Slot indices of positions ``[start, stop)`` under the page table ``pages``."""
        ps = self.block_size
        pos = torch.arange(start, stop)
        table = torch.as_tensor(pages[: -(-stop // ps)], dtype=torch.long)
        return (table[pos // ps] * ps + pos % ps).to(self.device)

    # -- data ------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` (``[layers, 2, n, kv_heads, head_dim]``) into ``slots`` (``n``)."""
        self.version += 1
        self._kv.index_copy_(3, slots, kv.transpose(2, 3).to(self.dtype))
        self._changed(slots)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV in slots ``src`` to slots ``dst`` (same length, disjoint)."""
        self.version += 1
        self._kv.index_copy_(3, dst, self._kv.index_select(3, src))
        self._changed(dst)

    def follow(self, changed: Callable[[torch.Tensor], None]) -> None:
        """Call ``changed(slots)`` after every `write` and `copy`, with the slots they
        stored (for a copy of the KV in another layout). Writes through `layer_views` are
        not reported: their writer keeps its copy itself."""
        self._followers.append(changed)

    def _changed(self, slots: torch.Tensor) -> None:
        for changed in self._followers:
            changed(slots)

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Live ``[kv_heads, slots, head_dim]`` views of one layer's keys and values.

        For the paged attention path, which writes and reads them inside the model's
        attention; whoever writes through them calls `mark_written`. A page ``p`` is slots
        ``[p * block_size, (p + 1) * block_size)``: ``view(kv_heads, num_pages, block_size,
        head_dim)`` addresses whole pages.
        """
        return self._kv[layer, 0], self._kv[layer, 1]

    def mark_written(self) -> None:
        """Record a write made through `layer_views` (bumps `version`)."""
        self.version += 1

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """``[layers, 2, n, kv_heads, head_dim]`` for ``slots`` (a 1-D index tensor).

        A view of one head-major gather (`index_select`): splitting ``n`` (e.g. into rows
        and columns) stays a view.
        """
        return self._kv.index_select(3, slots).transpose(2, 3)

    def page_tensor(self, page: int) -> torch.Tensor:
        """A copy of one page's KV, ``[layers, 2, block_size, kv_heads, head_dim]`` (for tests)."""
        s = page * self.block_size
        return self._kv[:, :, :, s : s + self.block_size].transpose(2, 3).clone()


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()
