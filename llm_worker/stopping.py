"""Stop strings: where a generation's text first contains one, as the tokens come.

The worker knows the tokenizer, the engine does not: the worker builds ``StopStrings`` (the
strings and a ``decode``), the engine asks its ``watch`` for a fresh ``StopWatch`` per request
and shows it every token it commits (``llm_worker.engine``). The watch decodes only a window of
the last tokens, enough to hold the longest stop string (a token that decodes to anything
decodes to at least one byte, so ``bytes + 1`` tokens cover a string of that many UTF-8 bytes,
whatever character the window starts inside), so a long generation is not decoded again at
every token. A token that decodes to nothing (a special token skipped in the text) shortens
what the window covers.

Semantics are OpenAI's (and vLLM's): the returned text ends before the stop string
(``cut_at_stop``); the token ids include the token that completed it. A stream never shows part
of a stop string it will cut (``visible_text``).

Example: stop "\\n\\n"; tokens decoding to "Hi", "!\\n", "\\nBye": the watch matches at the third
token; the text is "Hi!", the token ids are all three.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

MAX_STOP_STRINGS = 4
"""OpenAI's limit on stop strings per request."""
MAX_STOP_CHARS = 256
"""The longest stop string a request may give (its window is decoded at every token)."""
REPLACEMENT = "\ufffd"


def check_stop_strings(stops: Sequence[str]) -> None:
    """``ValueError`` with a precise message for stop strings a request may not give."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for s in stops:
        if not s:
            raise ValueError("a stop string is empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS}")


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, string) of the stop string occurring first in ``text`` (the longer one at a tie),
    or None. Example: first_stop("a.b!", (".", "!")) = (1, ".")."""
    found = [(i, -len(s), s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    i, _, s = min(found)
    return i, s


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to, not into, its first stop string (all of it if it holds none)."""
    hit = first_stop(text, stops)
    return text if hit is None else text[: hit[0]]


def visible_text(text: str, stops: Sequence[str], final: bool) -> str:
    """What a stream may show of ``text`` so far: cut at a stop string, and unless ``final``,
    without its longest tail that could still grow into one (at most the longest stop string
    less one character). Example: stops ("\\n\\n",), "Hi\\n" → "Hi" until the next text comes."""
    hit = first_stop(text, stops)
    if hit is not None:
        return text[: hit[0]]
    if final:
        return text
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


class StopWatch:
    """One request's watch over its committed tokens: call it with each; it returns the stop
    string the text now contains (the first, ``first_stop``), else None."""

    def __init__(self, strings: StopStrings) -> None:
        self.strings = strings
        self.recent: deque[int] = deque(maxlen=strings.window)  # the last tokens: [<= window]

    def __call__(self, token: int) -> str | None:
        self.recent.append(token)
        # a window starting inside a character decodes it to U+FFFD: not text of the output
        text = self.strings.decode(list(self.recent)).lstrip(REPLACEMENT)
        hit = first_stop(text, self.strings.stops)
        return None if hit is None else hit[1]


class StopStrings:
    """A request's stop strings and the tokenizer's ``decode`` (what the engine watches)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str]) -> None:
        check_stop_strings(stops)
        if not stops:
            raise ValueError("no stop strings")
        self.stops = tuple(stops)
        self.decode = decode
        self.window = max(len(s.encode()) for s in self.stops) + 1  # tokens decoded per check

    def watch(self) -> StopWatch:
        return StopWatch(self)
