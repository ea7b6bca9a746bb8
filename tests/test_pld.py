"""n-gram matching for ``pld`` (pure functions, no model)."""

from __future__ import annotations

import numpy as np

from llm_worker.drafters.base import DraftContext
from llm_worker.drafters.pld import PromptLookupDrafter, common_suffix_length, find_ngram_match, match_bucket


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_docstring_example() -> None:
    assert find_ngram_match(arr(1, 2, 3, 4, 2, 3), 1, 3) == (3, 2)


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # [7, 8, 9] occurs at 0; [8, 9] alone also occurs at 5 (more recent) — the trigram wins.
    tokens = arr(7, 8, 9, 1, 2, 8, 9, 3, 7, 8, 9)
    assert find_ngram_match(tokens, 1, 3) == (3, 3)


def test_most_recent_occurrence_among_equal_lengths() -> None:
    tokens = arr(5, 6, 1, 5, 6, 2, 5, 6)
    assert find_ngram_match(tokens, 1, 2) == (5, 2)


def test_no_match_returns_none_and_drafts_nothing() -> None:
    assert find_ngram_match(arr(1, 2, 3, 4), 1, 3) is None
    drafter = PromptLookupDrafter()
    assert len(drafter.propose(DraftContext(arr(1, 2, 3, 4), budget=5))) == 0


def test_min_n_is_respected() -> None:
    tokens = arr(1, 2, 3, 9, 3)  # only a 1-gram match
    assert find_ngram_match(tokens, 2, 3) is None
    assert find_ngram_match(tokens, 1, 3) == (3, 1)


def test_draft_is_the_continuation_with_sources_and_budget() -> None:
    tokens = arr(1, 2, 3, 4, 5, 6, 1, 2)
    tree = PromptLookupDrafter().propose(DraftContext(tokens, budget=3))
    assert tree.tokens == (3, 4, 5)
    assert tree.sources == (2, 3, 4)
    assert tree.is_chain()


def test_continuation_may_run_into_the_suffix_itself() -> None:
    tokens = arr(4, 4, 4)  # pattern [4, 4] at 0 → continuation starts at 2
    tree = PromptLookupDrafter().propose(DraftContext(tokens, budget=8))
    assert tree.tokens == (4,)


def test_common_suffix_and_buckets() -> None:
    tokens = arr(9, 1, 2, 3, 8, 1, 2, 3)
    assert common_suffix_length(tokens, 3, 7) == 3
    assert match_bucket(1) == "m1" and match_bucket(4) == "m5" and match_bucket(100) == "m32"
