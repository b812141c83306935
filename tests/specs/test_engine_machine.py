"""The engine-level machine: our page pool passes under its declaration; broken page pools are
caught; the reference follows each declared semantics; declarations reject what is not
modelled; isolated() turns a crash into a shrunk failure."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import UsageError
from prefixflight.core.flight._pages import PagePool
from prefixflight.specs import (
    EngineCrashed,
    EngineSemantics,
    PrefixEngineConformance,
    ReferencePrefixEngine,
    declared_differences,
    isolated,
)
from prefixflight.specs.adapters import PagePoolAdapter

TestPagePool = PrefixEngineConformance.TestCase  # as it stands: prefixflight's page pool

_CATCH = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    database=None,
    derandomize=True,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    suppress_health_check=list(HealthCheck),
)


def _caught(machine: type[Any]) -> AssertionError:
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(machine, settings=_CATCH)
    assert type(caught.value) in (AssertionError, EngineCrashed), repr(caught.value)
    return caught.value


class _UnderReporting(PagePool):  # type: ignore[misc]  # PagePool is final: this is a mutant
    """A lookup that reports one hit block fewer than it has."""

    def allocate(self, blocks: Any, max_reuse: int, total: int) -> Any:
        return super().allocate(blocks, max(0, max_reuse - 1), total)


class _LeakyRelease(PagePool):  # type: ignore[misc]
    """A release that forgets one private page."""

    def release(self, pinned: Any, private: Any) -> None:
        super().release(pinned, sorted(private)[1:])


class _DropsLastBlock(PagePool):  # type: ignore[misc]
    """A publish that drops the last block of every request of two or more blocks."""

    def publish(self, hashes: Any, pages: Any, start: int, upto: int, tokens: Any) -> Any:
        return super().publish(hashes, pages, start, upto - 1 if upto - start > 1 else upto, tokens)


@pytest.mark.parametrize(
    ("pool_cls", "says"),
    [
        (_UnderReporting, "admit("),
        (_LeakyRelease, "leaked"),
        (_DropsLastBlock, "cached blocks differ"),
    ],
    ids=["lookup-under-reports", "release-leaks", "publish-drops-a-page"],
)
def test_broken_page_pools_are_caught(pool_cls: type[PagePool], says: str) -> None:
    err = _caught(
        PrefixEngineConformance.for_adapter(functools.partial(PagePoolAdapter, pool_cls=pool_cls))
    )
    assert says in str(err)
    notes = "\n".join(getattr(err, "__notes__", ()))
    assert "start(pages=" in notes and "state.admit(" in notes  # the shrunk sequence


class _Counted(PagePoolAdapter):
    """Our pool with hit-rate accounting: an admitted request counts once, a refused one not
    at all."""

    semantics = attrs.evolve(PagePoolAdapter.semantics, ops={"stats"})
    at_lookup = False

    def __init__(self, pages: int) -> None:
        super().__init__(pages)
        self.counted = (0, 0)

    def admit(self, rid: str, tokens: Sequence[int]) -> int | None:
        hit = super().admit(rid, tokens)
        if hit is not None or self.at_lookup:
            self.counted = (self.counted[0] + len(tokens), self.counted[1] + (hit or 0))
        return hit

    def hit_stats(self) -> tuple[int, int]:
        return self.counted


class _CountedAtLookup(_Counted):
    """Counts every lookup, also a refused request's (vLLM before 0.27 counted a request
    each time the scheduler looked it up, so one retried after an allocation failure counted
    twice)."""

    at_lookup = True


def test_hit_rate_accounting_counts_admitted_requests_once() -> None:
    run_state_machine_as_test(PrefixEngineConformance.for_adapter(_Counted), settings=_CATCH)
    err = _caught(PrefixEngineConformance.for_adapter(_CountedAtLookup))
    assert "hit-rate accounting counts" in str(err) and "refused" in "\n".join(err.__notes__)


def test_a_wrong_declaration_is_caught() -> None:
    """Our pool stamps a chain tail first; declared in order, the machine disagrees."""
    wrong = EngineSemantics(
        hit_cap="n-1", capacity="shared-pool", orphans="removed", evictions="reported"
    )
    err = _caught(PrefixEngineConformance.for_adapter(PagePoolAdapter, semantics=wrong))
    assert "after" in str(err) or "admit(" in str(err)


# -- a fixed-capacity engine: prefixflight's PrefixCache used directly -------------------------
class _FixedCache:
    """The smallest engine: a `PrefixCache` over an LRU of ``pages`` blocks; a running request
    pins its hits, and on finish publishes its blocks deepest first, each pinned until the
    request lets go (as prefixflight's page pool does); its own pages are not the cache's."""

    semantics = EngineSemantics(hit_cap="n-1", touch="tail-first")
    block_size = 4

    def __init__(self, pages: int) -> None:
        from prefixflight.core import LRU, BlockHasher, PrefixCache

        self.cache = PrefixCache(LRU(pages), self.block_size)
        self.hasher = BlockHasher(self.block_size)
        self.keys: dict[Any, tuple[int, ...]] = {}
        self.runs: dict[str, tuple[Any, int, list[int]]] = {}
        self.next_page = 0

    def admit(self, rid: str, tokens: Sequence[int]) -> int:
        hashes = self.hasher.hash_tokens(tokens)
        for i, h in enumerate(hashes):
            self.keys[h] = tuple(tokens[: (i + 1) * self.block_size])
        k = min(self.cache.lookup(hashes), (len(tokens) - 1) // self.block_size)
        self.cache.pin(hashes[:k])
        self.cache.publish(hashes[:k][::-1])  # a hit refreshes its chain, tail first
        own = list(range(self.next_page, self.next_page + len(hashes) - k))
        self.next_page += len(own)
        self.runs[rid] = (hashes, k, own)
        return k * self.block_size

    def finish(self, rid: str) -> None:
        from prefixflight.core import CapacityError

        hashes, k, own = self.runs.pop(rid)
        held = list(hashes[:k])
        for h, page in zip(hashes[k:][::-1], own[::-1], strict=True):  # deepest first
            try:
                self.cache.publish([h], [page])
            except CapacityError:  # every cached block is pinned: this one is not cached
                continue
            if h not in self.cache:  # a cache of 0 blocks keeps nothing
                continue
            self.cache.pin([h])
            held.append(h)
        self.cache.unpin(held)

    def pool(self) -> Any:
        from prefixflight.specs import PoolView

        def page(h: Any) -> int:
            got = self.cache.page(h)
            assert got is not None, "a cached block without a page"
            return got

        cached = {page(h): self.keys[h] for h in self.cache.policy.resident()}
        held = {
            rid: frozenset([*map(page, hashes[:k]), *own])
            for rid, (hashes, k, own) in self.runs.items()
        }
        return PoolView(frozenset(), cached, held)


TestFixedCapacityCache = PrefixEngineConformance.for_adapter(
    _FixedCache, pages=__import__("hypothesis").strategies.integers(0, 6)
).TestCase


# -- the reference, step by step -------------------------------------------------------------
def _tokens(*chunks: int, tail: int = 0, bs: int = 4) -> list[int]:
    out = [100 * c + i for c in chunks for i in range(bs)]
    return out + [999] * tail


def test_release_is_use_evicts_the_tail_first_and_keeps_duplicates() -> None:
    """vLLM's semantics: registered at admission; released tail first; a block computed twice
    (the n-1 cap re-computes a fully cached prompt's last block) is cached twice."""
    sem = EngineSemantics(
        hit_cap="n-1",
        publish="at-admit",
        touch="tail-first",
        pins="release-is-use",
        capacity="shared-pool",
        duplicates="kept",
    )
    ref = ReferencePrefixEngine(sem, pages=3, block_size=4)
    ab = _tokens(1, 2)
    assert ref.admit("r0", ab) == 0
    ref.finish("r0")
    assert ref.admit("r1", ab) == 4  # only block 1 hits: the last token is recomputed
    assert ref.copies() == {tuple(ab[:4]): 1, tuple(ab): 2}
    ref.finish("r1")
    # the pool is full: two pages for r2 evict the two least recently released copies, both
    # of the tail block (released before the head by both requests)
    c = _tokens(3, tail=1)
    assert ref.admit("r2", c) == 0
    assert ref.free_pages() == 0 and ref.copies() == {tuple(ab[:4]): 1, tuple(c[:4]): 1}


def test_a_node_eviction_frees_the_whole_leaf() -> None:
    """SGLang's semantics: evicting one page of a 3-block leaf frees all three."""
    sem = EngineSemantics(pins="unlock-no-touch", unit="node", capacity="shared-pool")
    ref = ReferencePrefixEngine(sem, pages=4, block_size=4)
    abc = _tokens(1, 2, 3)
    assert ref.admit("r0", abc) == 0
    ref.finish("r0")
    assert ref.free_pages() == 1
    ref.evict(1)
    assert ref.resident() == frozenset() and ref.free_pages() == 4


def test_lookups_split_radix_nodes_and_a_locked_split_survives() -> None:
    sem = EngineSemantics(pins="unlock-no-touch", unit="node", capacity="shared-pool")
    ref = ReferencePrefixEngine(sem, pages=6, block_size=4)
    ref.admit("r0", _tokens(1, 2, 3))
    ref.finish("r0")
    assert ref.admit("r1", _tokens(1, 5, tail=1)) == 4  # splits [1,2,3] after block 1
    ref.evict(6)  # [2,3] goes; [1] is locked by r1
    assert ref.resident() == {tuple(_tokens(1))}
    ref.finish("r1")
    assert ref.resident() == {tuple(_tokens(1)), tuple(_tokens(1, 5))}


def test_ours_refuses_without_changing_anything() -> None:
    sem = PagePoolAdapter.semantics
    ref = ReferencePrefixEngine(sem, pages=2, block_size=4)
    assert ref.admit("r0", _tokens(1, 2)) == 0
    assert ref.admit("r1", _tokens(3)) is None
    assert ref.free_pages() == 0 and set(ref.runs) == {"r0"}


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"hit_cap": "n-2"}, "hit_cap must be one of"),
        ({"unit": "node"}, "unit='node'"),
        ({"pins": "release-is-use"}, "needs capacity='shared-pool'"),
        ({"pins": "unlock-no-touch"}, "modelled for unit='node'"),
        ({"ops": {"evict", "shrink"}}, "unknown operations ['shrink']"),
        ({"capacity": "fixed", "ops": {"invalidate"}}, "capacity='fixed'"),
        ({"policy": "arc"}, "policy must be one of"),
        ({"policy": "s3fifo"}, "got capacity='fixed', orphans='kept'"),
        (
            {
                "policy": "lru",
                "capacity": "shared-pool",
                "orphans": "removed",
                "invalidated": "in-place",
            },
            "got invalidated='in-place'",
        ),
    ],
)
def test_declarations_reject_what_is_not_modelled(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(UsageError) as err:
        EngineSemantics(**kwargs)
    assert says in str(err.value)


def test_declared_differences_list_departures_not_capabilities() -> None:
    names = [d["name"] for d in declared_differences(PagePoolAdapter.semantics)]
    assert names == ["hit_cap", "touch", "capacity", "orphans"]  # evictions=reported adds checks
    assert declared_differences(EngineSemantics(ops={"reset"})) == []


_PLUGIN = EngineSemantics(
    hit_cap="n-1", publish="at-admit", touch="tail-first", capacity="shared-pool",
    duplicates="kept", orphans="removed", policy="s3fifo",
)  # fmt: skip


def test_a_policy_reference_reuses_a_redundant_copy_before_evicting() -> None:
    """Two requests compute the same block (two pages); once both end, the second page is
    redundant, and a request that needs two pages of a full pool takes it and evicts one."""
    ref = ReferencePrefixEngine(_PLUGIN, pages=3, block_size=4)
    a = _tokens(1)
    assert ref.admit("r0", a) == 0 and ref.admit("r1", a) == 0  # n-1: the last block recomputed
    assert ref.copies() == {tuple(a): 2}
    ref.finish("r0")
    ref.finish("r1")
    b = tuple(_tokens(2, 3))
    assert ref.admit("r2", b) == 0
    assert ref.copies() == {tuple(a): 1, b[:4]: 1, b: 1}
    assert ref.free_pages() == 0
    assert declared_differences(_PLUGIN)[-1]["name"] == "policy"


def test_for_adapter_takes_partials_and_their_declaration() -> None:
    machine = PrefixEngineConformance.for_adapter(
        functools.partial(PagePoolAdapter, pool_cls=PagePool)
    )
    assert machine.semantics is PagePoolAdapter.semantics
    assert machine.__name__.endswith("PagePoolAdapter")
    with pytest.raises(UsageError, match="must be an EngineSemantics, got 'ours'"):
        PrefixEngineConformance.for_adapter(PagePoolAdapter, semantics="ours")  # type: ignore[arg-type]


# -- isolation -------------------------------------------------------------------------------
class Aborting:
    """Aborts the process on ``boom(n)`` for n >= 3 (a stand-in for a C library)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def boom(self, n: int) -> int:
        if n >= 3:
            os.abort()
        return n * self.size

    def fail(self) -> None:
        raise UsageError("bad call")


def test_isolated_objects_forward_calls_attributes_and_errors() -> None:
    make: Callable[..., Any] = isolated(Aborting)
    obj = make(size=5)
    assert obj.boom(2) == 10 and obj.size == 5
    with pytest.raises(UsageError, match="bad call"):
        obj.fail()
    with pytest.raises(AttributeError):
        _ = obj.missing
    obj.close()


def test_a_crash_is_a_shrunk_failure_not_a_dead_run() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    make = isolated(Aborting)

    @settings(max_examples=20, database=None, derandomize=True, deadline=None)
    @given(st.integers(0, 10))
    def calls(n: int) -> None:
        make(1).boom(n)

    with pytest.raises(EngineCrashed) as crash:
        calls()
    assert crash.value.signal == 6 and crash.value.call == "boom(3)"  # shrunk to the least n
    assert make(2).boom(1) == 2  # the next object gets a fresh worker
