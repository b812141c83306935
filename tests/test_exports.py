"""The public surface is what `__all__` says, and every name in it exists."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = [
    "prefixflight.core",
    "prefixflight.specs",
    "prefixflight.cli",
    "prefixflight.backends",
    "prefixflight.serve",
]
TORCH_PACKAGES = ["prefixflight.backends.torch"]  # need the torch extra


@pytest.mark.parametrize(
    "name", [*PACKAGES, *(pytest.param(n, marks=pytest.mark.torch) for n in TORCH_PACKAGES)]
)
def test_all_is_complete_and_sorted(name: str) -> None:
    if name in TORCH_PACKAGES:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=lambda s: (not s.isupper(), s))
    for item in exported:
        assert hasattr(module, item), item
    public = {n for n in dir(module) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(module, n)).__name__ == "module"}
    assert public - submodules - {"annotations"} == set(exported)
