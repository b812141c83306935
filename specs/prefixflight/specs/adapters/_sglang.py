"""SGLang's `RadixCache` (page size 16, a simulated allocator) under
`PrefixEngineConformance`.

Runs in an environment with SGLang (``benchmarks/peers/setup.sh`` builds one; SGLang 0.5.23
was checked, and the releases from 0.5.11 on run), imported when an adapter is made. The
adapter plays SGLang's scheduler around the tree: ``match_prefix`` of the prompt without its
last token and ``inc_lock_ref`` on admission, ``evict`` of the shortfall when the free pages
do not cover the request (refused when free plus evictable pages do not), and on completion
``insert`` of the prompt's full pages, freeing the pages of blocks another request inserted
first (as ``RadixCache._insert_cache`` does) and of the partial tail, then ``dec_lock_ref``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from array import array
from collections.abc import Sequence
from importlib import import_module
from typing import Any

from .._adapter import PoolView
from .._declare import EngineSemantics
from .._engine_ref import Key

__all__ = ["SGLangAdapter", "stub_torchvision"]


def stub_torchvision() -> None:
    """Let SGLang import without torchvision.

    SGLang's import chain reaches torchvision through multimodal helpers that `RadixCache`
    never uses, and the PyPI torchvision wheel is a CUDA build that fails on CPU torch.
    Record torchvision as unavailable in transformers, then serve permissive stub modules.
    """
    import_module("transformers")  # records torchvision as unavailable first

    class _Anything(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(f"{self.__name__}.{name}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _Anything(self.__name__)

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec: Any) -> Any:
            module = _Anything(spec.name)
            module.__path__ = []
            setattr(module, "__version__", "0.0.0")  # noqa: B010
            return module

        def exec_module(self, module: Any) -> None:
            return None

    if "torchvision" not in sys.modules and not any(
        type(f).__name__ == "_Finder" for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _Finder())


@functools.cache
def _sglang() -> dict[str, Any]:
    logging.getLogger("sglang").setLevel(logging.ERROR)
    stub_torchvision()
    base = import_module("sglang.srt.mem_cache.base_prefix_cache")
    radix = import_module("sglang.srt.mem_cache.radix_cache")
    return {
        "torch": import_module("torch"),
        "RadixCache": radix.RadixCache,
        "RadixKey": radix.RadixKey,
        "CacheInitParams": import_module("sglang.srt.mem_cache.cache_init_params").CacheInitParams,
        "EvictParams": base.EvictParams,
        "InsertParams": base.InsertParams,
        "MatchPrefixParams": base.MatchPrefixParams,
    }


class _Allocator:
    """A simulated paged KV allocator: free pages; a token slot is ``page * 16 + offset``."""

    device = "cpu"

    def __init__(self, pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages: set[int] = set(range(pages))

    def free_segment(self, values: Any, start_pos: int = 0) -> None:
        pages = {int(v) // self.page_size for v in values.tolist()}
        assert not pages & self.free_pages, f"pages {sorted(pages & self.free_pages)} freed twice"
        self.free_pages |= pages

    def free(self, values: Any) -> None:  # the tree's call before SGLang 0.5.17
        self.free_segment(values)

    def take(self, n: int) -> list[int]:
        got = sorted(self.free_pages)[:n]
        self.free_pages.difference_update(got)
        return got


class SGLangAdapter:
    """SGLang's `RadixCache` over a pool of ``pages`` pages of 16 tokens.

    ``impl`` replaces `RadixCache`, built as ``impl(CacheInitParams(...))`` with exactly the
    parameters ``RadixCache.create_simulated`` passes.
    """

    semantics = EngineSemantics(
        hit_cap="n-1",
        pins="unlock-no-touch",
        unit="node",
        capacity="shared-pool",
        ops=frozenset({"evict", "reset"}),
    )
    block_size = 16

    def __init__(self, pages: int, *, impl: type[Any] | None = None) -> None:
        s = _sglang()
        self._s = s
        self.pages = pages
        self.allocator = _Allocator(pages, self.block_size)
        init = s["CacheInitParams"]
        fields = {f.name for f in dataclasses.fields(init)}
        optional = {"dynamo_kv_event_format": False, "kv_event_lora_names": None}  # 0.5.22+
        params = init(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.block_size,
            enable_kv_cache_events=False,
            **{k: v for k, v in optional.items() if k in fields},
        )
        self.tree = (impl or s["RadixCache"])(params)
        self._reqs: dict[str, tuple[list[int], list[int], int, Any]] = {}

    def _key(self, tokens: Sequence[int]) -> Any:
        return self._s["RadixKey"](array("q", tokens))

    def admit(self, rid: str, tokens: Sequence[int]) -> int | None:
        s, tree, bs = self._s, self.tree, self.block_size
        n = len(tokens)
        match = tree.match_prefix(s["MatchPrefixParams"](key=self._key(tokens[: n - 1])))
        if hasattr(match, "device_prefix_len"):
            hit = int(match.device_prefix_len)
        else:  # before 0.5.22: the matched indices themselves
            hit = len(match.device_indices)
        node = match.last_device_node
        tree.inc_lock_ref(node)
        need = -(-n // bs) - hit // bs
        if need > len(self.allocator.free_pages) + tree.evictable_size() // bs:
            tree.dec_lock_ref(node)
            return None
        short = need - len(self.allocator.free_pages)
        if short > 0:
            tree.evict(s["EvictParams"](num_tokens=short * bs))
        hit_pages = [int(v) // bs for v in self._path_values(node)[::bs]]
        self._reqs[rid] = (list(tokens), hit_pages + self.allocator.take(need), hit, node)
        return hit

    def finish(self, rid: str) -> None:
        s, tree, bs = self._s, self.tree, self.block_size
        tokens, pages, hit, node = self._reqs.pop(rid)
        full = len(tokens) // bs
        slots = [p * bs + i for p in pages[:full] for i in range(bs)]
        result = tree.insert(
            s["InsertParams"](
                key=self._key(tokens[: full * bs]),
                value=s["torch"].tensor(slots, dtype=s["torch"].int64),
            )
        )
        done = int(result.prefix_len) // bs  # blocks the tree held before this insert
        for p in pages[hit // bs : done] + pages[full:]:  # duplicates, then the partial tail
            self.allocator.free_pages.add(p)
        tree.dec_lock_ref(node)

    def _path_values(self, node: Any) -> list[int]:
        """The KV slots of the path from the root to ``node`` (SGLang's
        ``path_device_indices``, which releases before 0.5.22 lack)."""
        values: list[int] = []
        while node is not self.tree.root_node:
            values[:0] = node.value.tolist()
            node = node.parent
        return values

    def evict(self, pages: int) -> None:
        self.tree.evict(self._s["EvictParams"](num_tokens=pages * self.block_size))

    def reset(self) -> None:
        self.tree.reset()
        self.allocator.free_pages = set(range(self.pages))

    def pool(self) -> PoolView:
        bs = self.block_size
        cached: dict[int, Key] = {}
        stack: list[tuple[Any, tuple[int, ...]]] = [(self.tree.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = tuple(int(t) for t in child.key.token_ids)
                values = child.value.tolist()
                path = prefix + tokens
                for i in range(len(tokens) // bs):
                    cached[int(values[i * bs]) // bs] = path[: len(prefix) + (i + 1) * bs]
                stack.append((child, path))
        held = {rid: frozenset(pages) for rid, (_, pages, _, _) in self._reqs.items()}
        return PoolView(frozenset(self.allocator.free_pages), cached, held)

    def check_invariants(self) -> None:
        tree = self.tree
        size = tree.total_size()
        counted = tree.evictable_size() + tree.protected_size()
        assert counted == size, (
            f"RadixCache counts {tree.evictable_size()} evictable + {tree.protected_size()} "
            f"protected tokens, its tree holds {size}"
        )
