"""`KVIndexConformance`: a KV-event consumer (a router's index of what an engine caches)
against the engine whose events it reads.

A reference engine (`ReferencePrefixEngine`, declared like vLLM's cache: blocks registered
at admission, one shared page pool, evictions to make room, resets) runs requests that share
prefixes; after every step its KV events (a ``stored`` event per block copy cached, a
``removed`` per copy dropped, ``cleared`` on a reset) go to the index under test through its
adapter, and the index must then predict, for every prompt prefix seen so far, how many
leading blocks the engine has cached. The adapter (`IndexAdapter`) has ``block_size``,
``apply(kind, key)`` and ``hits(tokens)``.

The declaration (`IndexSemantics`) says which event streams the index handles: a step's
events in any order (the default; the machine draws it), or its ``stored`` events parents
first, or its ``removed`` events children first, or both; and copies counted (the default:
the engine caches a block twice, as vLLM does) or one copy per block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import UsageError

from ._adapter import (
    ALPHABET,
    NO_OP,
    KVChange,
    chunk_tokens,
    class_of,
    configs_of,
    label,
    name_of,
    require_calls,
    semantics_of,
)
from ._declare import EngineSemantics, IndexSemantics
from ._engine_ref import Key, ReferencePrefixEngine, block_keys
from .adapters._kv_index import ReplicaIndexAdapter

__all__ = ["KVIndexConformance", "index_engine_semantics"]

_MAX_RUNNING = 3
INDEX_CALLS: dict[str, tuple[str, ...]] = {"": ("block_size", "apply", "hits")}


def index_engine_semantics(semantics: IndexSemantics) -> EngineSemantics:
    """How the machine's reference engine behaves for an index declared ``semantics``:
    vLLM's cache (registered at admission, tail-first, one shared pool), keeping duplicate
    copies when the index counts them."""
    return EngineSemantics(
        hit_cap="n-1",
        publish="at-admit",
        touch="tail-first",
        pins="release-is-use",
        capacity="shared-pool",
        duplicates="kept" if semantics.copies == "counted" else "freed",
        ops={"evict", "reset"},
    )


class KVIndexConformance(RuleBasedStateMachine):
    """An index fed by a reference engine's KV events, checked after every step."""

    factory: ClassVar[Callable[[], Any]] = ReplicaIndexAdapter
    semantics: ClassVar[IndexSemantics] = ReplicaIndexAdapter.semantics
    page_counts: ClassVar[st.SearchStrategy[int]] = st.integers(1, 10)

    @classmethod
    def for_adapter(
        cls,
        factory: Callable[[], Any],
        *,
        semantics: IndexSemantics | None = None,
        pages: st.SearchStrategy[int] | None = None,
    ) -> type[KVIndexConformance]:
        """A machine that checks the index adapters ``factory()`` makes.

        ``semantics`` defaults to ``factory.semantics`` (through `functools.partial`), else
        `IndexSemantics()`; ``pages`` (else ``factory.configs``) narrows the engine's pool
        sizes drawn (default 1 to 10 pages).
        """
        declared = semantics or semantics_of(factory) or IndexSemantics()
        if not isinstance(declared, IndexSemantics):
            raise UsageError(f"semantics must be an IndexSemantics, got {declared!r}")
        made = class_of(factory)
        if made is not None:
            require_calls(made, INDEX_CALLS, frozenset(), lambda _: "")
        body: dict[str, Any] = {"factory": staticmethod(factory), "semantics": declared}
        pages = pages if pages is not None else configs_of(factory)
        if pages is not None:
            body["page_counts"] = pages
        return type(f"{cls.__name__}_{name_of(factory)}", (cls,), body)

    def __init__(self) -> None:
        super().__init__()
        self.index: Any = None
        self.ref: ReferencePrefixEngine | None = None
        self.copies: Counter[Key] = Counter()
        self.seen: set[Key] = set()  # every block key a prompt had
        self.next_id = 0
        self.step = "start"

    @initialize(pages=st.data())
    def start(self, pages: st.DataObject) -> None:
        n = pages.draw(type(self).page_counts, label="pages")
        self.index = type(self).factory()
        require_calls(self.index, INDEX_CALLS, frozenset(), lambda _: "")
        sem = index_engine_semantics(type(self).semantics)
        self.ref = ReferencePrefixEngine(sem, n, self.index.block_size)
        self.step = f"start(pages={n}, block_size={self.index.block_size})"
        note(self.step)

    def teardown(self) -> None:
        close = getattr(self.index, "close", None)
        if callable(close):
            close()

    def _label(self, key: Sequence[int]) -> str:
        return label(key, self.index.block_size)

    # -- the events of one step ------------------------------------------------------------
    def _deliver(self, data: st.DataObject, cleared: bool = False) -> None:
        """Send the index what changed in the engine since the last step, as KV events."""
        assert self.ref is not None
        now = Counter(self.ref.copies())
        events: list[KVChange] = []
        if cleared:
            events.append(("cleared", None))
            self.copies = Counter()
        bs = self.index.block_size
        removed = sorted(self.copies - now, key=len, reverse=True)  # children first
        stored = sorted(now - self.copies, key=len)  # parents first
        events += [("removed", k) for k in removed for _ in range((self.copies - now)[k])]
        events += [("stored", k) for k in stored for _ in range((now - self.copies)[k])]
        if len(events) > 1 and not cleared:
            events = self._shuffled(data, events)
        self.copies = now
        if events:
            shown = ", ".join(f"{kind} {self._label(k) if k else ''}".strip() for kind, k in events)
            note(f"  events: {shown}")
        for kind, key in events:
            self.index.apply(kind, key)
        assert all(len(k) % bs == 0 for k in now)

    def _shuffled(self, data: st.DataObject, events: list[KVChange]) -> list[KVChange]:
        """``events`` (removals children first, then stores parents first) in a drawn order
        that keeps the order the declaration promises for each kind."""
        sem = type(self).semantics
        kept = {"stored": sem.order == "parents-first", "removed": sem.removals == "children-first"}
        kinds = {kind for kind, _ in events}
        if len(kinds) == 1 and kept[kinds.pop()]:
            return events  # one kind, in the order promised: nothing to draw
        order = data.draw(st.permutations(range(len(events))), label="event order")
        out = [events[i] for i in order]
        for kind in ("stored", "removed"):
            if kept[kind]:  # this kind's events go back, in their order, where the draw put them
                slots = [i for i, (k, _) in enumerate(out) if k == kind]
                for i, event in zip(slots, [e for e in events if e[0] == kind], strict=True):
                    out[i] = event
        return out

    # -- rules -----------------------------------------------------------------------------
    @precondition(lambda self: self.ref is not None and len(self.ref.runs) < _MAX_RUNNING)
    @rule(
        data=st.data(),
        first=st.integers(0, 1),
        chunks=st.lists(st.integers(0, len(ALPHABET) - 1), max_size=3),
        tail=st.integers(0, 15),
    )
    def admit(self, data: st.DataObject, first: int, chunks: list[int], tail: int) -> None:
        """A prompt of ``first`` and ``chunks`` as full blocks, then ``tail`` tokens."""
        assert self.ref is not None
        bs = self.index.block_size
        tokens = [t for c in [first, *chunks] for t in chunk_tokens(c, bs)]
        tokens += chunk_tokens(0, bs)[: tail % bs]
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.ref.admit(rid, tokens)
        self.step = f"admit({rid}, {self._label(tokens)})"
        note(f"{self.step} -> {'refused' if hit is None else f'hit {hit}'}")
        self.seen.update(block_keys(tokens, bs))
        self._deliver(data)

    @precondition(lambda self: self.ref is not None and bool(self.ref.runs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        assert self.ref is not None
        rid = data.draw(st.sampled_from(sorted(self.ref.runs)), label="request")
        self.step = f"finish({rid})"
        note(self.step)
        self.ref.finish(rid)
        self._deliver(data)

    @precondition(lambda self: self.ref is not None and bool(self.ref.resident()))
    @rule(data=st.data(), pages=st.integers(1, 4))
    def evict(self, data: st.DataObject, pages: int) -> None:
        assert self.ref is not None
        self.step = f"evict({pages})"
        note(self.step)
        self.ref.evict(pages)
        self._deliver(data)

    @precondition(
        lambda self: self.ref is not None and not self.ref.runs and bool(self.ref.resident())
    )
    @rule(data=st.data(), now=st.integers(0, 2))
    def reset(self, data: st.DataObject, now: int) -> None:
        assert self.ref is not None
        if now:  # one draw in three: a reset empties everything the other rules built
            note(NO_OP)
            return
        self.step = "reset()"
        note(self.step)
        self.ref.reset()
        self._deliver(data, cleared=True)

    # -- the check -------------------------------------------------------------------------
    def _cached_prefix(self, key: Key) -> int:
        assert self.ref is not None
        resident = self.ref.resident()
        n = 0
        for k in block_keys(key, self.index.block_size):
            if k not in resident:
                break
            n += 1
        return n

    @invariant()
    def predicts_the_engine(self) -> None:
        if self.ref is None:
            return
        wrong = self._mispredicted(sorted(self.seen, key=len))
        if wrong:
            key, got, want = wrong[0]
            cached = ", ".join(sorted(self._label(k) for k in self.ref.resident()))
            raise AssertionError(
                f"after {self.step}: the index predicts {got} cached blocks of "
                f"{self._label(key)}, the engine has {want} (cached: [{cached}])"
            )
        check = getattr(self.index, "check_invariants", None)
        if callable(check):
            check()

    def _mispredicted(self, keys: Iterable[Key]) -> list[tuple[Key, int, int]]:
        out = []
        for key in keys:
            got, want = self.index.hits(list(key)), self._cached_prefix(key)
            if got != want:
                out.append((key, got, want))
        return out
