"""Stateful conformance machines: an implementation and a reference model side by side.

Run against ours, or against your own policy::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import S3FIFOConformance

    run_state_machine_as_test(S3FIFOConformance.for_factory(MyS3FIFO))

After every step the machine compares residency, the queues (when the implementation
exposes ``small_queue``/``main_queue``/``ghost_queue`` or ``order``), the evicted blocks and
the pin counts, and calls the implementation's ``check_invariants()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import LRU, S3FIFO, CapacityError, EvictionPolicy, UsageError

from ._reference import ReferenceLRU, ReferenceS3FIFO
from ._strategies import s3fifo_configs

__all__ = ["LRUConformance", "PolicyConformance", "S3FIFOConformance"]

_KEYS = st.integers(0, 11)
_VIEWS = ("small_queue", "main_queue", "ghost_queue", "order")


class PolicyConformance(RuleBasedStateMachine):
    """Shared rules; subclasses choose the reference model and the configurations."""

    factory: ClassVar[Callable[..., EvictionPolicy]]
    reference: ClassVar[Callable[..., Any]]

    impl: EvictionPolicy
    ref: Any

    @classmethod
    def for_factory(cls, factory: Callable[..., EvictionPolicy]) -> type[PolicyConformance]:
        """A machine that checks ``factory``'s policies (called with the config's keywords)."""
        name = getattr(factory, "__name__", "custom")
        return type(f"{cls.__name__}_{name}", (cls,), {"factory": staticmethod(factory)})

    def _start(self, config: dict[str, Any]) -> None:
        note(f"config: {config}")
        self.impl = type(self).factory(**config)
        self.ref = type(self).reference(**config)

    def _snapshot(self) -> tuple[object, ...]:
        views = tuple(
            getattr(self.impl, v)() for v in _VIEWS if callable(getattr(self.impl, v, None))
        )
        return (self.impl.resident(), len(self.impl), *views)

    def _both(self, method: str, *args: Any) -> Any:
        """Call ``method`` on both; they must agree on the result or on the error."""
        before = self._snapshot()
        try:
            want = getattr(self.ref, method)(*args)
        except (UsageError, CapacityError) as exc:
            try:
                getattr(self.impl, method)(*args)
            except type(exc) as err:
                assert getattr(err, "applied", 0) == getattr(exc, "applied", 0)
                if getattr(exc, "applied", 0) == 0:
                    assert self._snapshot() == before, "a rejected call changed the state"
                return None
            raise AssertionError(
                f"{method}{args}: reference raised {exc!r}, impl did not"
            ) from None
        got = getattr(self.impl, method)(*args)
        assert got == want, f"{method}{args}: impl gave {got!r}, reference {want!r}"
        return got

    @rule(blocks=st.lists(_KEYS, max_size=4))
    def access(self, blocks: list[int]) -> None:
        evicted = self._both("access", blocks)
        note(f"access {blocks} -> evicted {evicted}")

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.ref.resident())))
        self._both("pin", block)

    @precondition(lambda self: bool(self.ref.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.ref.pins)))
        self._both("unpin", block)

    @rule(block=_KEYS)
    def misuse(self, block: int) -> None:
        """Pin/unpin/remove of arbitrary blocks: errors must match and change nothing."""
        self._both("pin_count", block)
        if block not in self.ref:
            self._both("pin", block)
            self._both("remove", block)
        if self.ref.pin_count(block) == 0:
            self._both("unpin", block)

    @rule()
    def evict(self) -> None:
        self._both("evict")

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.ref.resident())))
        self._both("remove", block)

    @invariant()
    def agrees_with_reference(self) -> None:
        if not hasattr(self, "impl"):
            return
        assert self.impl.resident() == self.ref.resident()
        assert len(self.impl) == len(self.ref)
        for view in _VIEWS:
            mine = getattr(self.impl, view, None)
            if callable(mine):
                assert mine() == getattr(self.ref, view)(), view
        for block in self.ref.resident():
            assert self.impl.pin_count(block) == self.ref.pin_count(block)
        self.impl.check_invariants()


class S3FIFOConformance(PolicyConformance):
    """An S3FIFO implementation against `ReferenceS3FIFO`; configs are tiny and odd."""

    factory: ClassVar[Callable[..., EvictionPolicy]] = S3FIFO
    reference: ClassVar[Callable[..., Any]] = ReferenceS3FIFO

    @initialize(config=s3fifo_configs())
    def start(self, config: dict[str, Any]) -> None:
        self._start(config)


class LRUConformance(PolicyConformance):
    """An LRU implementation against `ReferenceLRU`."""

    factory: ClassVar[Callable[..., EvictionPolicy]] = LRU
    reference: ClassVar[Callable[..., Any]] = ReferenceLRU

    @initialize(capacity=st.integers(0, 6))
    def start(self, capacity: int) -> None:
        self._start({"capacity": capacity})
