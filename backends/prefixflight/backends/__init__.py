"""Backends that run real models on prefixflight's core.

Each backend is its own subpackage with its own optional dependencies, imported explicitly:
``import prefixflight.backends.torch`` needs the ``torch`` extra. This package itself imports
nothing heavy: it holds `TINY_LLAMA`, the shape of the tiny random-weight test model
(`prefixflight.backends.torch.tiny_model` builds it), and `ATTENTIONS`, the torch runner's
attention paths.
"""

from ._tiny import TINY_LLAMA

__all__ = ["ATTENTIONS", "TINY_LLAMA"]

ATTENTIONS = ("paged", "gather", "vllm-cpu")
"""The torch runner's attention paths (``TransformersRunner(..., attention=)``): ``paged``
(the default), ``gather`` (the reference) and ``vllm-cpu`` (vLLM CPU's kernel, loaded from
a vllm-cpu install)."""
