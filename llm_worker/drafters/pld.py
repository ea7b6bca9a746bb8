"""``pld``: prompt lookup decoding.

Find the longest n-gram (n = max_n .. min_n) that ends the context and occurred earlier in it
(prompt + generated), take its most recent earlier occurrence, and draft what followed it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DraftResources,
    UnknownModeError,
    int_option,
)
from llm_worker.model.target import TargetModel
from llm_worker.types import DraftTree

MATCH_LIMIT = 32  # how far back a match is measured for the acceptance feature


def find_ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int] | None:
    """Where the continuation of the best earlier n-gram match starts, and n.

    tokens: [T]. The last n tokens are the pattern; an occurrence must start before T - n.
    Longest n first, then the most recent occurrence.
    Example: tokens [1, 2, 3, 4, 2, 3], max_n 3: the 3-gram [4, 2, 3] never occurred before,
    the 2-gram [2, 3] did, at 1, so the continuation starts at 3 (token 4): returns (3, 2),
    and a 2-token draft is [4, 2].
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        windows = sliding_window_view(tokens[: length - 1], n)  # [T - n, n]: windows[i] = tokens[i:i+n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            return int(hits[-1]) + n, n
    return None


def common_suffix_length(tokens: np.ndarray, end_a: int, end_b: int, limit: int = MATCH_LIMIT) -> int:
    """How many tokens agree going backwards from positions end_a and end_b (inclusive)."""
    count = 0
    while count < limit and end_a - count >= 0 and tokens[end_a - count] == tokens[end_b - count]:
        count += 1
    return count


def match_bucket(length: int) -> str:
    """Acceptance feature of a copy: how long the context agrees with the copy source."""
    for bound in (1, 2, 3, 5, 8, 16):
        if length <= bound:
            return f"m{bound}"
    return f"m{MATCH_LIMIT}"


def copy_draft(tokens: np.ndarray, start: int, budget: int, feature: str) -> DraftTree:
    """Draft ``tokens[start : start + budget]``, each node citing its source position."""
    stop = min(start + budget, len(tokens))
    if stop <= start:
        return DraftTree.empty()
    return DraftTree.chain(
        tokens[start:stop].tolist(), sources=range(start, stop), features=[feature] * (stop - start)
    )


class PromptLookupDrafter(Drafter):
    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if min_n > max_n:
            raise UnknownModeError(f"pld: min_n {min_n} > max_n {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, ctx: DraftContext) -> DraftTree:
        found = find_ngram_match(ctx.tokens, self.min_n, self.max_n)
        if found is None or ctx.budget <= 0:
            return DraftTree.empty()
        start, _ = found
        agree = common_suffix_length(ctx.tokens, start - 1, len(ctx.tokens) - 1)
        return copy_draft(ctx.tokens, start, ctx.budget, match_bucket(agree))


@DRAFTERS.register(
    "pld", "prompt lookup: copy what followed the last n-gram's latest occurrence", ("min_n", "max_n")
)
def _make_pld(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return PromptLookupDrafter(
        min_n=int_option(options, "min_n", 1, 1, 16), max_n=int_option(options, "max_n", 3, 1, 16)
    )
