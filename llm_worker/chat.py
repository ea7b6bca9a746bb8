"""Prompt encoding: plain text or chat turns through the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jinja2 import TemplateError

from specdraft.tokenizer import Tokenizer


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Plain text → token ids, with the tokenizer's own special tokens (if it adds any)."""
    return list(tokenizer(text)["input_ids"])


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], template: str | None = None
) -> list[int]:
    """Chat turns → token ids, ending with the assistant's header (generation prompt).

    ``template``: a Jinja chat template used instead of the tokenizer's own (``--chat-template``),
    e.g. ``"{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}assistant:"``. A
    template that does not render is a ``ValueError`` naming the Jinja error.
    """
    if not template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; drop --chat or give --chat-template")
    try:
        text = tokenizer.apply_chat_template(
            list(messages), chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template does not render: {type(exc).__name__}: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
