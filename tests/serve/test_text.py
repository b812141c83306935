"""`TextStream`: the text deltas one choice sends, with stop strings and split characters.

The expected text is computed the plain way: append each token's text to a string and
stop at the first token after which a stop string appears, cutting the text before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from prefixflight.serve._text import TextStream


class TableCodec:
    """Token ``i`` is the text ``pieces[i]``."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def chat(self, messages: object) -> list[int]:
        raise NotImplementedError


class ByteCodec:
    """Token ``i`` is the byte ``i``: a character may span several tokens."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def chat(self, messages: object) -> list[int]:
        raise NotImplementedError


def run(stream: TextStream, ids: Sequence[int]) -> list[str]:
    out = []
    for i in ids:
        out.append(stream.add(i))
        if stream.stopped:
            break
    out.append(stream.flush())
    return out


def expected(pieces: Sequence[str], stops: Sequence[str]) -> tuple[str, bool]:
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s and s in text]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_a_stop_string_across_tokens_ends_the_text_before_it() -> None:
    codec = TableCodec(["he", "ll", "o wor", "ld", "!"])
    stream = TextStream(codec, ["lo w"])
    deltas = run(stream, [0, 1, 2, 3, 4])
    assert "".join(deltas) == "hel" and stream.stopped and stream.text == "hel"
    # the last len("lo w") - 1 = 3 characters wait until they cannot start a stop string
    assert deltas == ["", "h", "el", ""]


def test_without_stop_strings_everything_is_sent_at_once() -> None:
    codec = TableCodec(["a", "bc", "d"])
    stream = TextStream(codec)
    assert run(stream, [0, 1, 2]) == ["a", "bc", "d", ""]
    assert not stream.stopped


def test_a_character_split_across_tokens_is_held_back() -> None:
    stream = TextStream(ByteCodec())
    ids = list("aé€".encode())
    deltas = [stream.add(i) for i in ids]
    assert deltas == ["a", "", "é", "", "", "€"]
    assert "\ufffd" not in "".join(deltas)


def test_the_earliest_stop_string_wins_and_a_stop_at_the_start_sends_nothing() -> None:
    codec = TableCodec(["xyz", "abc"])
    assert "".join(run(TextStream(codec, ["c", "ab"]), [1])) == ""
    assert "".join(run(TextStream(codec, ["zab", "b"]), [0, 1])) == "xy"
    stream = TextStream(codec, ["x"])
    assert run(stream, [0, 1]) == ["", ""] and stream.stopped


@given(
    pieces=st.lists(st.text(alphabet="ab ", max_size=3), max_size=12),
    stops=st.lists(st.text(alphabet="ab ", min_size=1, max_size=4), max_size=3),
)
def test_deltas_add_up_to_the_text_cut_at_the_first_stop(
    pieces: list[str], stops: list[str]
) -> None:
    codec = TableCodec(pieces)
    stream = TextStream(codec, stops)
    deltas = run(stream, range(len(pieces)))
    text, stopped = expected(pieces, stops)
    assert "".join(deltas) == text and stream.stopped == stopped
    # every prefix sent so far was final: no stop string ever appears in what was sent
    sent = ""
    for d in deltas:
        sent += d
        assert not any(s in sent for s in stops)
