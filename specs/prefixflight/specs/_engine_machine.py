"""`PrefixEngineConformance`: drive an engine's own prefix cache with requests of real token
ids that share prefixes, and compare it with `ReferencePrefixEngine` after every step.

An engine joins through an adapter (the `EngineAdapter` protocol: a few methods over the
engine's own calls) that declares its `EngineSemantics`::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import PrefixEngineConformance

    run_state_machine_as_test(PrefixEngineConformance.for_adapter(MyAdapter))

``MyAdapter(pages)`` builds a fresh engine over a pool of ``pages`` pages. After every step
the machine checks, naming the step and both views when they differ:

- the hit tokens of every admission, and whether it was admitted at all;
- the resident set (which blocks a lookup could hit) and how many pages hold each block;
- page accounting: no page is both free and used, none is lost (``capacity="shared-pool"``:
  free, cached and held pages cover the pool), the free count equals the reference's, and
  no block a running request holds was evicted;
- chain safety where the engine promises it: every cached block's parent is cached;
- with ``evictions="reported"``: a mirror rebuilt from the adapter's KV events alone equals
  the cache, copy for copy;
- with ``"stats"`` in ``ops``: the engine's own hit-rate accounting (``hit_stats()``) has
  counted the prompt tokens and hit tokens of every admitted request once, and nothing of a
  refused one.

Prompts are chains of 16-token chunks drawn from a four-letter alphabet, plus a partial
tail; messages name a block by its chunks (``a.b.c``) and a prompt by chunks and tail
(``a.b+5c``: two full blocks, then 5 tokens of chunk ``c``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import UsageError

from ._adapter import (
    ALPHABET,
    NO_OP,
    EngineAdapter,
    PoolView,
    chunk_tokens,
    class_of,
    configs_of,
    label,
    name_of,
    require_calls,
    semantics_of,
)
from ._declare import EngineSemantics
from ._engine_ref import Key, ReferencePrefixEngine
from ._strategies import draw_supported
from .adapters._prefixflight import PagePoolAdapter

__all__ = ["PrefixEngineConformance"]

ENGINE_CALLS: dict[str, tuple[str, ...]] = {
    "": ("block_size", "admit", "finish", "pool"),
    "evict": ("evict",),
    "invalidate": ("invalidate",),
    "reset": ("reset",),
    "events": ("events",),
    "stats": ("hit_stats",),
}
"""The calls an engine adapter must have: always (``""``), and per declared operation
(``events``: when it declares ``evictions="reported"``)."""


def _promised(semantics: EngineSemantics) -> frozenset[str]:
    reported = {"events"} if semantics.evictions == "reported" else set()
    return semantics.ops | reported


def _engine_hint(has: set[str]) -> str:
    ops = sorted(has - {"events"})
    declared = "{" + ", ".join(map(repr, ops)) + "}" if ops else "set()"
    reported = "" if "events" in has else ', evictions="observed"'
    return f"semantics = EngineSemantics(ops={declared}{reported}, ...)"


_ALPHABET = ALPHABET
_MAX_RUNNING = 4


class PrefixEngineConformance(RuleBasedStateMachine):
    """An engine's prefix cache against `ReferencePrefixEngine`, under its declaration.

    As it stands it checks prefixflight's own engine path (`PagePoolAdapter`); `for_adapter`
    makes the machine for another engine.
    """

    factory: ClassVar[Callable[[int], EngineAdapter]] = PagePoolAdapter
    semantics: ClassVar[EngineSemantics] = PagePoolAdapter.semantics
    page_counts: ClassVar[st.SearchStrategy[int]] = st.integers(1, 12)

    @classmethod
    def for_adapter(
        cls,
        factory: Callable[[int], Any],
        *,
        semantics: EngineSemantics | None = None,
        pages: st.SearchStrategy[int] | None = None,
    ) -> type[PrefixEngineConformance]:
        """A machine that checks ``factory(pages)``'s adapters.

        ``semantics`` defaults to ``factory.semantics`` (through `functools.partial`);
        ``pages`` narrows the pool sizes drawn (default 1 to 12 pages). ``factory`` may
        raise `Unsupported` for a pool size it does not support: the example is discarded.
        """
        declared = semantics or semantics_of(factory) or EngineSemantics()
        if not isinstance(declared, EngineSemantics):
            raise UsageError(f"semantics must be an EngineSemantics, got {declared!r}")
        made = class_of(factory)
        if made is not None:
            require_calls(made, ENGINE_CALLS, _promised(declared), _engine_hint)
        body: dict[str, Any] = {"factory": staticmethod(factory), "semantics": declared}
        pages = pages if pages is not None else configs_of(factory)
        if pages is not None:
            body["page_counts"] = pages
        return type(f"{cls.__name__}_{name_of(factory)}", (cls,), body)

    def __init__(self) -> None:
        super().__init__()
        self.engine: Any = None
        self.ref: ReferencePrefixEngine | None = None
        self.next_id = 0
        self.step = "start"
        self.mirror: Counter[Key] = Counter()
        self.queried = 0  # prompt tokens of the admitted requests
        self.hit = 0  # their hit tokens

    # -- set-up --------------------------------------------------------------------------
    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        pages, engine = draw_supported(
            data, type(self).page_counts, type(self).factory, label="pages"
        )
        self.engine = engine
        require_calls(engine, ENGINE_CALLS, _promised(type(self).semantics), _engine_hint)
        bs = engine.block_size
        self.ref = ReferencePrefixEngine(type(self).semantics, pages, bs)
        self.step = f"start(pages={pages}, block_size={bs})"
        note(self.step)

    def teardown(self) -> None:
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    # -- naming ----------------------------------------------------------------------------
    def _label(self, key: Sequence[int]) -> str:
        """``a.b`` for a key; ``a.b+5c`` for a prompt ending in 5 tokens of chunk ``c``."""
        return label(key, self.engine.block_size)

    def _labels(self, keys: Iterable[Key]) -> str:
        return "[" + ", ".join(sorted(self._label(k) for k in keys)) + "]"

    def _ops(self, op: str) -> bool:
        return self.engine is not None and op in type(self).semantics.ops

    # -- rules ---------------------------------------------------------------------------
    @precondition(lambda self: self.ref is not None and len(self.ref.runs) < _MAX_RUNNING)
    @rule(
        first=st.integers(0, 1),  # prompts often share their first block (a system prompt)
        chunks=st.lists(st.integers(0, len(_ALPHABET) - 1), max_size=3),
        tail=st.integers(0, len(_ALPHABET) - 1),
        tail_len=st.integers(0, 15),
        whole=st.integers(0, 3),
    )
    def admit(self, first: int, chunks: list[int], tail: int, tail_len: int, whole: int) -> None:
        """A prompt: ``first`` and ``chunks`` (no full block when ``whole`` is 0), then
        ``tail_len`` tokens of chunk ``tail``."""
        assert self.ref is not None
        bs = self.engine.block_size
        chunks = [first, *chunks] if whole else []
        tail_len %= bs
        if not chunks and tail_len == 0:
            tail_len = 1
        tokens = [t for c in chunks for t in chunk_tokens(c, bs)]
        tokens += chunk_tokens(tail, bs)[:tail_len]
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.step = f"admit({rid}, {self._label(tokens)})"
        want = self.ref.admit(rid, tokens)
        got = self.engine.admit(rid, list(tokens))
        note(f"{self.step} -> {'refused' if got is None else f'hit {got}'}")

        def say(hit: int | None) -> str:
            return "refused it" if hit is None else f"hit {hit} tokens"

        assert got == want, (
            f"{self.step}: the engine {say(got)}, the reference {say(want)} "
            f"(cached: {self._labels(self.ref.resident())}, free pages: "
            f"{self.ref.free_pages()})"
        )
        if got is not None:
            self.queried += len(tokens)
            self.hit += got

    @precondition(lambda self: self.ref is not None and bool(self.ref.runs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        assert self.ref is not None
        rid = data.draw(st.sampled_from(sorted(self.ref.runs)), label="request")
        self.step = f"finish({rid})"
        note(self.step)
        self.ref.finish(rid)
        self.engine.finish(rid)

    # the optional operations act on one draw of ``now`` in three, so that rules which are
    # always enabled do not crowd out admissions (Hypothesis picks enabled rules uniformly)
    @precondition(lambda self: self._ops("evict") and bool(self.ref.resident()))
    @rule(pages=st.integers(1, 4), now=st.integers(0, 2))
    def evict(self, pages: int, now: int) -> None:
        assert self.ref is not None
        if now:
            note(NO_OP)
            return
        self.step = f"evict({pages})"
        note(self.step)
        self.ref.evict(pages)
        self.engine.evict(pages)

    @precondition(lambda self: self._ops("invalidate") and bool(self.ref.resident()))
    @rule(data=st.data(), now=st.integers(0, 2))
    def invalidate(self, data: st.DataObject, now: int) -> None:
        assert self.ref is not None
        if now:
            note(NO_OP)
            return
        key = data.draw(st.sampled_from(sorted(self.ref.resident())), label="block")
        self.step = f"invalidate({self._label(key)})"
        note(self.step)
        self.ref.invalidate(key)
        self.engine.invalidate(key)

    @precondition(
        lambda self: self._ops("reset") and not self.ref.runs and bool(self.ref.resident())
    )
    @rule(now=st.integers(0, 2))
    def reset(self, now: int) -> None:
        """Drop everything (only while nothing runs)."""
        assert self.ref is not None
        if now:
            note(NO_OP)
            return
        self.step = "reset()"
        note(self.step)
        self.ref.reset()
        self.engine.reset()

    # -- checks --------------------------------------------------------------------------
    @invariant()
    def agrees_with_reference(self) -> None:
        if self.ref is None:
            return
        ref, sem = self.ref, type(self).semantics
        view = self.engine.pool()
        after = f"after {self.step}"
        got_copies = Counter(view.cached.values())
        want_copies = Counter(ref.copies())
        got, want = set(got_copies), set(want_copies)
        assert got == want, (
            f"{after}: cached blocks differ: the engine has {self._labels(got)}, the reference "
            f"{self._labels(want)} (only the engine: {self._labels(got - want)}; only the "
            f"reference: {self._labels(want - got)})"
        )
        assert got_copies == want_copies, (
            f"{after}: pages per cached block differ: the engine "
            f"{self._copies(got_copies)}, the reference {self._copies(want_copies)}"
        )
        self._check_pages(view, after)
        if sem.capacity == "shared-pool":
            assert len(view.free) == ref.free_pages(), (
                f"{after}: the engine has {len(view.free)} free pages, the reference "
                f"{ref.free_pages()}"
            )
        for rid in ref.runs:
            mine = {view.cached[p] for p in view.held.get(rid, ()) if p in view.cached}
            lost = ref.held(rid) - mine
            assert not lost, (
                f"{after}: request {rid} holds {self._labels(ref.held(rid))} but the engine "
                f"does not hold {self._labels(lost)} for it (evicted or released while in use)"
            )
        if sem.chain_safe:
            bs = self.engine.block_size
            orphans = {k for k in got if len(k) > bs and k[:-bs] not in got}
            assert not orphans, (
                f"{after}: cached blocks without their parent: {self._labels(orphans)}"
            )
        if sem.evictions == "reported":
            for kind, key in self.engine.events():
                if kind == "cleared":
                    self.mirror.clear()
                elif kind == "stored":
                    assert key is not None
                    self.mirror[key] += 1
                else:
                    assert key is not None
                    self.mirror[key] -= 1
                    assert self.mirror[key] >= 0, (
                        f"{after}: a KV event removed {self._label(key)}, which was not stored"
                    )
            self.mirror = +self.mirror
            assert self.mirror == got_copies, (
                f"{after}: the KV events say {self._copies(self.mirror)}, the cache holds "
                f"{self._copies(got_copies)}"
            )
        if self._ops("stats"):
            queried, hit = self.engine.hit_stats()
            assert (queried, hit) == (self.queried, self.hit), (
                f"{after}: the engine's hit-rate accounting counts {queried} tokens looked up "
                f"and {hit} hit; its admitted requests looked up {self.queried} and hit "
                f"{self.hit} (each admitted request counts once, a refused one not at all)"
            )
        check = getattr(self.engine, "check_invariants", None)
        if callable(check):
            check()

    def _copies(self, counts: Mapping[Key, int]) -> str:
        return "{" + ", ".join(f"{self._label(k)}: {n}" for k, n in sorted(counts.items())) + "}"

    def _check_pages(self, view: PoolView, after: str) -> None:
        assert self.ref is not None
        used = set(view.cached)
        for rid, pages in view.held.items():
            assert rid in self.ref.runs, f"{after}: the engine still holds pages for {rid}"
            used |= pages
        both = view.free & used
        assert not both, f"{after}: pages {sorted(both)} are free and in use at once"
        if type(self).semantics.capacity == "shared-pool":
            total = len(view.free | used)
            assert total == self.ref.pages, (
                f"{after}: free, cached and held pages add up to {total}, not "
                f"{self.ref.pages}: {self.ref.pages - total} leaked"
            )
        else:
            assert len(view.cached) <= self.ref.pages, (
                f"{after}: {len(view.cached)} cached pages in a cache of {self.ref.pages}"
            )
