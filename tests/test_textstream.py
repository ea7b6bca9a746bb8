"""Streamed text never splits a character: the deltas, joined, are the final text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_worker.textstream import REPLACEMENT, TextStream


def byte_decode(ids: list[int] | tuple[int, ...]) -> str:
    """A byte-level tokenizer's decode: one token per UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["Smile 😀 ok", "你好世界", "🇫🇷", "a€b", "😀😀", "plain"])
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


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from llm_worker.model.loading import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def _joined(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    def decode(some: list[int] | tuple[int, ...]) -> str:
        return str(tokenizer.decode(list(some), skip_special_tokens=True))

    stream = TextStream(decode)
    deltas = [stream.push([t]) for t in ids]
    deltas.append(stream.finish())
    return deltas, decode(ids)


@pytest.mark.parametrize("text", ["😀", "你好世界", "🇫🇷", "Smile 😀 ok", "naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"])
def test_the_real_tokenizer_one_token_at_a_time(tokenizer, text: str) -> None:
    deltas, final = _joined(tokenizer, tokenizer.encode(text))
    assert "".join(deltas) == final == text
    assert not any(REPLACEMENT in d for d in deltas)


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_any_text_streams_to_its_final_text(tokenizer, text: str) -> None:
    deltas, final = _joined(tokenizer, tokenizer.encode(text))
    assert "".join(deltas) == final
