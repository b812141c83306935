"""The host's request ids: the flight and routing layers both carry them."""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["RequestId"]

RequestId: TypeAlias = int | str
"""Request ids are the host's; the core never invents them."""
