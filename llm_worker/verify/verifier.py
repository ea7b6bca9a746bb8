"""Accept / reject rules. Pure functions of the target's output for one flattened draft tree.

Rows: row 0 is the root, row i + 1 is node i; row r's distribution predicts the children of
the node in row r (see ``llm_worker.verify.tree``).

Greedy: a child is accepted iff its token is the target's argmax at its parent's row; the
bonus token is the argmax after the last accepted node. Exactly the tokens of plain greedy
decoding.

Sampling: the target's token at each row is its sample at that row's sequence position,
coupled to the position (``llm_worker.sampling``: the winner of an exponential race between the
warped p and the position's noise); a child is accepted iff its token is that sample, and the
bonus is the sample after the last accepted node. So a seeded request emits exactly the tokens
plain sampling with the seed emits, and each is an exact sample from p. A draft token x is
accepted with probability p(x) — for siblings x_1, x_2, ... with p(x_1) + p(x_2) + ...: what
recursive rejection sampling of point-mass drafts accepts. A drafter that samples from its own q
with the same noise is accepted with the probability that both races have the same winner.

Example: root p = (0.5, 0.3, 0.2), noise (1.9, 0.2, 0.7): the sample is token 1; a chain
drafting [1, ...] has its first node accepted, a chain drafting [0] none (bonus 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from llm_worker.sampling import SamplingNoise
from llm_worker.types import DraftTree, Outcome, VerifyResult


def children_of(tree: DraftTree) -> dict[int, list[int]]:
    """Children of each node (-1 = root), in node order."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
        kids.setdefault(i, [])
    return kids


def verify_tokens(token_at: Callable[[int], int], tree: DraftTree) -> VerifyResult:
    """``token_at(row)``: the target's token at row (0 the root, i + 1 node i), asked for the rows
    of the accepted path only. Follows the child whose token it is, as long as there is one."""
    kids = children_of(tree)
    outcomes = [Outcome.UNREACHED] * len(tree)
    accepted: list[int] = []
    node = -1
    while True:
        want = token_at(node + 1)
        nxt = -1
        for child in kids[node]:
            if tree.tokens[child] == want:
                outcomes[child] = Outcome.ACCEPTED
                nxt = child
            else:
                outcomes[child] = Outcome.REJECTED
        if nxt < 0:
            return VerifyResult(tuple(accepted), want, tuple(outcomes))
        accepted.append(nxt)
        node = nxt


def verify_greedy(argmax: Sequence[int], tree: DraftTree) -> VerifyResult:
    """argmax: [1 + num_nodes] the target's argmax token at each row."""
    return verify_tokens(argmax.__getitem__, tree)


def verify_sampling(
    probs_at: Callable[[int], torch.Tensor], tree: DraftTree, noise: SamplingNoise, position: int
) -> VerifyResult:
    """``probs_at(row)``: [vocab] the target's warped distribution at a row; ``position``: the
    sequence position the root's row predicts (a node at depth d predicts ``position + d``)."""
    depth = [0, *tree.depths()]
    return verify_tokens(lambda row: noise.choose(probs_at(row), position + depth[row]), tree)
