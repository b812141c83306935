"""The adapter protocol of `PrefixEngineConformance`: what an engine's adapter provides, and
the views it returns. Needs only attrs (no Hypothesis): an adapter module imports this, so it
can be imported (and declare itself) without the ``specs`` extra."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import attrs

from prefixflight.core import UsageError

from ._engine_ref import Key

__all__ = [
    "NO_OP",
    "EngineAdapter",
    "IndexAdapter",
    "KVChange",
    "PolicyAdapter",
    "PoolView",
    "chunk_tokens",
    "class_of",
    "configs_of",
    "label",
    "name_of",
    "require_calls",
    "semantics_of",
]

NO_OP = "(this step does nothing)"
"""What a machine notes for a step that does nothing (a rule that acts on one draw in three);
reports drop it, with the step it marks, from a shrunk example."""

ALPHABET = "abcd"
"""The chunks the machines build prompts from: chunk ``i`` is named ``ALPHABET[i]``."""


KVChange: TypeAlias = tuple[Literal["stored", "removed", "cleared"], "Key | None"]
"""One KV event, as an adapter reports it: a block stored or removed (one copy), or all
cleared (``None``)."""


def chunk_tokens(chunk: int, block_size: int) -> tuple[int, ...]:
    """The token ids of chunk ``chunk`` (``0`` is ``a``): real ids, distinct per chunk."""
    return tuple(1000 + 97 * chunk + i for i in range(block_size))


def label(tokens: Sequence[int], block_size: int) -> str:
    """A prompt or key by its chunks: ``a.b`` for two full blocks, ``a.b+5c`` when 5 tokens
    of chunk ``c`` follow; a block that is no chunk (sampled tokens) is ``?``."""
    names = {chunk_tokens(c, block_size): n for c, n in enumerate(ALPHABET)}
    bs = block_size
    full = len(tokens) - len(tokens) % bs
    parts = [names.get(tuple(tokens[i : i + bs]), "?") for i in range(0, full, bs)]
    head = ".".join(parts)
    tail = tuple(tokens[full:])
    if not tail:
        return head
    chunk = next((n for t, n in names.items() if t[: len(tail)] == tail), "?")
    return f"{head}+{len(tail)}{chunk}" if head else f"{len(tail)}{chunk}"


@attrs.frozen
class PoolView:
    """Where every page is, as the engine sees it.

    ``free``: pages holding nothing; ``cached``: page -> the block it holds (in use or not);
    ``held``: request id -> every page the running request holds (cached or not).
    """

    free: frozenset[int]
    cached: Mapping[int, Key]
    held: Mapping[str, frozenset[int]]


@runtime_checkable
class EngineAdapter(Protocol):
    """An engine's prefix cache behind the calls the machine makes.

    Required: ``block_size``, ``admit``, ``finish``, ``pool``. The optional operations
    (``evict``, ``invalidate``, ``reset``, and ``hit_stats`` for ``"stats"``) are called only
    when the semantics' ``ops`` declare them, and ``events`` only with
    ``evictions="reported"``; ``check_invariants`` and ``close`` are called when present.
    ``hit_stats()`` returns ``(queried, hit)``: the prompt tokens the engine's own hit-rate
    accounting has counted as looked up and as hit so far.
    """

    block_size: int

    def admit(self, rid: str, tokens: Sequence[int]) -> int | None:
        """Look the prompt up, hold its hit, allocate its other pages; return the hit
        tokens, or ``None`` (and nothing held) if the engine cannot take it now."""
        ...

    def finish(self, rid: str) -> None:
        """The request is done: its computed full blocks are published (unless the engine
        registered them at admission) and everything it held is released."""
        ...

    def pool(self) -> PoolView:
        """Where every page is now."""
        ...


@runtime_checkable
class PolicyAdapter(Protocol):
    """An eviction policy, as the policy machines (`S3FIFOConformance`, `LRUConformance`,
    `FIFOConformance`, `LFUConformance`, `SIEVEConformance`) drive it.

    A factory (a class, a function, a `functools.partial`) makes one per example from a
    config's keywords (S3-FIFO: ``capacity``, ``small_ratio``, ``max_freq``,
    ``ghost_admit_freq``; the others: ``capacity``) and may raise `Unsupported` for a config
    it does not take (another is drawn). Its ``semantics`` attribute (a `PolicySemantics`)
    declares the machine (``policy``), the optional calls it has (``ops``) and how it
    differs; its ``configs`` attribute, if any, is the Hypothesis strategy of configs to
    draw instead of the machine's.

    Required: ``access`` and ``resident``. Called when present: ``__len__`` (must equal the
    number of resident blocks the reference has), the views the machine's reference has
    (S3-FIFO: ``small_queue()``, ``main_queue()`` as ``((block, freq), ...)`` oldest first,
    ``ghost_queue()`` as ``(block, ...)``; LRU and FIFO: ``order()``, oldest first),
    ``check_invariants()`` (raise `AssertionError` for a broken invariant) and ``close()``.
    Optional, called only when declared in ``ops``: ``pin(block)``/``unpin(block)``/
    ``pin_count(block)`` (nestable pins: a pinned block is never evicted), ``remove(block)``
    and ``evict()`` (evict one block; ``None`` when none can be).

    Misuse must raise `prefixflight.core.UsageError` and change nothing: pinning or removing
    a block that is not resident, unpinning one that is not pinned, removing a pinned one.
    When every resident block is pinned and a new block must come in, ``access`` raises
    `prefixflight.core.CapacityError` with ``applied`` the number of blocks of the call it
    had taken in.
    """

    def access(self, blocks: Sequence[Any]) -> list[Any] | None:
        """Use ``blocks`` in order (a hit refreshes a block, a miss admits it, evicting as
        needed); return the evicted blocks in order (``evictions="reported"``), or anything
        (``"observed"``: the machine compares the resident set before and after)."""
        ...

    def resident(self) -> frozenset[Any]:
        """The blocks cached now (an S3-FIFO's ghost entries are not resident)."""
        ...


@runtime_checkable
class IndexAdapter(Protocol):
    """A KV-event consumer (a router's index of an engine's cache), as `KVIndexConformance`
    drives it: a zero-argument factory makes one per example; its ``semantics`` attribute
    (an `IndexSemantics`) declares the event streams it handles. ``check_invariants()`` and
    ``close()`` are called when present."""

    block_size: int

    def apply(self, kind: Literal["stored", "removed", "cleared"], key: Key | None) -> None:
        """One KV event: a copy of block ``key`` (the tokens from the prompt's start to the
        block's end) was stored or removed, or everything was cleared (``key`` ``None``)."""
        ...

    def hits(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` the index says the engine caches."""
        ...


def semantics_of(factory: Callable[..., Any]) -> Any:
    """``factory.semantics``, looking through `functools.partial` (``None`` if absent)."""
    current: Any = factory
    while current is not None:
        found = getattr(current, "semantics", None)
        if found is not None:
            return found
        current = getattr(current, "func", None)  # functools.partial
    return None


def configs_of(factory: Callable[..., Any]) -> Any:
    """``factory.configs`` (a Hypothesis strategy of the keyword dicts to draw), looking
    through `functools.partial`; ``None`` if absent. A method is called for it, so a class
    can build its strategy lazily (``configs = staticmethod(my_configs)``)."""
    current: Any = factory
    while current is not None:
        found = getattr(current, "configs", None)
        if found is not None:
            return found() if callable(found) and not hasattr(found, "example") else found
        current = getattr(current, "func", None)
    return None


def class_of(factory: Any) -> type[Any] | None:
    """The class ``factory`` makes objects of, when it is one (or a `functools.partial` of
    one); ``None`` for other callables."""
    while not isinstance(factory, type) and callable(getattr(factory, "func", None)):
        factory = factory.func  # functools.partial
    return factory if isinstance(factory, type) else None


def require_calls(
    subject: Any,
    calls: Mapping[str, Sequence[str]],
    declared: frozenset[str],
    hint: Callable[[set[str]], str],
) -> None:
    """Refuse an implementation without the calls its declaration promises, before it is
    driven: `UsageError` naming the missing calls and ``hint(the operations it has)``, the
    declaration to write instead.

    ``subject`` is an implementation's class (checked before the run, unless it forwards
    attributes through ``__getattr__``) or an object a factory made; ``calls`` maps each
    optional operation to the calls it needs (``""``: the calls every implementation needs).
    """
    name = subject.__name__ if isinstance(subject, type) else type(subject).__name__
    if isinstance(subject, type) and hasattr(subject, "__getattr__"):
        return  # it forwards calls: only an object it makes can tell
    required = [c for c in calls.get("", ()) if not hasattr(subject, c)]
    if required:
        needed = ", ".join(calls[""])
        raise UsageError(f"{name} has no {', '.join(required)} (every one needs {needed})")
    lacking = {op: [c for c in calls[op] if not hasattr(subject, c)] for op in sorted(declared)}
    lacking = {op: missing for op, missing in lacking.items() if missing}
    if lacking:
        names = ", ".join(f"{c}()" for missing in lacking.values() for c in missing)
        raise UsageError(
            f"{name} has no {names}, but its declaration says it supports "
            f"{', '.join(map(repr, lacking))}; declare what it has: "
            f"{hint(set(declared) - set(lacking))}"
        )


def name_of(factory: Callable[..., Any]) -> str:
    while not hasattr(factory, "__name__") and hasattr(factory, "func"):
        factory = factory.func
    return getattr(factory, "__name__", type(factory).__name__)
