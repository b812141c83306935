"""Optional compiled build: ``PREFIXFLIGHT_COMPILE=1 pip install .`` compiles the cache's hot
modules with mypyc into a platform wheel. Without the variable (the default) the wheel is pure
Python and this hook does nothing.

The compiled modules are the same source files, type-checked and translated to C by mypyc; the
pure-Python files stay in the wheel next to the extensions (Python imports the extension
first), so the source the tests read and the code that runs are the same text.
``prefixflight.core.cache.compiled`` tells at runtime which variant was imported. The module list
lives in pyproject.toml (``compile-modules`` of this hook); a test checks that it matches
``prefixflight.core.cache._build.COMPILED_MODULES``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ENV = "PREFIXFLIGHT_COMPILE"
# what mypyc needs at build time (it ships with mypy; setuptools drives the C compiler)
BUILD_REQUIRES = ["mypy>=1.13", "setuptools>=70", "attrs>=24.2"]


def _wanted() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


class CustomBuildHook(BuildHookInterface[Any]):
    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        return list(BUILD_REQUIRES) if _wanted() else []

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable" or not _wanted():
            return
        modules: list[str] = list(self.config.get("compile-modules", []))
        if not modules:
            raise ValueError("hatch_build.py: compile-modules is empty")
        root = Path(self.root)
        work = Path(tempfile.mkdtemp(prefix="prefixflight-mypyc-"))
        try:
            src = work / "core"
            shutil.copytree(
                root / "core", src, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd")
            )
            paths = [str(Path(*m.split("."))) + ".py" for m in modules]
            cmd = [sys.executable, "-m", "mypyc", "--explicit-package-bases", *paths]
            self.app.display_info(f"{ENV}: mypyc {' '.join(paths)}")
            subprocess.run(cmd, cwd=src, check=True)
            ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
            built = [p for p in src.rglob(f"*{ext}") if "build" not in p.relative_to(src).parts]
            expected = {str(Path(*m.split("."))) + ext for m in modules}
            found = {str(p.relative_to(src)) for p in built}
            missing = expected - found
            if missing:
                raise RuntimeError(f"{ENV}: mypyc did not build {sorted(missing)}")
            out = root / "build" / "mypyc-artifacts"  # removed again in `finalize`
            shutil.rmtree(out, ignore_errors=True)
            for p in built:
                rel = p.relative_to(src)
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest)
                build_data["force_include"][str(dest)] = str(rel)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self.target_name == "wheel" and version != "editable" and _wanted():
            shutil.rmtree(Path(self.root) / "build" / "mypyc-artifacts", ignore_errors=True)
