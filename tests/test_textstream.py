"""Streamed text never splits a character: the deltas, joined, are the final text."""

from __future__ import annotations

import pytest

from llm_worker.textstream import REPLACEMENT, TextStream


def byte_decode(ids: list[int] | tuple[int, ...]) -> str:
    """A byte-level tokenizer's decode: one token per UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["Smile 😀 ok", "你好世界", "a€b", "😀😀", "plain"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_join_to_the_text_and_never_hold_a_broken_character(text: str, step: int) -> None:
    ids = list(text.encode("utf-8"))
    stream = TextStream(byte_decode)
    deltas = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(stream.finish())
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_an_unfinished_character_is_flushed_by_finish() -> None:
    stream = TextStream(byte_decode)
    assert stream.push([*b"ok ", 0xF0, 0x9F]) == "ok "  # the first half of an emoji
    assert stream.finish() == REPLACEMENT  # the tokens never finished it: as the final text has it


def test_a_rewritten_tail_is_not_repeated() -> None:
    decoded = iter(["Hello ", "Hello", "Hello world"])  # a decoder that trims a trailing space
    stream = TextStream(lambda ids: next(decoded))
    assert [stream.push([1]), stream.push([2]), stream.push([3])] == ["Hello ", "", "world"]
