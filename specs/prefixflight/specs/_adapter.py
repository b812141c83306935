"""The adapter protocol of `PrefixEngineConformance`: what an engine's adapter provides, and
the views it returns. Needs only attrs (no Hypothesis): an adapter module imports this, so it
can be imported (and declare itself) without the ``specs`` extra."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import attrs

from ._engine_ref import Key

__all__ = [
    "EngineAdapter",
    "KVChange",
    "PoolView",
    "chunk_tokens",
    "label",
    "name_of",
    "semantics_of",
]

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
    (``evict``, ``invalidate``, ``reset``) are called only when the semantics' ``ops``
    declare them, and ``events`` only with ``evictions="reported"``; ``check_invariants`` and
    ``close`` are called when present.
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


def semantics_of(factory: Callable[..., Any]) -> Any:
    """``factory.semantics``, looking through `functools.partial` (``None`` if absent)."""
    current: Any = factory
    while current is not None:
        found = getattr(current, "semantics", None)
        if found is not None:
            return found
        current = getattr(current, "func", None)  # functools.partial
    return None


def name_of(factory: Callable[..., Any]) -> str:
    while not hasattr(factory, "__name__") and hasattr(factory, "func"):
        factory = factory.func
    return getattr(factory, "__name__", type(factory).__name__)
