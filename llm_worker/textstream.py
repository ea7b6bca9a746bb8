"""Streaming text of a growing token sequence without splitting a character.

A byte-level tokenizer spreads one character over several tokens ("😀" is four byte tokens in
SmolLM2's vocabulary); decoding the tokens so far then ends in U+FFFD until the character is
whole. ``TextStream`` holds such a tail back until the next tokens complete it, so the deltas,
joined, are exactly the final text — what the final message of a stream carries.

With stop strings it also holds back a tail that could still grow into one, and cuts the text
at one (``llm_worker.stopping.visible_text``): a stream never shows text the result cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llm_worker.stopping import REPLACEMENT, visible_text


class TextStream:
    """Text deltas for tokens as they come: ``push`` each step's tokens, ``finish`` at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.printed = ""

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text that is certain: decoded up to, not into, an unfinished character."""
        self.token_ids.extend(token_ids)
        text = self.decode(self.token_ids).rstrip(REPLACEMENT)
        return self._delta(visible_text(text, self.stop, final=False))

    def finish(self) -> str:
        """Whatever was held back (a character the tokens never completed stays U+FFFD), up to
        a stop string."""
        return self._delta(visible_text(self.decode(self.token_ids), self.stop, final=True))

    def _delta(self, text: str) -> str:
        # Decoding more tokens may rewrite the end of earlier text (a tokenizer's clean-up of
        # spaces): only what extends the printed text is new.
        if not text.startswith(self.printed):
            return ""
        delta, self.printed = text[len(self.printed) :], text
        return delta
