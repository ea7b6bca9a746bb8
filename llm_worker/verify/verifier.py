"""Accept / reject rules. Pure functions of the target's output for one flattened draft tree.

Rows: row 0 is the root, row i + 1 is node i; row r's distribution predicts the children of
the node in row r (see ``llm_worker.verify.tree``).

Greedy: a child is accepted iff its token is the target's argmax at its parent's row; the
bonus token is the argmax after the last accepted node. Exactly the tokens of plain greedy
decoding.

Sampling: recursive rejection sampling over siblings (SpecInfer's multi-round rule). At a node
with target distribution p, children x_1, x_2, ... are tried in order. Child i, drafted from
q_i, is accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection
p ← normalise(max(p − q_i, 0)). A deterministic draft is the point mass q_i = δ(x_i): accept
with probability p(x_i), and on rejection zero x_i out of p and renormalise. If every child is
rejected the bonus token is sampled from what is left of p. The output is distributed exactly
as sampling from the target one token at a time.
"""

from __future__ import annotations

import torch

from llm_worker.sampling import sample
from llm_worker.types import DraftTree, Outcome, VerifyResult


def children_of(tree: DraftTree) -> dict[int, list[int]]:
    """Children of each node (-1 = root), in node order."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
        kids.setdefault(i, [])
    return kids


def verify_greedy(argmax: list[int], tree: DraftTree) -> VerifyResult:
    """argmax: [1 + num_nodes] the target's argmax token at each row."""
    kids = children_of(tree)
    outcomes = [Outcome.UNREACHED] * len(tree)
    accepted: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
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


def verify_sampling(probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None) -> VerifyResult:
    """probs: [1 + num_nodes, vocab] the target's (warped) distribution at each row."""
    kids = children_of(tree)
    outcomes = [Outcome.UNREACHED] * len(tree)
    accepted: list[int] = []
    node = -1
    while True:
        p = probs[node + 1].double()
        nxt = -1
        for child in kids[node]:
            x = tree.tokens[child]
            q = tree.draft_probs[child].double() if tree.draft_probs is not None else None
            ratio = p[x].item() if q is None else min(1.0, p[x].item() / max(q[x].item(), 1e-300))
            u = torch.rand((), generator=generator, dtype=torch.float64).item()
            if u < ratio:
                outcomes[child] = Outcome.ACCEPTED
                nxt = child
                break
            outcomes[child] = Outcome.REJECTED
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = residual.sum().item()
            # In exact arithmetic a rejection leaves positive mass; guard against rounding.
            if total > 0.0:
                p = residual / total
        if nxt < 0:
            return VerifyResult(tuple(accepted), sample(p.float(), generator), tuple(outcomes))
        accepted.append(nxt)
        node = nxt
