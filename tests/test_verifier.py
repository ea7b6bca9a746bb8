"""Accept / reject rules against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from llm_worker.types import DraftTree, Outcome
from llm_worker.verify.tree import tree_buffers
from llm_worker.verify.verifier import verify_greedy, verify_sampling


def test_tree_buffers_mask_and_positions() -> None:
    b = tree_buffers((-1, 0, 0, 1))  # root→a, a→b, a→c, b→d
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(b.mask, expected)
    assert b.position_offsets.tolist() == [0, 1, 2, 2, 3]
    assert not b.is_chain
    assert tree_buffers((-1, 0, 1)).is_chain


def test_greedy_accepts_the_matching_prefix_and_adds_the_bonus() -> None:
    tree = DraftTree.chain([5, 6, 7])
    res = verify_greedy([5, 6, 9, 1], tree)  # rows: root, 5, 6, 7
    assert res.accepted == (0, 1)
    assert res.bonus == 9
    assert res.outcomes == (Outcome.ACCEPTED, Outcome.ACCEPTED, Outcome.REJECTED)


def test_greedy_all_accepted_takes_the_last_rows_argmax() -> None:
    res = verify_greedy([5, 6, 7, 8], DraftTree.chain([5, 6, 7]))
    assert res.accepted == (0, 1, 2) and res.bonus == 8


def test_greedy_nothing_accepted() -> None:
    res = verify_greedy([4, 0, 0], DraftTree.chain([5, 6]))
    assert res.accepted == () and res.bonus == 4
    assert res.outcomes == (Outcome.REJECTED, Outcome.UNREACHED)


def test_greedy_tree_follows_the_matching_branch() -> None:
    tree = DraftTree.from_sequences([[5, 6, 7], [5, 8], [9]])  # tokens 5 6 7 8 9
    assert tree.tokens == (5, 6, 7, 8, 9) and tree.parents == (-1, 0, 1, 0, -1)
    # root predicts 5, node 5 predicts 8, node 8 predicts 3
    argmax = [5, 8, 0, 0, 3, 0]
    res = verify_greedy(argmax, tree)
    assert res.accepted == (0, 3) and res.bonus == 3
    assert res.outcomes[4] == Outcome.REJECTED and res.outcomes[1] == Outcome.REJECTED


def test_from_sequences_merges_prefixes_and_keeps_first_source() -> None:
    tree = DraftTree.from_sequences([[1, 2], [1, 3]], sources=[[10, 11], [20, 21]])
    assert tree.tokens == (1, 2, 3) and tree.parents == (-1, 0, 0)
    assert tree.sources == (10, 11, 21)
    assert tree.subtree([0, 2]).tokens == (1, 3)
    with pytest.raises(ValueError):
        tree.subtree([1])


def _first_token_distribution(p: torch.Tensor, make_tree, trials: int, seed: int) -> np.ndarray:
    """Empirical distribution of the first emitted token (first accepted draft, else the bonus)."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(p.shape[-1])
    for _ in range(trials):
        tree = make_tree(gen)
        probs = p.expand(len(tree) + 1, -1)
        res = verify_sampling(probs, tree, gen)
        first = tree.tokens[res.accepted[0]] if res.accepted else res.bonus
        counts[first] += 1
    return counts


P = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])


@pytest.mark.parametrize(
    "make_tree",
    [
        lambda g: DraftTree.chain([1, 2]),  # a likely draft
        lambda g: DraftTree.chain([4]),  # an unlikely draft
        lambda g: DraftTree.from_sequences([[0], [3], [1]]),  # three siblings, point masses
    ],
    ids=["likely", "unlikely", "siblings"],
)
def test_point_mass_rejection_sampling_preserves_the_target(make_tree) -> None:
    n = 20000
    counts = _first_token_distribution(P, make_tree, n, seed=0)
    assert stats.chisquare(counts, P.numpy() * n).pvalue > 1e-3


def test_rejection_sampling_with_draft_probabilities_preserves_the_target() -> None:
    q = torch.tensor([0.3, 0.1, 0.1, 0.4, 0.1])

    def sampled_draft(gen: torch.Generator) -> DraftTree:
        # The draft token is itself drawn from q: min(1, p/q) is exact only over that randomness.
        a = int(torch.multinomial(q, 1, generator=gen))
        return DraftTree((a,), (-1,), draft_probs=q[None].clone())

    n = 20000
    counts = _first_token_distribution(P, sampled_draft, n, seed=1)
    assert stats.chisquare(counts, P.numpy() * n).pvalue > 1e-3


def test_a_certain_draft_is_always_accepted() -> None:
    p = torch.tensor([0.0, 1.0, 0.0])
    res = verify_sampling(p.expand(2, -1), DraftTree.chain([1]), torch.Generator().manual_seed(0))
    assert res.accepted == (0,)
