"""Backends that run real models on prefixflight's core.

Each backend is its own subpackage with its own optional dependencies, imported explicitly:
``import prefixflight.backends.torch`` needs the ``torch`` extra. This package itself imports
nothing heavy: it holds `TINY_LLAMA`, the shape of the tiny random-weight test model
(`prefixflight.backends.torch.tiny_model` builds it).
"""

from ._tiny import TINY_LLAMA

__all__ = ["TINY_LLAMA"]
