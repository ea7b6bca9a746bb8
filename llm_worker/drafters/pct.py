"""PCT, the Pruned Candidate Tree (EDD, ACL 2025): which draft candidates are worth verifying.

Terms. A candidate tree holds draft tokens; node i's *confidence* is the draft's probability of
its token given its path, and its *expected acceptance* a_i the product of the confidences along
its path from the root (the chance that every token of the path is accepted, if the draft is
calibrated). Verifying n nodes costs t(n) seconds (``verify_seconds``: a forward with n draft
tokens; t(0) the root alone) and each accepted node saves one step of the root alone, t(0). The
expected gain of keeping a node set S is

    gain(S) = t(0) * sum_{i in S} a_i - (t(|S|) - t(0))

over sets closed under parents (a node is verified only with its path). Because a child's a is
at most its parent's, the best closed set of each size n is the n nodes of highest a (ties: the
earlier node first, so a parent precedes its child), and ``prune`` takes the best size.

Example: a = [0.9, 0.5, 0.2] (a chain), t(n) = 1 + 0.3 n → gains 0.6, 0.8, 0.7: keep 2 nodes.

``expand_order`` is the best-first order of expansion: the drafter expands the frontier nodes of
highest a whose children could still pay (``pays``). Pure python; the drafter is the shell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

VerifySeconds = Callable[[int], float]


def acceptance(parents: Sequence[int], confidence: Sequence[float]) -> list[float]:
    """[n] expected acceptance of each node: the product of confidences along its path
    (``parents`` in topological order, -1 = the root). ``acceptance([-1, 0], [0.5, 0.5])`` →
    [0.5, 0.25]."""
    out: list[float] = []
    for parent, q in zip(parents, confidence, strict=True):
        out.append(q * (out[parent] if parent >= 0 else 1.0))
    return out


def gain(accept: Sequence[float], kept: Sequence[int], verify_seconds: VerifySeconds | None) -> float:
    """The expected seconds saved by verifying the nodes ``kept`` (without a cost curve: the
    expected accepted tokens)."""
    total = sum(accept[i] for i in kept)
    if verify_seconds is None:
        return total
    step = verify_seconds(0)
    return total * step - (verify_seconds(len(kept)) - step)


def prune(
    parents: Sequence[int],
    accept: Sequence[float],
    verify_seconds: VerifySeconds | None,
    budget: int,
) -> list[int]:
    """The nodes worth verifying, ascending (so still topological): the size-n prefix of the
    nodes ordered by expected acceptance that maximises ``gain`` over n in [0, budget] (the
    first maximum: the smallest tree among equals). Without a cost curve every node up to the
    budget. ``accept`` must not rise along a path (a product of probabilities does not)."""
    order = sorted(range(len(accept)), key=lambda i: (-accept[i], i))[: max(budget, 0)]
    kept: set[int] = set()
    ranked: list[int] = []
    for i in order:  # parents first; a node whose parent fell outside is dropped with it
        if parents[i] < 0 or parents[i] in kept:
            kept.add(i)
            ranked.append(i)
    if verify_seconds is None:
        return sorted(ranked)
    step = verify_seconds(0)
    best_n, best, total = 0, 0.0, 0.0
    for n, i in enumerate(ranked, start=1):
        total += accept[i]
        value = total * step - (verify_seconds(n) - step)
        if value > best + 1e-15:
            best_n, best = n, value
    return sorted(ranked[:best_n])


def pays(accept: float, size: int, verify_seconds: VerifySeconds | None, draft_seconds: float = 0.0) -> bool:
    """Whether a node of expected acceptance ``accept`` may still pay as the (size+1)-th node:
    what it saves, ``accept`` steps of the root alone, against what it adds to the verify forward
    and ``draft_seconds`` of drafting. Without a cost curve: always."""
    if verify_seconds is None:
        return True
    step = verify_seconds(0)
    return accept * step > verify_seconds(size + 1) - verify_seconds(size) + draft_seconds


def expand_order(
    frontier: Sequence[int],
    accept: Sequence[float],
    width: int,
    min_reach: float,
    verify_seconds: VerifySeconds | None,
    draft_seconds: float = 0.0,
) -> list[int]:
    """Of the ``frontier`` nodes (expanded next, together, in one draft forward), the ``width``
    of highest expected acceptance that reach ``min_reach`` and whose best child could still
    pay: a child's acceptance is at most its parent's, so it ranks after every node of ``accept``
    at least as likely as its parent. Ascending. Example: frontier [1, 2], a = [0.9, 0.6, 0.01],
    width 4, min_reach 0.05 → [1]."""
    ranked = sorted(frontier, key=lambda i: (-accept[i], i))
    chosen = [
        i
        for i in ranked
        if accept[i] >= min_reach
        and pays(accept[i], sum(a >= accept[i] for a in accept), verify_seconds, draft_seconds)
    ]
    return sorted(chosen[:width])
