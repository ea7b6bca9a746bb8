"""Accept / reject rules against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from llm_worker.sampling import SamplingNoise, mix_seed
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


def _first_token_distribution(p: torch.Tensor, make_tree, trials: int, seed: int) -> tuple[np.ndarray, int]:
    """Empirical distribution of the first emitted token (first accepted draft, else the bonus)
    over ``trials`` requests seeded seed, seed + 1, ...; and how many drafts were accepted."""
    counts = np.zeros(p.shape[-1])
    accepted = 0
    for trial in range(trials):
        noise = SamplingNoise(seed + trial, p.shape[-1])
        tree = make_tree(noise)
        res = verify_sampling(lambda row: p, tree, noise, 0)
        first = tree.tokens[res.accepted[0]] if res.accepted else res.bonus
        assert first == noise.choose(p, 0), "the emitted token must not depend on the draft"
        accepted += bool(res.accepted)
        counts[first] += 1
    return counts, accepted


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
def test_sampling_verification_preserves_the_target(make_tree) -> None:
    n = 20000
    counts, accepted = _first_token_distribution(P, make_tree, n, seed=0)
    assert stats.chisquare(counts, P.numpy() * n).pvalue > 1e-3
    # A point-mass draft is accepted with probability p(x), siblings with the sum of theirs.
    drafted = make_tree(SamplingNoise(0, len(P)))
    expected = sum(float(P[drafted.tokens[c]]) for c, parent in enumerate(drafted.parents) if parent < 0)
    assert abs(accepted / n - expected) < 0.015


def test_a_draft_sampled_with_the_same_noise_is_exact_and_coupled() -> None:
    q = torch.tensor([0.3, 0.1, 0.1, 0.4, 0.1])

    def sampled_draft(noise: SamplingNoise) -> DraftTree:
        return DraftTree.chain([noise.choose(q, 0)])  # the drafter's own race at the same position

    n = 20000
    counts, accepted = _first_token_distribution(P, sampled_draft, n, seed=1)
    assert stats.chisquare(counts, P.numpy() * n).pvalue > 1e-3
    # Independent draws would agree with probability sum p*q = 0.17; the race coupling agrees at
    # least (1 - TV) / (1 + TV) = 0.38 of the time (TV = 0.45 here).
    assert accepted / n > 0.37


def test_a_certain_draft_is_always_accepted() -> None:
    p = torch.tensor([0.0, 1.0, 0.0])
    res = verify_sampling(lambda row: p, DraftTree.chain([1]), SamplingNoise(0, 3), 7)
    assert res.accepted == (0,)


def test_noise_is_a_function_of_seed_and_position() -> None:
    a, b = SamplingNoise(5, 64), SamplingNoise(5, 64)
    assert torch.equal(a.exponentials(3), b.exponentials(3))
    assert not torch.equal(a.exponentials(3), a.exponentials(4))
    assert not torch.equal(a.exponentials(3), SamplingNoise(6, 64).exponentials(3))
    assert len({mix_seed(s, i) for s in range(50) for i in range(50)}) == 2500
    assert bool((a.exponentials(0) > 0).all())


def test_a_deeper_node_meets_the_sample_of_its_own_position() -> None:
    """Depth d is decided by position + d: a chain of the samples at 10, 11, 12 is accepted whole."""
    noise = SamplingNoise(3, len(P))
    samples = [noise.choose(P, pos) for pos in (10, 11, 12, 13)]
    res = verify_sampling(lambda row: P, DraftTree.chain(samples[:3]), noise, 10)
    assert res.accepted == (0, 1, 2) and res.bonus == samples[3]
