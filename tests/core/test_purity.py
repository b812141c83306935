"""The core is pure: importing it loads no heavy or effectful module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import prefixflight.core

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


def test_importing_the_core_loads_nothing_forbidden() -> None:
    # attrs itself imports threading (attr._compat keeps a thread-local for reprs), so we
    # measure what the core adds on top of its one dependency.
    code = (
        "import sys, attrs; before = set(sys.modules); import prefixflight.core;"
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_core_source_imports_only_stdlib_and_attrs() -> None:
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
    for path in CORE_DIR.glob("*.py"):
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
                assert top in allowed_stdlib or top in ("attrs", "__future__"), (path.name, name)
