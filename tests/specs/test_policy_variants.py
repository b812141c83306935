"""Every declarable S3-FIFO variant, and the FIFO, LFU and SIEVE machines, against small
implementations written apart from the reference models.

For each variant: an implementation of it passes when it declares it; the same
implementation is caught when it does not (the declaration is what the machine checks); and
an implementation of prefixflight's default is caught under the variant's declaration (a
broken implementation of the variant). Each single-queue machine passes a correct
implementation and catches a broken one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import UsageError
from prefixflight.specs import (
    FIFOConformance,
    LFUConformance,
    LRUConformance,
    PolicyConformance,
    PolicySemantics,
    S3FIFOConformance,
    SIEVEConformance,
    Unsupported,
    declared_differences,
    machine_for,
    small_ratios,
)

_PASS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    database=None,
    derandomize=True,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)
_CATCH = settings(_PASS, max_examples=400, phases=(Phase.explicit, Phase.generate))
_NO_OPS: dict[str, Any] = {"ops": set()}


class TinyS3FIFO:
    """S3-FIFO with the variants' knobs, written from the paper's description (no pins, no
    removal): a small FIFO, a main FIFO with second chances, a ghost of recent keys."""

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        max_freq: int = 3,
        ghost_admit_freq: int = 0,
        *,
        sizing: str = "round",
        fixed_freq: int | None = None,
        ghost_size: str = "main",
        main_evictions: str = "ghost",
        on_promote: str = "keep",
        ghost_bug: bool = False,
    ) -> None:
        small = {
            "round": round(capacity * small_ratio),
            "floor": int(capacity * small_ratio),
            "floor-min-1": max(1, int(capacity * small_ratio)),
        }[sizing]
        self.small_size, self.main_size = small, capacity - small
        self.ghost_max = {"main": self.main_size, "capacity": capacity, "small": small}[ghost_size]
        self.cap = max_freq if fixed_freq is None else fixed_freq
        self.ghost_freq = ghost_admit_freq
        self.ghost_main, self.on_promote, self.ghost_bug = main_evictions, on_promote, ghost_bug
        self.small: OrderedDict[int, int] = OrderedDict()  # key -> freq, oldest first
        self.main: OrderedDict[int, int] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def resident(self) -> frozenset[int]:
        return frozenset(self.small) | frozenset(self.main)

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def access(self, blocks: Iterable[int]) -> list[int]:
        out: list[int] = []
        for key in blocks:
            for queue in (self.small, self.main):
                if key in queue:
                    queue[key] = min(queue[key] + 1, self.cap)
                    break
            else:
                in_ghost = self.ghost.get(key) is not None if self.ghost_bug else key in self.ghost
                if in_ghost:
                    del self.ghost[key]
                    self._into_main(key, self.ghost_freq, out)
                else:
                    self._into_small(key, out)
        return out

    def _remember(self, key: int) -> None:
        self.ghost.pop(key, None)
        self.ghost[key] = None
        while len(self.ghost) > self.ghost_max:
            self.ghost.popitem(last=False)

    def _into_small(self, key: int, out: list[int]) -> None:
        while len(self.small) >= self.small_size:
            old, freq = self.small.popitem(last=False)
            if freq >= 1:
                carried = {"keep": freq, "reset": 0, "decrement": freq - 1}[self.on_promote]
                self._into_main(old, carried, out)
            else:
                self._remember(old)
                out.append(old)
        self.small[key] = 0

    def _into_main(self, key: int, freq: int, out: list[int]) -> None:
        while len(self.main) >= self.main_size:
            old, f = self.main.popitem(last=False)
            if f:
                self.main[old] = f - 1  # a second chance, at the tail
                continue
            if self.ghost_main == "ghost":
                self._remember(old)
            out.append(old)
            break
        self.main[key] = freq


@st.composite
def _s3fifo_configs(draw: st.DrawFn, sizing: str, fixed: int | None) -> dict[str, Any]:
    """Configs whose small and main queues both hold a block under ``sizing`` (the tiny
    implementation leaves out the empty-queue edge cases the reference covers)."""
    capacity = draw(st.integers(2, 8))
    ratio = draw(small_ratios.filter(lambda r: r > 0))
    small = {"round": round(capacity * ratio), "floor": int(capacity * ratio)}.get(
        sizing, max(1, int(capacity * ratio))
    )
    if not 0 < small < capacity:
        ratio = 0.5
    config: dict[str, Any] = {"capacity": capacity, "small_ratio": ratio}
    cap = fixed if fixed is not None else draw(st.integers(0, 3))
    if fixed is None:
        config["max_freq"] = cap
    config["ghost_admit_freq"] = draw(st.integers(0, cap))
    return config


_KNOB = {"max_freq": "fixed_freq"}  # the declaration's field -> TinyS3FIFO's keyword
VARIANTS = [
    ("sizing", "floor-min-1"),
    ("sizing", "floor"),
    ("max_freq", 2),
    ("ghost_size", "capacity"),
    ("ghost_size", "small"),
    ("main_evictions", "drop"),
    ("on_promote", "reset"),
    ("on_promote", "decrement"),
]


def _s3fifo_machine(impl: dict[str, Any], declared: dict[str, Any]) -> type[PolicyConformance]:
    knobs = {_KNOB.get(k, k): v for k, v in impl.items()}

    def make(**config: Any) -> TinyS3FIFO:
        return TinyS3FIFO(**config, **knobs)

    semantics = PolicySemantics(policy="s3fifo", **_NO_OPS, **declared)
    configs = _s3fifo_configs(impl.get("sizing", "round"), declared.get("max_freq"))
    return S3FIFOConformance.for_factory(make, semantics=semantics, configs=configs)


@pytest.mark.parametrize(("field", "value"), VARIANTS, ids=[f"{f}={v}" for f, v in VARIANTS])
def test_each_s3fifo_variant_is_declarable_and_checked(field: str, value: object) -> None:
    variant: dict[str, Any] = {field: value}
    run_state_machine_as_test(_s3fifo_machine(variant, variant), settings=_PASS)
    with pytest.raises(AssertionError):  # the variant, undeclared
        run_state_machine_as_test(_s3fifo_machine(variant, {}), settings=_CATCH)
    with pytest.raises(AssertionError):  # declared, but the implementation does the default
        run_state_machine_as_test(_s3fifo_machine({}, variant), settings=_CATCH)
    assert [d["name"] for d in declared_differences(PolicySemantics(**variant))] == [field]


def test_the_ghost_check_found_in_the_wild_is_caught() -> None:
    """A ghost check that tests a value that is always ``None``: a ghost block is never
    readmitted to main (found in an S3-FIFO package from PyPI)."""
    run_state_machine_as_test(_s3fifo_machine({}, {}), settings=_PASS)
    with pytest.raises(AssertionError, match=r"differ|gave"):
        run_state_machine_as_test(_s3fifo_machine({"ghost_bug": True}, {}), settings=_CATCH)


# -- FIFO, LFU, SIEVE ---------------------------------------------------------------------------
class TinyFIFO:
    semantics = PolicySemantics(policy="fifo", ops=set())

    def __init__(self, capacity: int, *, refresh: bool = False) -> None:
        self.capacity, self.refresh = capacity, refresh
        self.keys: OrderedDict[int, None] = OrderedDict()

    def resident(self) -> frozenset[int]:
        return frozenset(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def order(self) -> tuple[int, ...]:
        return tuple(self.keys)

    def access(self, blocks: Iterable[int]) -> list[int]:
        out: list[int] = []
        for key in blocks:
            if key in self.keys:
                if self.refresh:  # broken: a hit moves it to the tail (that is LRU)
                    self.keys.move_to_end(key)
                continue
            if self.capacity == 0:
                continue
            if len(self.keys) >= self.capacity:
                out.append(self.keys.popitem(last=False)[0])
            self.keys[key] = None
        return out


class TinyLFU:
    semantics = PolicySemantics(policy="lfu", ops={"evict"}, evictions="observed")

    def __init__(self, capacity: int, *, count_hits: bool = True) -> None:
        self.capacity, self.count_hits = capacity, count_hits
        self.uses: dict[int, list[int]] = {}  # key -> [uses, last use]
        self.clock = 0

    def resident(self) -> frozenset[int]:
        return frozenset(self.uses)

    def __len__(self) -> int:
        return len(self.uses)

    def evict(self) -> None:
        if self.uses:
            del self.uses[min(self.uses, key=lambda k: tuple(self.uses[k]))]

    def access(self, blocks: Iterable[int]) -> None:
        for key in blocks:
            self.clock += 1
            if key in self.uses:
                self.uses[key] = [self.uses[key][0] + self.count_hits, self.clock]
            elif self.capacity:
                if len(self.uses) >= self.capacity:
                    self.evict()
                self.uses[key] = [1, self.clock]


class TinySIEVE:
    semantics = PolicySemantics(policy="sieve", ops=set())

    def __init__(self, capacity: int, *, hand_resets: bool = False) -> None:
        self.capacity, self.hand_resets = capacity, hand_resets
        self.keys: list[int] = []  # oldest first
        self.visited: set[int] = set()
        self.hand = 0  # an index into keys

    def resident(self) -> frozenset[int]:
        return frozenset(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def access(self, blocks: Iterable[int]) -> list[int]:
        out: list[int] = []
        for key in blocks:
            if key in self.keys:
                self.visited.add(key)
                continue
            if self.capacity == 0:
                continue
            if len(self.keys) >= self.capacity:
                i = 0 if self.hand_resets else self.hand
                while self.keys[i] in self.visited:
                    self.visited.discard(self.keys[i])
                    i = (i + 1) % len(self.keys)
                out.append(self.keys.pop(i))
                # the block that was newer than the victim; past the newest: the oldest
                self.hand = i if i < len(self.keys) else 0
            self.keys.append(key)
        return out


SINGLE_QUEUE: list[tuple[type[PolicyConformance], type[Any], dict[str, bool]]] = [
    (FIFOConformance, TinyFIFO, {"refresh": True}),
    (LFUConformance, TinyLFU, {"count_hits": False}),
    (SIEVEConformance, TinySIEVE, {"hand_resets": True}),
]


@pytest.mark.parametrize(("machine", "impl", "broken"), SINGLE_QUEUE, ids=["fifo", "lfu", "sieve"])
def test_single_queue_machines_pass_the_policy_and_catch_a_broken_one(
    machine: type[PolicyConformance], impl: type[Any], broken: dict[str, Any]
) -> None:
    run_state_machine_as_test(machine.for_factory(impl), settings=_PASS)

    def make_broken(capacity: int) -> Any:
        return impl(capacity, **broken)

    make_broken.semantics = impl.semantics  # type: ignore[attr-defined]
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine.for_factory(make_broken), settings=_CATCH)


def test_a_machine_without_an_implementation_says_how_to_build_one() -> None:
    with pytest.raises(UsageError, match=r"FIFOConformance.for_factory\(MyPolicy\)"):
        run_state_machine_as_test(FIFOConformance, settings=_PASS)


# -- declarations the kit refuses before it runs ----------------------------------------------
class NoEvict(TinyFIFO):
    semantics = PolicySemantics(policy="fifo")  # the default ops: pin, remove, evict


def test_an_undeclared_optional_call_is_refused_before_the_run() -> None:
    with pytest.raises(UsageError) as refused:
        FIFOConformance.for_factory(NoEvict)
    assert str(refused.value) == (
        "NoEvict has no evict(), pin(), unpin(), pin_count(), remove(), but its declaration "
        "says it supports 'evict', 'pin', 'remove'; declare what it has: "
        "semantics = PolicySemantics(ops=set(), ...)"
    )

    def make(capacity: int) -> NoEvict:  # a function: refused when it has made one
        return NoEvict(capacity)

    with pytest.raises(UsageError, match="NoEvict has no evict"):
        run_state_machine_as_test(FIFOConformance.for_factory(make), settings=_PASS)
    with pytest.raises(UsageError, match="policy='fifo', but LRUConformance checks 'lru'"):
        LRUConformance.for_factory(TinyFIFO)


def test_declarations_name_the_offending_value() -> None:
    with pytest.raises(UsageError, match="sizing, on_promote declare an S3-FIFO variant"):
        PolicySemantics(policy="lru", sizing="floor", on_promote="reset")
    with pytest.raises(UsageError, match=r"ghost_size must be one of .* got 'half'"):
        PolicySemantics(ghost_size="half")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="max_freq must be an integer >= 0, got -1"):
        PolicySemantics(max_freq=-1)
    with pytest.raises(UsageError, match=r"policy must be one of .* got 'arc'"):
        PolicySemantics(policy="arc")  # type: ignore[arg-type]


def test_unsupported_works_in_a_plain_hypothesis_run() -> None:
    """A factory that takes one capacity in seven: another config is drawn each time, so a
    plain run (every health check on) passes instead of failing for filtering too much."""
    made: list[int] = []

    def only_five(capacity: int) -> TinyFIFO:
        if capacity != 5:
            raise Unsupported(f"capacity {capacity}")
        made.append(capacity)
        return TinyFIFO(capacity)

    only_five.semantics = TinyFIFO.semantics  # type: ignore[attr-defined]
    plain = settings(max_examples=30, derandomize=True, database=None, deadline=None)
    assert HealthCheck.filter_too_much not in plain.suppress_health_check
    run_state_machine_as_test(FIFOConformance.for_factory(only_five), settings=plain)
    assert made and set(made) == {5}


# -- machine_for: the one builder ----------------------------------------------------------------
def test_machine_for_reads_the_declaration_and_the_configs_attribute() -> None:
    """The machine the declaration names; a `configs` attribute (a strategy, or a function
    returning one) narrows what is drawn; without a declaration a check must be named."""
    seen: list[int] = []

    class Narrow(TinyFIFO):
        configs = st.just({"capacity": 3})

        def __init__(self, capacity: int) -> None:
            seen.append(capacity)
            super().__init__(capacity)

    class Lazy(Narrow):
        @staticmethod
        def configs() -> st.SearchStrategy[dict[str, int]]:  # type: ignore[override]
            return st.just({"capacity": 2})

    for cls, capacity in ((Narrow, 3), (Lazy, 2)):
        seen.clear()
        machine = machine_for(cls)
        assert machine.__mro__[1] is FIFOConformance
        run_state_machine_as_test(machine, settings=_PASS)
        assert set(seen) == {capacity}
    assert machine_for(TinyLFU).__mro__[1] is LFUConformance
    assert machine_for(TinySIEVE, check="sieve").__mro__[1] is SIEVEConformance

    def bare(capacity: int) -> TinyFIFO:
        return TinyFIFO(capacity)

    with pytest.raises(UsageError, match="bare declares no semantics"):
        machine_for(bare)
    assert machine_for(bare, check="fifo", semantics=TinyFIFO.semantics).__mro__[1] is (
        FIFOConformance
    )
    with pytest.raises(UsageError, match="without a policy"):
        machine_for(bare, semantics=PolicySemantics(ops=set()))
