"""The core is pure: importing it loads no heavy or effectful module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import prefixflight.core
import prefixflight.sim

FORBIDDEN = (
    "torch",
    "transformers",
    "hypothesis",
    "asyncio",
    "threading",
    "time",
    "logging",
    "numpy",
    "tqdm",
)
CORE_DIR = Path(prefixflight.core.__file__).parent
SIM_DIR = Path(prefixflight.sim.__file__).parent
PURE = ("prefixflight.core", "prefixflight.sim")


@pytest.mark.parametrize("package", PURE)
def test_importing_the_core_loads_nothing_forbidden(package: str) -> None:
    # attrs itself imports threading (attr._compat keeps a thread-local for reprs), so we
    # measure what the core adds on top of its one dependency.
    code = (
        f"import sys, attrs; before = set(sys.modules); import {package};"
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("root", [CORE_DIR, SIM_DIR], ids=PURE)
def test_the_core_source_imports_only_stdlib_and_attrs(root: Path) -> None:
    allowed_stdlib = set(sys.stdlib_module_names) - {
        "asyncio",
        "threading",
        "time",
        "logging",
        "socket",
        "subprocess",
        "multiprocessing",
        "os",
        "io",
        "pathlib",
        "random",
    }
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                pure = top in allowed_stdlib or top in ("attrs", "__future__")
                assert pure or name.startswith("prefixflight.core"), (path.name, name)
