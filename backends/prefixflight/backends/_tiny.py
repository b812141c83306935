"""The tiny random-weight model every torch test, ``prefixflight serve --model tiny`` and the
Ray replicas' default model share: plain data, importable without torch."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

__all__ = ["TINY_LLAMA"]

TINY_LLAMA: Final[Mapping[str, Any]] = MappingProxyType(
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
)
"""A 2-layer Llama shape (vocab 512, 4 query heads, 2 KV heads of 16): keyword arguments of
``transformers.LlamaConfig`` (and of ``Qwen2Config``, for the Qwen2 variant)."""
