"""The server's wire: request and response models (pydantic, strict), and the checks a
schema cannot express.

The models are the one description of the wire: FastAPI validates requests with them and
builds the OpenAPI schema from them, and the server builds its responses from them, so the
schema says what the server does. Fields follow OpenAI's API reference for
``/v1/completions`` and ``/v1/chat/completions`` plus the vLLM extensions the server
implements (``cache_salt``, ``ignore_eos``, ``top_k``, ``min_tokens``, ``stop_token_ids``).

Strict: a number is not a string (``"2"``), a bool is not a number (``true`` as a token id),
``NaN`` and infinities are no numbers, and text must be valid Unicode (a lone surrogate such
as ``"\\ud800"`` would fail in the tokenizer): each is a 400 naming the field. Unknown fields
are ignored, as OpenAI-compatible servers do, except the parameters of OpenAI's and vLLM's
APIs the server does not implement (`UNSUPPORTED`): those are a 400 naming them when they
ask for something (``logprobs: 2``, ``repetition_penalty: 1.2``) and accepted at their
neutral value (``logprobs: null``, ``repetition_penalty: 1``), so that clients that always
send them work.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

__all__ = [
    "UNSUPPORTED",
    "ChatChoice",
    "ChatMessage",
    "ChatRequest",
    "ChatResponse",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorBody",
    "ErrorResponse",
    "FinishReasonName",
    "Health",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "Usage",
    "unsupported_field",
]

MAX_SEED = 2**63 - 1
MAX_N = 128

_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(value: str) -> str:
    hit = _SURROGATE.search(value)
    if hit is not None:
        raise PydanticCustomError(
            "invalid_unicode",
            "not valid Unicode text: a lone surrogate U+{code} at index {index}",
            {"code": f"{ord(hit.group()):04X}", "index": hit.start()},
        )
    return value


Text = Annotated[str, AfterValidator(_valid_text)]
"""A str that is valid Unicode (encodes to UTF-8): no lone surrogates."""
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = False


class _Sampling(_Request):
    """Parameters shared by both endpoints (``None`` means the default, as in OpenAI)."""

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="vLLM's: 0 or -1 is no limit")
    min_tokens: int | None = Field(
        default=None,
        ge=0,
        description="vLLM's: no stop token, end of sequence or stop string before this many",
    )
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, description="vLLM's")
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(default=None, min_length=1, description="vLLM's")
    ignore_eos: bool | None = Field(default=False, description="vLLM's")


def _prompt_shape(value: Any) -> str:
    """Which of the prompt's four shapes ``value`` has (so that an error is that shape's)."""
    if isinstance(value, str):
        return "str"
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(first, str):
        return "list[str]"
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[int]"


class CompletionRequest(_Sampling):
    prompt: Annotated[
        Annotated[Text, Tag("str")]
        | Annotated[list[TokenId], Tag("list[int]")]
        | Annotated[list[Text], Tag("list[str]")]
        | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
        Discriminator(_prompt_shape),
    ] = Field(description="text, token ids, or a list of either (a batch: one set of choices each)")


class TextPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


# -- responses ----------------------------------------------------------------------------------
class PromptTokensDetails(_Closed):
    cached_tokens: int


class Usage(_Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReasonName = Literal["stop", "length"]


class CompletionChoice(_Closed):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReasonName


class CompletionResponse(_Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Closed):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Closed):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReasonName


class ChatResponse(_Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(_Closed):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReasonName | None


class CompletionChunk(_Closed):
    """One ``data:`` event of a streamed completion (``usage`` only with
    ``stream_options.include_usage``: null on every chunk but the last, which has no
    choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Delta(_Closed):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Closed):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: FinishReasonName | None


class ChatChunk(_Closed):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Closed):
    count: int
    tokens: list[int]


class DetokenizeResponse(_Closed):
    prompt: str


class Health(_Closed):
    status: Literal["ok"]


class ErrorBody(_Closed):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Closed):
    """OpenAI's error shape; ``code`` is the HTTP status."""

    error: ErrorBody


# -- what the schema cannot say -----------------------------------------------------------------
def _neutral(name: str, value: Any, body: _Sampling) -> bool:
    """Whether ``value`` for the unimplemented parameter ``name`` asks for nothing."""
    match name:
        case "best_of":
            return value is None or value == (body.n or 1)
        case "tool_choice":
            return value in (None, "none", "auto")
        case "response_format":
            return value is None or (isinstance(value, Mapping) and value.get("type") == "text")
        case "repetition_penalty" | "length_penalty":
            return value in (None, 1)
        case "skip_special_tokens" | "spaces_between_special_tokens" | "add_generation_prompt":
            return value in (None, True)
        case _:
            return value in (None, False, 0, "", [], {})


UNSUPPORTED = (
    # OpenAI's
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
    # vLLM's sampling and output extensions
    "add_generation_prompt",
    "allowed_token_ids",
    "bad_words",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "guided_choice",
    "guided_grammar",
    "guided_json",
    "guided_regex",
    "include_stop_str_in_output",
    "length_penalty",
    "logits_processors",
    "min_p",
    "prompt_logprobs",
    "repetition_penalty",
    "return_tokens_as_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "structured_outputs",
    "truncate_prompt_tokens",
    "use_beam_search",
)
"""Parameters of OpenAI's and vLLM's APIs this server does not implement: a request that asks
for one gets a 400 naming it; the neutral value is accepted."""


def unsupported_field(body: _Sampling) -> str | None:
    """The first known-but-unimplemented field that asks for something, if any."""
    extra = body.model_extra or {}
    for name in UNSUPPORTED:
        if name in extra and not _neutral(name, extra[name], body):
            return name
    return None
