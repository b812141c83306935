"""A stateful machine for `PrefixCache`: replay requests, engine publications with pages,
pins, evictions and clears, against a plain model built on the reference policies.

After every step it checks that the hit tokens, evicted pages and stats equal the model's,
that a mirror rebuilt from the cache's KV events alone equals the resident set, and that
every page belongs to exactly one resident block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import (
    S3FIFO,
    BlockHash,
    CapacityError,
    PrefixCache,
    UsageError,
)
from prefixflight.core.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from prefixflight.core.validate import assert_never

from ._adapter import name_of, semantics_of
from ._declare import PolicySemantics
from ._machines import s3fifo_reference
from ._reference import ReferenceLRU, ReferenceS3FIFO
from ._strategies import draw_supported, s3fifo_configs

__all__ = ["CacheConformance"]

_BLOCK_SIZE = 4
_KEYS = st.integers(0, 9)


class _ModelCache:
    """The cache as a plain model: a reference policy, a page table and counters."""

    def __init__(self, policy: ReferenceS3FIFO | ReferenceLRU) -> None:
        self.policy = policy
        self.pages: dict[BlockHash, int] = {}
        self.hit_tokens = self.prompt_tokens = self.requests = self.evictions = 0

    def access(self, blocks: Sequence[BlockHash], n: int) -> int:
        k = self.policy.resident_prefix(blocks)
        hit = min(k * _BLOCK_SIZE, n)
        for b in blocks:
            self._forget(self.policy.access([b]))
        self.requests += 1
        self.prompt_tokens += n
        self.hit_tokens += hit
        return hit

    def publish(self, blocks: Sequence[BlockHash], pages: Sequence[int]) -> list[Any]:
        out: list[Any] = []
        for b, p in zip(blocks, pages, strict=True):
            was = b in self.policy
            out += self._forget(self.policy.access([b]))
            if not was and b in self.policy:
                self.pages[b] = p
        return out

    def _forget(self, evicted: list[BlockHash]) -> list[tuple[BlockHash, int | None]]:
        self.evictions += len(evicted)
        return [(b, self.pages.pop(b, None)) for b in evicted]


class CacheConformance(RuleBasedStateMachine):
    """`PrefixCache` over an S3FIFO built by ``factory`` against the model.

    This checks prefixflight's `PrefixCache` around your *policy*; to check an engine's own
    prefix cache, use `PrefixEngineConformance`.
    """

    factory: ClassVar[Callable[..., Any]] = S3FIFO
    semantics: ClassVar[PolicySemantics] = PolicySemantics()
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = s3fifo_configs(max_capacity=6)

    @classmethod
    def for_factory(
        cls,
        factory: Callable[..., Any],
        *,
        semantics: PolicySemantics | None = None,
        configs: st.SearchStrategy[dict[str, Any]] | None = None,
    ) -> type[CacheConformance]:
        """Check a `PrefixCache` over your S3FIFO-compatible policy (any callable taking a
        config's keywords); ``semantics`` and ``configs`` as for `S3FIFOConformance`. The
        cache needs the policy to report its evictions."""
        declared = semantics or semantics_of(factory) or PolicySemantics()
        if declared.evictions != "reported":
            raise UsageError("a PrefixCache needs a policy whose access() reports evictions")
        body: dict[str, Any] = {"factory": staticmethod(factory), "semantics": declared}
        if configs is not None:
            body["configs"] = configs
        return type(f"{cls.__name__}_{name_of(factory)}", (cls,), body)

    def _has(self, op: str) -> bool:
        return hasattr(self, "cache") and op in type(self).semantics.ops

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        factory = type(self).factory
        config, policy = draw_supported(
            data, type(self).configs, lambda c: factory(**c), label="config"
        )
        note(f"config: {config}")
        self.config = config
        self.events: list[KVEvent] = []
        self.cache = PrefixCache(policy, _BLOCK_SIZE, event_sink=self.events.append)
        self.model = _ModelCache(s3fifo_reference(config, type(self).semantics))
        self.mirror: set[BlockHash] = set()
        self.next_page = 0

    def _same_outcome(self, mine: Callable[[], Any], theirs: Callable[[], Any]) -> None:
        try:
            want = theirs()
        except (CapacityError, UsageError) as exc:
            try:
                mine()
            except type(exc):
                return
            raise AssertionError(f"model raised {exc!r}, the cache did not") from None
        assert mine() == want

    @rule(blocks=st.lists(_KEYS, max_size=4), extra=st.integers(0, _BLOCK_SIZE))
    def request(self, blocks: list[int], extra: int) -> None:
        n = max(0, len(blocks) * _BLOCK_SIZE - extra)
        self._same_outcome(
            lambda: self.cache.access(blocks, n), lambda: self.model.access(blocks, n)
        )

    @rule(blocks=st.lists(_KEYS, max_size=3, unique=True))
    def publish(self, blocks: list[int]) -> None:
        pages = list(range(self.next_page, self.next_page + len(blocks)))
        self.next_page += len(blocks)
        self._same_outcome(
            lambda: self.cache.publish(blocks, pages), lambda: self.model.publish(blocks, pages)
        )

    @precondition(lambda self: self._has("pin") and len(self.model.policy) > 0)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        blocks = data.draw(
            st.lists(
                st.sampled_from(sorted(self.model.policy.resident(), key=repr)),
                min_size=1,
                max_size=2,
            )
        )
        for b in blocks:
            self.model.policy.pin(b)
        self.cache.pin(blocks)

    @precondition(lambda self: self._has("pin") and bool(self.model.policy.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.model.policy.pins, key=repr)))
        self.model.policy.unpin(block)
        self.cache.unpin([block])

    @precondition(lambda self: self._has("evict"))
    @rule()
    def evict(self) -> None:
        victim = self.model.policy.evict()
        want = None if victim is None else (victim, self.model.pages.pop(victim, None))
        self.model.evictions += 0 if victim is None else 1
        assert self.cache.evict() == want

    @precondition(lambda self: hasattr(self, "cache") and not self.model.policy.pins)
    @rule()
    def clear(self) -> None:
        self.cache.clear()
        # counters survive a clear
        self.model.policy = s3fifo_reference(self.config, type(self).semantics)
        self.model.pages.clear()

    @invariant()
    def matches_the_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        for event in self.events:
            match event:
                case BlockStored(block_hashes=hs):
                    self.mirror |= set(hs)
                case BlockRemoved(block_hashes=hs):
                    self.mirror -= set(hs)
                case AllBlocksCleared():
                    self.mirror.clear()
                case _:
                    assert_never(event)
        self.events.clear()
        resident = self.cache.policy.resident()
        assert self.mirror == resident, "KV events do not mirror the cache"
        assert resident == self.model.policy.resident()
        pages = {b: self.cache.page(b) for b in resident}
        assert pages == {b: self.model.pages.get(b) for b in resident}
        owned = [p for p in pages.values() if p is not None]
        assert len(owned) == len(set(owned)), "a page belongs to two blocks"
        stats = self.cache.stats
        assert (stats.requests, stats.prompt_tokens, stats.hit_tokens) == (
            self.model.requests,
            self.model.prompt_tokens,
            self.model.hit_tokens,
        )
        self.cache.check_invariants()
