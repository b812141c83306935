"""The core's eviction policies by name: the one list that every name -> class switch (the
replay and sweep commands, the engine's and vLLM plugin's ``eviction`` settings, the specs'
scheduler machine) reads. A new policy is one class here."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias, cast

from .._errors import ConfigError
from ._policies import LRU, S3FIFO, EvictionPolicy

__all__ = ["POLICIES", "PolicyName", "make_policy", "policy_name"]

PolicyName: TypeAlias = Literal["s3fifo", "lru"]

POLICIES: Final[Mapping[PolicyName, type[S3FIFO] | type[LRU]]] = MappingProxyType(
    {"s3fifo": S3FIFO, "lru": LRU}
)
"""Name -> policy class, in the order commands list them (S3FIFO, the replay default, first).
Each class takes ``capacity`` and the keyword settings its ``SETTINGS`` names."""


def policy_name(value: object, what: str = "policy") -> PolicyName:
    """``value`` (any case) as a registered policy name; `ConfigError` naming it otherwise."""
    name = value.lower() if isinstance(value, str) else value
    if not isinstance(name, str) or name not in POLICIES:
        choices = " or ".join(repr(n) for n in POLICIES)
        raise ConfigError(f"{what} must be {choices} (any case), got {value!r}")
    return cast("PolicyName", name)


def make_policy(name: str, capacity: int, **settings: Any) -> EvictionPolicy:
    """The policy registered as ``name`` over ``capacity`` blocks, given those of
    ``settings`` it takes (its class's ``SETTINGS``; the others belong to other policies)."""
    cls = POLICIES[policy_name(name)]
    return cls(capacity, **{k: v for k, v in settings.items() if k in cls.SETTINGS})
