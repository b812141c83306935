"""Text in and out: the tokenizer seam (`Codec`) and one choice's incremental text.

`TextStream` turns a choice's tokens into the text deltas a stream sends: it decodes
incrementally (a window of the last few tokens, never the whole output), holds back an
incomplete UTF-8 character (decoded as U+FFFD) and, when stop strings are set, the last
``len(longest stop) - 1`` characters, which could still become a stop string. A stop string
ends the choice; it and everything after it are not sent (OpenAI's rule). `CharCodec` is
the text of a model that has no tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, final

from prefixflight.core import UsageError

__all__ = ["CharCodec", "Codec", "HFCodec", "TextStream"]


class Codec(Protocol):
    """What the server needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's special tokens)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of output tokens, special tokens (EOS, end of turn) left out."""
        ...

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation rendered by the chat template, ready for the
        assistant's answer; `UsageError` if there is no template."""
        ...


@final
class HFCodec:
    """A Hugging Face tokenizer as a `Codec`; ``chat_template`` replaces the tokenizer's."""

    __slots__ = ("chat_template", "tokenizer")

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise UsageError("this model's tokenizer has no chat template; use /v1/completions")
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            chat_template=template,
        )
        return [int(t) for t in getattr(ids, "input_ids", ids)]


@final
class CharCodec:
    """Text for a model without a tokenizer (the random-weight ``--model tiny``): a
    character is one token, ``ord(c) % (vocab_size - 1) + 1`` (the rule of the Ray
    replicas' `CharTokenizer`, so text prompts hash alike on both paths); a token decodes to
    one printable ASCII character. Not a round trip: it is for trying the server, not for
    reading what a random model says."""

    __slots__ = ("vocab_size",)

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise UsageError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        v = self.vocab_size - 1
        return [ord(c) % v + 1 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + t % 95) for t in ids)

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


@final
class TextStream:
    """One choice's text: feed tokens with `add`, send what it returns, then `flush`.

    Decoding is incremental, as vLLM's ``detokenize_incrementally`` and TGI's
    ``decode_token`` do it: each token decodes the few tokens since the last text it
    produced (with the tokens of that text as context, so that tokenizers that drop or add
    a leading space on their own decode the same), never the whole output again, so a token
    costs the same at the 10,000th as at the first. ``min_tokens``: stop strings are looked
    for only once that many tokens came (vLLM's rule).
    """

    __slots__ = (
        "_codec",
        "_hold",
        "_ids",
        "_min_tokens",
        "_prefix",
        "_read",
        "_sent",
        "_stops",
        "_text",
        "stopped",
    )

    def __init__(self, codec: Codec, stops: Iterable[str] = (), *, min_tokens: int = 0) -> None:
        self._codec = codec
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] produced the text's end: the context to decode with
        self._read = 0  # ids[read:] have produced no text yet
        self._text = ""
        self._sent = 0
        self.stopped = False
        """True once a stop string appeared: the choice is over."""

    @property
    def text(self) -> str:
        """The choice's text so far (cut before a stop string)."""
        return self._text

    def add(self, token: int) -> str:
        """Take one output token; return the text that is now safe to send."""
        if self.stopped:
            return ""
        ids = self._ids
        ids.append(token)
        decode = self._codec.decode
        before = decode(ids[self._prefix : self._read])
        now = decode(ids[self._prefix :])
        # nothing new, or a character split across tokens: wait for the rest
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        text = self._text = self._text + now[len(before) :]
        if self._stops and len(ids) >= self._min_tokens:
            start = max(0, self._sent - self._hold)
            hits = [i for i in (text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                self._text = text[: min(hits)]
                self.stopped = True
                return self._take(len(self._text))
        return self._take(len(text) - self._hold)

    def flush(self) -> str:
        """The held-back rest, once the choice has ended."""
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta = self._text[self._sent : upto]
        self._sent = upto
        return delta
