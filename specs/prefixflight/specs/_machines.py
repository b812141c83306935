"""Stateful conformance machines: an implementation and a reference model side by side.

Run against ours, or against your own policy::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import PolicySemantics, S3FIFOConformance

    run_state_machine_as_test(S3FIFOConformance.for_factory(MyS3FIFO))
    run_state_machine_as_test(
        S3FIFOConformance.for_factory(
            MyS3FIFO, semantics=PolicySemantics(ops={"remove"}, evictions="observed")
        )
    )

The factory is called with a config's keywords (any callable: a class, a function, a
`functools.partial`); it may raise `Unsupported` for a config it declares it does not take
(another config is drawn), and ``configs=`` (else the factory's ``configs`` attribute)
narrows the configs drawn. The declaration (the ``semantics=`` argument, else the factory's
``semantics`` attribute) says which optional calls exist (``pin``, ``remove``, ``evict``),
whether evictions are returned or only observable, and which S3-FIFO variant the reference
follows. A declared call the implementation does not have is refused before the run
(`UsageError`, naming the declaration to write), not reported as a finding.

After every step the machine compares residency, the views the implementation exposes
(S3-FIFO: ``small_queue``/``main_queue``/``ghost_queue``; LRU and FIFO: ``order``), the
evicted blocks (returned, or the resident set's change) and the pin counts, and calls the
implementation's ``check_invariants()`` if it has one. Every failure names the step and both
views. The protocol an implementation follows is `PolicyAdapter`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import LRU, S3FIFO, CapacityError, UsageError

from ._adapter import class_of, configs_of, name_of, require_calls, semantics_of
from ._declare import PolicySemantics
from ._reference import (
    ReferenceFIFO,
    ReferenceLFU,
    ReferenceLRU,
    ReferenceS3FIFO,
    ReferenceSIEVE,
)
from ._strategies import capacity_configs, draw_supported, s3fifo_configs

__all__ = [
    "FIFOConformance",
    "LFUConformance",
    "LRUConformance",
    "PolicyConformance",
    "S3FIFOConformance",
    "SIEVEConformance",
]

_KEYS = st.integers(0, 15)
_OBSERVED = ("access", "evict")  # the calls whose evictions are observed, not returned
POLICY_CALLS: dict[str, tuple[str, ...]] = {
    "": ("access", "resident"),
    "pin": ("pin", "unpin", "pin_count"),
    "remove": ("remove",),
    "evict": ("evict",),
}
"""The calls a policy must have: always (``""``), and per declared operation."""


def s3fifo_reference(config: dict[str, Any], semantics: PolicySemantics) -> ReferenceS3FIFO:
    """`ReferenceS3FIFO` for ``config``, following the declared S3-FIFO variant."""
    fixed = {} if semantics.max_freq is None else {"max_freq": semantics.max_freq}
    return ReferenceS3FIFO(
        **{**config, **fixed},
        sizing=semantics.sizing,
        promote_at=semantics.promote_at,
        small_queue=semantics.small_queue,
        min_small_blocks=semantics.min_small_blocks,
        ghost_size=semantics.ghost_size,
        main_evictions=semantics.main_evictions,
        on_promote=semantics.on_promote,
    )


class PolicyConformance(RuleBasedStateMachine):
    """Shared rules; subclasses choose the reference model and the configurations."""

    factory: ClassVar[Callable[..., Any] | None] = None
    reference: ClassVar[Callable[..., Any]]
    semantics: ClassVar[PolicySemantics] = PolicySemantics()
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]]
    policy: ClassVar[str] = ""  # the `PolicySemantics.policy` this machine checks
    views: ClassVar[tuple[str, ...]] = ()  # the reference's views, compared when exposed

    impl: Any
    ref: Any

    @classmethod
    def for_factory(
        cls,
        factory: Callable[..., Any],
        *,
        semantics: PolicySemantics | None = None,
        configs: st.SearchStrategy[dict[str, Any]] | None = None,
    ) -> type[PolicyConformance]:
        """A machine that checks ``factory``'s policies (called with a config's keywords).

        ``semantics`` defaults to ``factory.semantics`` (through `functools.partial`), else
        prefixflight's; ``configs`` replaces the configs drawn (a strategy of keyword dicts;
        default: ``factory.configs`` if it has one). Raises `UsageError` when the
        declaration names another policy, or declares a call a class factory lacks.
        """
        declared = semantics or semantics_of(factory) or PolicySemantics()
        if not isinstance(declared, PolicySemantics):
            raise UsageError(f"semantics must be a PolicySemantics, got {declared!r}")
        if declared.policy not in (None, cls.policy):
            raise UsageError(
                f"{name_of(factory)} declares policy={declared.policy!r}, but "
                f"{cls.__name__} checks {cls.policy!r}"
            )
        cls_made = class_of(factory)
        if cls_made is not None:
            require_calls(cls_made, POLICY_CALLS, declared.ops, _declaration_hint)
        body: dict[str, Any] = {"factory": staticmethod(factory), "semantics": declared}
        narrowed = configs if configs is not None else configs_of(factory)
        if narrowed is not None:
            body["configs"] = narrowed
        elif cls.policy == "s3fifo" and declared.max_freq is not None:
            body["configs"] = s3fifo_configs(max_freq=declared.max_freq)
        return type(f"{cls.__name__}_{name_of(factory)}", (cls,), body)

    @classmethod
    def make_reference(cls, config: dict[str, Any]) -> Any:
        """The reference model for ``config`` under the class's declaration."""
        return cls.reference(**config)

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        factory = type(self).factory
        if factory is None:
            raise UsageError(
                f"{type(self).__name__} has no implementation to check: build it with "
                f"{type(self).__name__}.for_factory(MyPolicy)"
            )
        config, impl = draw_supported(
            data, type(self).configs, lambda c: factory(**c), label="config"
        )
        note(f"config: {config}")
        self.config = config
        self.impl = impl
        require_calls(impl, POLICY_CALLS, type(self).semantics.ops, _declaration_hint)
        self.ref = type(self).make_reference(config)
        self.step = f"start({config})"

    def teardown(self) -> None:
        close = getattr(getattr(self, "impl", None), "close", None)
        if callable(close):
            close()

    def _has(self, op: str) -> bool:
        return op in type(self).semantics.ops

    def _snapshot(self) -> tuple[object, ...]:
        exposed = [getattr(self.impl, v, None) for v in type(self).views]
        views = tuple(view() for view in exposed if callable(view))
        size = len(self.impl) if hasattr(self.impl, "__len__") else None
        return (self.impl.resident(), size, *views)

    def _both(self, method: str, *args: Any) -> Any:
        """Call ``method`` on both; they must agree on the result or on the error (for an
        eviction that is observed, not returned: on the blocks that left)."""
        call = f"{method}{args}" if len(args) != 1 else f"{method}({args[0]!r})"
        self.step = call
        observed = method in _OBSERVED and type(self).semantics.evictions == "observed"
        before = self._snapshot()
        ref_before = self.ref.resident()
        try:
            want = getattr(self.ref, method)(*args)
        except (UsageError, CapacityError) as exc:
            try:
                getattr(self.impl, method)(*args)
            except type(exc) as err:
                assert getattr(err, "applied", 0) == getattr(exc, "applied", 0), (
                    f"{call}: the implementation applied {getattr(err, 'applied', 0)} blocks "
                    f"before failing, the reference {getattr(exc, 'applied', 0)}"
                )
                if getattr(exc, "applied", 0) == 0:
                    assert self._snapshot() == before, f"{call}: a rejected call changed the state"
                return None
            raise AssertionError(
                f"{call}: the reference raised {exc!r}, the implementation did not"
            ) from None
        got = getattr(self.impl, method)(*args)
        if observed:
            got = sorted(before[0] - self.impl.resident(), key=repr)
            want = sorted(ref_before - self.ref.resident(), key=repr)
            assert got == want, (
                f"{call}: {got} left the implementation, {want} left the reference "
                f"(config {self.config})"
            )
            return got
        assert got == want, f"{call}: the implementation gave {got!r}, the reference {want!r}"
        return got

    @rule(blocks=st.lists(_KEYS, min_size=1, max_size=4))  # never an empty, no-op step
    def access(self, blocks: list[int]) -> None:
        evicted = self._both("access", blocks)
        note(f"access {blocks} -> evicted {evicted}")

    @precondition(lambda self: self._has("pin") and len(self.ref) > 0)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.ref.resident())))
        self._both("pin", block)

    @precondition(lambda self: self._has("pin") and bool(self.ref.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.ref.pins)))
        self._both("unpin", block)

    @precondition(lambda self: self._has("pin") or self._has("remove"))
    @rule(block=_KEYS)
    def misuse(self, block: int) -> None:
        """Pin/unpin/remove of arbitrary blocks: errors must match and change nothing."""
        pins = self._has("pin")
        if pins:
            self._both("pin_count", block)
        if block not in self.ref:
            if pins:
                self._both("pin", block)
            if self._has("remove"):
                self._both("remove", block)
        if pins and self.ref.pin_count(block) == 0:
            self._both("unpin", block)

    @precondition(lambda self: self._has("evict"))
    @rule()
    def evict(self) -> None:
        note(f"evict -> {self._both('evict')}")

    @precondition(lambda self: self._has("remove") and len(self.ref) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.ref.resident())))
        self._both("remove", block)

    @invariant()
    def agrees_with_reference(self) -> None:
        after = f"after {self.step}"
        mine, theirs = self.impl.resident(), self.ref.resident()
        assert mine == theirs, (
            f"{after}: resident blocks differ: the implementation has {sorted(mine)}, the "
            f"reference {sorted(theirs)} (config {self.config})"
        )
        if hasattr(self.impl, "__len__"):
            assert len(self.impl) == len(self.ref), (
                f"{after}: len() is {len(self.impl)}, the reference's {len(self.ref)}"
            )
        for view in type(self).views:
            got = getattr(self.impl, view, None)
            if callable(got):
                want = getattr(self.ref, view)()
                assert got() == want, f"{after}: {view}() is {got()}, the reference's {want}"
        if self._has("pin"):
            for block in theirs:
                n, m = self.impl.pin_count(block), self.ref.pin_count(block)
                assert n == m, f"{after}: pin_count({block!r}) is {n}, the reference's {m}"
        check = getattr(self.impl, "check_invariants", None)
        if callable(check):
            check()


def _declaration_hint(has: set[str]) -> str:
    ops = "{" + ", ".join(map(repr, sorted(has))) + "}" if has else "set()"
    return f"semantics = PolicySemantics(ops={ops}, ...)"


class S3FIFOConformance(PolicyConformance):
    """An S3FIFO implementation against `ReferenceS3FIFO`; configs are tiny and odd."""

    factory: ClassVar[Callable[..., Any] | None] = S3FIFO
    reference: ClassVar[Callable[..., Any]] = ReferenceS3FIFO
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = s3fifo_configs()
    policy: ClassVar[str] = "s3fifo"
    views: ClassVar[tuple[str, ...]] = ("small_queue", "main_queue", "ghost_queue")

    @classmethod
    def make_reference(cls, config: dict[str, Any]) -> Any:
        return s3fifo_reference(config, cls.semantics)


class LRUConformance(PolicyConformance):
    """An LRU implementation against `ReferenceLRU`."""

    factory: ClassVar[Callable[..., Any] | None] = LRU
    reference: ClassVar[Callable[..., Any]] = ReferenceLRU
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = capacity_configs()
    policy: ClassVar[str] = "lru"
    views: ClassVar[tuple[str, ...]] = ("order",)


class FIFOConformance(PolicyConformance):
    """A FIFO implementation against `ReferenceFIFO` (no implementation of ours: build it
    with ``for_factory``)."""

    reference: ClassVar[Callable[..., Any]] = ReferenceFIFO
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = capacity_configs()
    policy: ClassVar[str] = "fifo"
    views: ClassVar[tuple[str, ...]] = ("order",)


class LFUConformance(PolicyConformance):
    """An LFU implementation against `ReferenceLFU` (build it with ``for_factory``)."""

    reference: ClassVar[Callable[..., Any]] = ReferenceLFU
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = capacity_configs()
    policy: ClassVar[str] = "lfu"


class SIEVEConformance(PolicyConformance):
    """A SIEVE implementation against `ReferenceSIEVE` (build it with ``for_factory``)."""

    reference: ClassVar[Callable[..., Any]] = ReferenceSIEVE
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = capacity_configs()
    policy: ClassVar[str] = "sieve"
