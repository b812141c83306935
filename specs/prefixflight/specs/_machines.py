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
(the example is discarded), and ``configs=`` narrows the configs drawn. The declaration (the
``semantics=`` argument, else the factory's ``semantics`` attribute) says which optional
calls exist (``pin``, ``remove``, ``evict``), whether evictions are returned or only
observable, and which S3-FIFO variant the reference follows.

After every step the machine compares residency, the queues (when the implementation
exposes ``small_queue``/``main_queue``/``ghost_queue`` or ``order``), the evicted blocks
(returned, or the resident set's change) and the pin counts, and calls the implementation's
``check_invariants()`` if it has one. Every failure names the step and both views.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import assume, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import LRU, S3FIFO, CapacityError, UsageError

from ._adapter import name_of, semantics_of
from ._declare import PolicySemantics, Unsupported
from ._reference import ReferenceLRU, ReferenceS3FIFO
from ._strategies import s3fifo_configs

__all__ = ["LRUConformance", "PolicyConformance", "S3FIFOConformance"]

_KEYS = st.integers(0, 11)
_VIEWS = ("small_queue", "main_queue", "ghost_queue", "order")
_OBSERVED = ("access", "evict")  # the calls whose evictions are observed, not returned


def s3fifo_reference(config: dict[str, Any], semantics: PolicySemantics) -> ReferenceS3FIFO:
    """`ReferenceS3FIFO` for ``config``, following the declared S3-FIFO variant."""
    return ReferenceS3FIFO(
        **config,
        sizing=semantics.sizing,
        promote_at=semantics.promote_at,
        small_queue=semantics.small_queue,
        min_small_blocks=semantics.min_small_blocks,
    )


class PolicyConformance(RuleBasedStateMachine):
    """Shared rules; subclasses choose the reference model and the configurations."""

    factory: ClassVar[Callable[..., Any]]
    reference: ClassVar[Callable[..., Any]]
    semantics: ClassVar[PolicySemantics] = PolicySemantics()
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]]

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
        prefixflight's; ``configs`` replaces the configs drawn (a strategy of keyword dicts).
        """
        declared = semantics or semantics_of(factory) or PolicySemantics()
        if not isinstance(declared, PolicySemantics):
            raise TypeError(f"semantics must be a PolicySemantics, got {declared!r}")
        body: dict[str, Any] = {"factory": staticmethod(factory), "semantics": declared}
        if configs is not None:
            body["configs"] = configs
        return type(f"{cls.__name__}_{name_of(factory)}", (cls,), body)

    @classmethod
    def make_reference(cls, config: dict[str, Any]) -> Any:
        """The reference model for ``config`` under the class's declaration."""
        return cls.reference(**config)

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        config = data.draw(type(self).configs, label="config")
        note(f"config: {config}")
        self.config = config
        try:
            self.impl = type(self).factory(**config)
        except Unsupported as exc:
            note(f"unsupported config: {exc}")
            assume(False)
        self.ref = type(self).make_reference(config)
        self.step = f"start({config})"

    def teardown(self) -> None:
        close = getattr(getattr(self, "impl", None), "close", None)
        if callable(close):
            close()

    def _has(self, op: str) -> bool:
        return hasattr(self, "impl") and op in type(self).semantics.ops

    def _snapshot(self) -> tuple[object, ...]:
        views = tuple(
            getattr(self.impl, v)() for v in _VIEWS if callable(getattr(self.impl, v, None))
        )
        return (self.impl.resident(), len(self.impl), *views)

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

    @rule(blocks=st.lists(_KEYS, max_size=4))
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
        if not hasattr(self, "impl"):
            return
        after = f"after {self.step}"
        mine, theirs = self.impl.resident(), self.ref.resident()
        assert mine == theirs, (
            f"{after}: resident blocks differ: the implementation has {sorted(mine)}, the "
            f"reference {sorted(theirs)} (config {self.config})"
        )
        assert len(self.impl) == len(self.ref), (
            f"{after}: len() is {len(self.impl)}, the reference's {len(self.ref)}"
        )
        for view in _VIEWS:
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


class S3FIFOConformance(PolicyConformance):
    """An S3FIFO implementation against `ReferenceS3FIFO`; configs are tiny and odd."""

    factory: ClassVar[Callable[..., Any]] = S3FIFO
    reference: ClassVar[Callable[..., Any]] = ReferenceS3FIFO
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = s3fifo_configs()

    @classmethod
    def make_reference(cls, config: dict[str, Any]) -> Any:
        return s3fifo_reference(config, cls.semantics)


class LRUConformance(PolicyConformance):
    """An LRU implementation against `ReferenceLRU`."""

    factory: ClassVar[Callable[..., Any]] = LRU
    reference: ClassVar[Callable[..., Any]] = ReferenceLRU
    configs: ClassVar[st.SearchStrategy[dict[str, Any]]] = st.builds(
        lambda capacity: {"capacity": capacity}, st.integers(0, 6)
    )
