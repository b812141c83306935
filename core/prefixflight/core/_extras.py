"""What prefixflight says when an optional dependency is missing: which extra brings it, and
the command that installs it. prefixflight is not on the package index: an extra installs
from the clone's root, as an editable install (``pip install -e '.[serve]'``). Here, in the
core, so that every package (the CLI, the specs) words it the same way."""

from __future__ import annotations

from ._errors import UsageError

__all__ = ["TORCH_WHEEL", "install_command", "missing_extra"]

TORCH_WHEEL = "torch==2.13.0"
"""The CPU wheel to install before the ``torch`` extra: an unpinned torch resolves to a
multi-GB CUDA build."""


def install_command(extra: str) -> str:
    """The shell command that installs ``extra`` into the active environment, run from the
    root of a prefixflight clone."""
    editable = f"pip install -e '.[{extra}]'"
    return f"pip install {TORCH_WHEEL} && {editable}" if extra == "torch" else editable


def missing_extra(needer: str, extra: str, exc: ImportError) -> UsageError:
    """The error for ``needer`` (a command or a flag) when the import ``exc`` failed: it
    names the missing module, the extra and `install_command`."""
    return UsageError(
        f"{needer} needs the {extra} extra ({exc}); install it from the root of the "
        f"prefixflight clone with `{install_command(extra)}`"
    )
