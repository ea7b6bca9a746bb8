"""What specdraft asks of a tokenizer: the ``Tokenizer`` protocol, shared by every layer.

The datastore tokenizes corpora and records the tokenizer's identity; the worker encodes prompts
(plain or through the chat template) and decodes outputs. They take a tokenizer by this protocol,
not by transformers' classes. A transformers tokenizer is one at run time, but its methods are
typed for more than these calls (``decode`` also decodes batches, ``apply_chat_template`` also
tokenizes), so it becomes a ``Tokenizer`` by a cast where it is loaded
(``llm_worker.assembly``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, overload


class Tokenizer(Protocol):
    """The calls specdraft makes on a tokenizer (a subset of transformers'
    ``PreTrainedTokenizerBase``).

    Attributes some tokenizers lack are read with ``getattr`` and a default, never through this
    protocol: ``chat_template`` (None or "": no template), ``all_special_tokens`` and
    ``name_or_path`` (both part of a datastore's tokenizer identity,
    ``datastore_svc.store.tokenizer_identity``).
    """

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    def __len__(self) -> int:
        """The vocabulary size, added tokens included: every id is below it."""
        ...

    def get_vocab(self) -> dict[str, int]:
        """Token → id, added tokens included."""
        ...

    @overload
    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    @overload
    def __call__(
        self, text: list[str], *, add_special_tokens: bool = ...
    ) -> Mapping[str, list[list[int]]]: ...

    def __call__(
        self, text: str | list[str], *, add_special_tokens: bool = ...
    ) -> Mapping[str, list[int]] | Mapping[str, list[list[int]]]:
        """``["input_ids"]``: the ids of ``text`` (of each text of a list), with the tokenizer's
        own special tokens unless ``add_special_tokens`` is False."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, str]],
        *,
        chat_template: str | None = ...,
        add_generation_prompt: bool = ...,
        tokenize: Literal[False],
    ) -> str:
        """The chat turns (``role``, ``content``) as the template's text (``chat_template``: a
        Jinja template instead of the tokenizer's own); with ``add_generation_prompt``, ending
        with the opening of the assistant's turn."""
        ...
