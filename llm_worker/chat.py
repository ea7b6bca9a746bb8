"""Prompt encoding: plain text or chat turns through the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specdraft.tokenizer import Tokenizer


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Plain text → token ids, with the tokenizer's own special tokens (if it adds any)."""
    return list(tokenizer(text)["input_ids"])


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Chat turns → token ids, ending with the assistant's header (generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; drop --chat")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
