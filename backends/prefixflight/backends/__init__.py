"""Backends that run real models on prefixflight's core.

Each backend is its own subpackage with its own optional dependencies, imported explicitly:
``import prefixflight.backends.torch`` needs the ``torch`` extra. This package itself imports
nothing heavy.
"""

__all__: list[str] = []
