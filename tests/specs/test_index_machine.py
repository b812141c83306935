"""`KVIndexConformance`: our router's index passes under its declaration; each declared
difference is needed (set back, the machine finds it); a counting index written apart from
the machine passes the strictest declaration, and broken ones are caught."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import UsageError
from prefixflight.specs import IndexSemantics, KVIndexConformance, declared_differences, machine_for
from prefixflight.specs.adapters import ReplicaIndexAdapter

_PASS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    database=None,
    derandomize=True,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)
_CATCH = settings(_PASS, max_examples=300, phases=(Phase.explicit, Phase.generate))


class CountingIndex:
    """A consumer that counts copies and keys blocks by their tokens: handles any order."""

    semantics = IndexSemantics()
    block_size = 4

    def __init__(self, *, count: bool = True, clears: bool = True) -> None:
        self.copies: Counter[tuple[int, ...]] = Counter()
        self.count, self.clears = count, clears

    def apply(self, kind: str, key: Sequence[int] | None) -> None:
        if kind == "cleared":
            if self.clears:
                self.copies.clear()
        elif kind == "stored":
            assert key is not None
            self.copies[tuple(key)] += 1
        else:
            assert key is not None
            self.copies[tuple(key)] -= 1 if self.count else self.copies[tuple(key)]
            self.copies = +self.copies

    def hits(self, tokens: Sequence[int]) -> int:
        n = 0
        while (n + 1) * self.block_size <= len(tokens) and self.copies[
            tuple(tokens[: (n + 1) * self.block_size])
        ]:
            n += 1
        return n


class SubtreeIndex(CountingIndex):
    """Counts copies, but a removed block takes its cached descendants with it, and removing
    a block it does not hold is an error (as Dynamo's radix tree does)."""

    def apply(self, kind: str, key: Sequence[int] | None) -> None:
        if kind != "removed" or key is None:
            super().apply(kind, key)
            return
        block = tuple(key)
        if not self.copies[block]:
            raise KeyError(f"removed {block}, which the index does not hold")
        super().apply(kind, key)
        if not self.copies[block]:
            for k in [k for k in self.copies if k[: len(block)] == block]:
                del self.copies[k]


def _machine(factory: Any, semantics: IndexSemantics | None = None) -> type[Any]:
    return KVIndexConformance.for_adapter(factory, semantics=semantics)


def test_our_router_index_passes_under_its_declaration() -> None:
    assert machine_for(ReplicaIndexAdapter).__mro__[1] is KVIndexConformance
    run_state_machine_as_test(KVIndexConformance, settings=_PASS)
    assert [d["name"] for d in declared_differences(ReplicaIndexAdapter.semantics)] == ["order"]


@pytest.mark.parametrize(("set_back", "says"), [({"order": "any"}, "the index predicts")])
def test_each_declared_difference_of_our_index_is_needed(
    set_back: dict[str, Any], says: str
) -> None:
    """Without ``order="parents-first"`` a child stored before its parent cannot be keyed."""
    declared = IndexSemantics(**{**{"order": "parents-first"}, **set_back})
    with pytest.raises(AssertionError, match=says):
        run_state_machine_as_test(_machine(ReplicaIndexAdapter, declared), settings=_CATCH)


def test_a_counting_index_passes_any_order_and_copies() -> None:
    run_state_machine_as_test(_machine(CountingIndex), settings=_PASS)


@pytest.mark.parametrize(
    "broken", [{"count": False}, {"clears": False}], ids=["copies-not-counted", "clear-ignored"]
)
def test_a_broken_index_is_caught(broken: dict[str, bool]) -> None:
    def make() -> CountingIndex:
        return CountingIndex(**broken)

    with pytest.raises(AssertionError, match="the index predicts"):
        run_state_machine_as_test(_machine(make, IndexSemantics()), settings=_CATCH)


def test_removals_children_first_is_declarable_and_needed() -> None:
    """An index whose removed parent takes its descendants passes when the engine removes
    children first (in any interleaving with the step's stores); with removals in any order
    the machine sends a parent's removal before its child's and the index fails."""
    run_state_machine_as_test(
        _machine(SubtreeIndex, IndexSemantics(removals="children-first")), settings=_PASS
    )
    with pytest.raises(KeyError, match="which the index does not hold"):
        run_state_machine_as_test(_machine(SubtreeIndex, IndexSemantics()), settings=_CATCH)
    assert [d["name"] for d in declared_differences(IndexSemantics(removals="children-first"))] == [
        "removals"
    ]


def test_index_declarations_name_the_bad_value() -> None:
    with pytest.raises(UsageError, match=r"order must be one of .* got 'random'"):
        IndexSemantics(order="random")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"removals must be one of .* got 'parents-first'"):
        IndexSemantics(removals="parents-first")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="IndexSemantics, got 'any'"):
        KVIndexConformance.for_adapter(CountingIndex, semantics="any")  # type: ignore[arg-type]
