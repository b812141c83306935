"""Process settings and device choice for the torch backend.

`prepare_cpu_threads` must run before ``import torch``: OpenMP reads ``OMP_WAIT_POLICY`` once,
when torch loads. With the default (spinning) policy, any other busy process on a small
machine makes a 0.7 s prefill take 8-14 s; ``PASSIVE`` costs nothing when the machine is
quiet. An explicit value set by the user is kept.
"""

from __future__ import annotations

import os

__all__ = ["prepare_cpu_threads"]


def prepare_cpu_threads() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it (call before importing torch)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
