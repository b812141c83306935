"""A Hugging Face model folder the torch backend can serve, checked without torch: plain
files only, so ``prefixflight serve --model PATH`` rejects a wrong path before it loads
anything."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

from prefixflight.core import UsageError

__all__ = ["ARCHITECTURES", "check_model_folder"]

ARCHITECTURES: Final = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""The ``model_type`` of each supported family and its causal-LM architecture."""


def check_model_folder(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The folder and its ``model_type``, or `UsageError` naming ``path`` and what is wrong:
    it does not exist, is not a folder, has no readable ``config.json``, no ``*.safetensors``
    weights, or its architecture is not Llama or Qwen2 (the message names it)."""
    shown = repr(str(path))
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UsageError(f"{shown}: no such model folder")
    if not folder.is_dir():
        raise UsageError(f"{shown} is not a folder (a Hugging Face model folder is)")
    config = folder / "config.json"
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{shown} has no config.json: not a Hugging Face model folder") from None
    except OSError as exc:
        raise UsageError(f"{shown}: cannot read config.json: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{shown}: config.json is not valid JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{shown}: config.json is not a JSON object")
    kind = loaded.get("model_type")
    archs = loaded.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    want = ARCHITECTURES.get(kind) if isinstance(kind, str) else None
    if want is None or any(a != want for a in archs):
        named = next((a for a in archs if a != want), None) or kind
        raise UsageError(
            f"{shown} is a {named!s} model (model_type {kind!r}); prefixflight serves the "
            f"Llama and Qwen2 architectures ({', '.join(ARCHITECTURES.values())})"
        )
    if not any(folder.glob("*.safetensors")):
        raise UsageError(f"{shown} has no *.safetensors weights")
    return folder, str(kind)
