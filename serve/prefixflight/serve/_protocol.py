"""The OpenAI request bodies the server accepts (pydantic), and the checks pydantic cannot do.

Fields follow OpenAI's API reference for ``/v1/completions`` and ``/v1/chat/completions``
plus vLLM's extensions ``cache_salt`` and ``ignore_eos``. Unknown fields are ignored, as
OpenAI-compatible servers do; known fields we do not implement are rejected with a 400 when
they ask for something (``logprobs: true``), and accepted at their neutral value
(``logprobs: null``, ``presence_penalty: 0``), so that clients that always send them work.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeRequest",
    "TextPart",
    "unsupported_field",
]

MAX_SEED = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class _Sampling(BaseModel):
    """Parameters shared by both endpoints (``None`` means the default, as in OpenAI)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    ignore_eos: bool | None = False


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def _neutral(name: str, value: Any, n: int) -> bool:
    match name:
        case "best_of":
            return value is None or value == n
        case "tool_choice":
            return value in (None, "none", "auto")
        case "response_format":
            return value is None or (isinstance(value, dict) and value.get("type") == "text")
        case "presence_penalty" | "frequency_penalty":
            return value in (None, 0, 0.0)
        case _:
            return value in (None, False, 0, "", [], {})


UNSUPPORTED = (
    "best_of",
    "echo",
    "frequency_penalty",
    "functions",
    "logit_bias",
    "logprobs",
    "presence_penalty",
    "response_format",
    "suffix",
    "tool_choice",
    "tools",
    "top_logprobs",
)


def unsupported_field(body: _Sampling) -> str | None:
    """The first known-but-unimplemented field that asks for something, if any."""
    extra = body.model_extra or {}
    n = body.n or 1
    for name in UNSUPPORTED:
        if name in extra and not _neutral(name, extra[name], n):
            return name
    return None
