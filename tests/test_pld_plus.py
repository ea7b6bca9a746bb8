"""PLD+ candidate ranking (pure functions, synthetic artifacts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.models import tiny_target
from llm_worker.drafters import DRAFTERS, UnknownModeError
from llm_worker.drafters.base import DraftContext
from llm_worker.drafters.pld_plus import (
    AttentionDrafter,
    HiddenStateDrafter,
    occurrences,
    rank_by_attention,
    rank_by_hidden,
    top_copies,
)


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_occurrences_of_the_root_token() -> None:
    assert occurrences(arr(5, 1, 5, 2, 5)).tolist() == [0, 2]
    assert occurrences(arr(5, 1, 5, 2, 5), first=1).tolist() == [2]
    assert occurrences(arr(1, 2, 3)).tolist() == []


def test_hidden_ranking_compares_the_state_before_each_occurrence_with_the_last_one() -> None:
    hidden = torch.zeros(5, 2)  # [T-1, hidden]: positions 0..4; the root (position 5) has none
    hidden[0] = torch.tensor([1.0, 0.0])  # before occurrence j = 1
    hidden[1] = torch.tensor([0.0, 1.0])  # before occurrence j = 2
    hidden[4] = torch.tensor([1.0, 0.05])  # H_{T-2}
    scores = rank_by_hidden(hidden, np.array([1, 2]))
    assert scores[0] > 0.99 and scores[1] < 0.1


def test_pld_h_drafts_after_the_most_similar_occurrence() -> None:
    # tokens: 9 7 1 2 | 8 7 3 4 | 6 7   (root = 7 at position 9; occurrences at 1 and 5)
    tokens = arr(9, 7, 1, 2, 8, 7, 3, 4, 6, 7)
    hidden = torch.zeros(9, 3)
    hidden[0] = torch.tensor([1.0, 0.0, 0.0])  # before occurrence 1
    hidden[4] = torch.tensor([0.0, 1.0, 0.0])  # before occurrence 5
    hidden[8] = torch.tensor([0.9, 0.1, 0.0])  # before the root: most like position 0
    drafter = HiddenStateDrafter(layer=3, theta=None)
    tree = drafter.propose(DraftContext(tokens, budget=2, hidden=lambda layer: hidden))
    assert tree.tokens == (1, 2) and tree.sources == (2, 3)
    assert tree.features[0].startswith("h9|")
    # Plain PLD would have copied the most recent occurrence instead (3, 4).


def test_pld_h_threshold_drops_weak_matches() -> None:
    tokens = arr(9, 7, 1, 2, 6, 7)
    hidden = torch.zeros(5, 2)
    hidden[0] = torch.tensor([1.0, 0.0])
    hidden[4] = torch.tensor([0.0, 1.0])
    drafter = HiddenStateDrafter(layer=1, theta=0.5)
    assert len(drafter.propose(DraftContext(tokens, budget=3, hidden=lambda layer: hidden))) == 0


def test_attention_ranking_is_the_max_over_heads() -> None:
    attention = torch.tensor([[0.1, 0.6, 0.1, 0.2], [0.0, 0.1, 0.8, 0.1]])  # [heads=2, T-1=4]
    scores = rank_by_attention(attention, np.array([1, 2]))
    assert torch.allclose(scores, torch.tensor([0.6, 0.8]))


def test_pld_a_drafts_after_the_most_attended_occurrence() -> None:
    tokens = arr(7, 1, 2, 7, 3, 4, 7)  # root 7; occurrences 0 and 3
    attention = torch.zeros(1, 6)
    attention[0, 0] = 0.9
    attention[0, 3] = 0.05
    drafter = AttentionDrafter(heads=((0, 0),), theta=None)
    tree = drafter.propose(DraftContext(tokens, budget=4, attention=lambda: attention))
    assert tree.tokens == (1, 2, 7, 3) and tree.sources == (1, 2, 3, 4)


def test_ties_go_to_the_most_recent_occurrence() -> None:
    tree = top_copies(arr(5, 1, 5, 2, 5), np.array([0, 2]), torch.tensor([0.5, 0.5]), 1, "a", None)
    assert tree.tokens == (2,)


def test_branches_merge_the_top_continuations_into_a_tree() -> None:
    tokens = arr(7, 1, 2, 7, 1, 3, 7, 4, 5, 7)  # root 7; occurrences 0, 3, 6
    scores = torch.tensor([0.9, 0.8, 0.1])
    tree = top_copies(tokens, np.array([0, 3, 6]), scores, 2, "a", None, branches=2)
    assert tree.tokens == (1, 2, 3) and tree.parents == (-1, 0, 0)  # [1, 2] and [1, 3] share the 1
    assert tree.sources == (1, 2, 5)
    assert tree.features[2].startswith("a8|")
    assert len(top_copies(tokens, np.array([0, 3, 6]), scores, 2, "a", 0.85, branches=3)) == 2


@pytest.mark.parametrize("theta", ["nan", "inf", "-inf", "1.5", "-2"])
def test_theta_must_be_a_finite_score(theta: str) -> None:
    """``theta`` is a similarity (or attention) score in [-1, 1]: NaN (which no score is below,
    so it filtered nothing), the infinities and numbers outside are refused, before ``pld+a``
    looks for its head file (none here)."""
    target = tiny_target("llama")
    DRAFTERS.create("pld+h:layer=1:theta=0.3", target)
    for mode in ("pld+h:layer=1", "pld+a"):
        with pytest.raises(UnknownModeError, match="theta"):
            DRAFTERS.create(f"{mode}:theta={theta}", target)
