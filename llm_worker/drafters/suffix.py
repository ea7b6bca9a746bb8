"""``suffix``: drafting from what the service already said (SuffixDecoding, Oliaro et al.).

Two suffix structures (``llm_worker.drafters.suffix_tree``) count the continuations of every
short token string: a *global* one per tenant over finished requests (their outputs, each with the
end of the prompt it answered; worker-wide, ``DraftResources.suffixes``, bounded in tokens with
the oldest evicted first), and the request's *own* one over its prompt and the tokens generated so
far (updated as tokens commit, never rebuilt). Each step, in each structure, the longest suffix of
the context (up to ``match`` tokens) that occurred followed by something is found; below it a draft
tree grows greedily by empirical probability (count(child) / Σ count(children), multiplied along
the path) to at most ``factor`` × the match length nodes (and the step's budget), none less likely
than ``min_p``. The candidate with the larger expected accepted length (Σ of its nodes'
probabilities) is drafted.

Example: a first user asked "What is a monad?" and the answer was kept. A second user asks the
same: the prompt's last tokens match the kept prompt end, and the whole first answer drafts, a
few tokens a step at first (the match is short) and up to ``factor`` × ``match`` once it is long.

A node's feature says its structure, match length, probability and support, so the planner learns
per kind of node how often it is accepted and verifies only what pays on this machine. Provenance:
the request's own candidates cite where their tokens are in its context; global ones cite nothing
(``NO_SOURCE``), so no draft ever points into another request.
"""

from __future__ import annotations

import numpy as np

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    RequestState,
    bucket,
    float_option,
    int_option,
    shared_prefix,
)
from llm_worker.drafters.suffix_tree import Candidate, SuffixStore, SuffixTrie, grow
from llm_worker.model.target import TargetModel
from llm_worker.types import NO_SOURCE, DraftTree

OWN, GLOBAL = "own", "global"


class _Own(DrafterState):
    """The request's own suffix trie over its committed tokens (one sequence, id 0)."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)

    def update(self, tokens: np.ndarray) -> bool:
        """Append what committed since the last step (``tokens``: [T], all of them); False when
        ``tokens`` is not a continuation of what the trie holds (then start afresh)."""
        kept = self.trie.seqs.get(0)
        n = 0
        if kept is not None:
            n = len(kept)
            if shared_prefix(np.frombuffer(kept, dtype=np.int64), tokens) < n:
                return False
        self.trie.append(0, tokens[n:].tolist())
        return True


def suffix_features(candidate: Candidate, where: str, match: int) -> list[str]:
    """Per node: ``suffix:<own|global>:m<match length>:p<conditional probability>:n<support>``,
    e.g. ``suffix:global:m8:p0.99:n2`` (support: occurrences the choice was made from, 1 or 2+)."""
    m = bucket(match, (1, 2, 4, 8))
    return [
        f"suffix:{where}:m{m}:p{bucket(p, (0.3, 0.6, 0.9, 0.99))}:n{1 if n == 1 else 2}"
        for p, n in zip(candidate.conditionals, candidate.supports, strict=True)
    ]


class SuffixDrafter(Drafter):
    def __init__(self, store: SuffixStore, match: int, factor: float, min_probability: float) -> None:
        self.store = store
        self.match = match
        self.factor = factor
        self.min_probability = min_probability

    def _own(self, ctx: DraftContext) -> SuffixTrie:
        state = ctx.request_state.drafter
        if not isinstance(state, _Own) or not state.update(ctx.tokens):
            state = _Own(self.store.depth)
            state.update(ctx.tokens)
            ctx.request_state.drafter = state
        return state.trie

    def _candidate(self, trie: SuffixTrie, context: list[int], budget: int) -> tuple[Candidate, int] | None:
        found = trie.match(context, self.match)
        if found is None:
            return None
        cursor, m = found
        size = min(budget, max(1, int(self.factor * m)))
        candidate = grow(trie, cursor, size, self.min_probability)
        return (candidate, m) if candidate.tokens else None

    def propose(self, ctx: DraftContext) -> DraftTree:
        own = self._own(ctx)  # kept up to date every step, drafting or not
        if ctx.budget <= 0:
            return DraftTree.empty()
        context = ctx.tokens[-self.match :].tolist()
        mine = self._candidate(own, context, ctx.budget)
        with self.store.lock:
            trie = self.store.trie(ctx.request_state.tenant)
            theirs = self._candidate(trie, context, ctx.budget) if trie is not None else None
        if theirs is not None and (mine is None or theirs[0].score > mine[0].score):
            (candidate, m), where = theirs, GLOBAL
            sources = (NO_SOURCE,) * len(candidate.tokens)  # never a position in another request
        elif mine is not None:
            (candidate, m), where = mine, OWN
            sources = candidate.sources
        else:
            return DraftTree.empty()
        features = suffix_features(candidate, where, m)
        return DraftTree(candidate.tokens, candidate.parents, sources, tuple(features))

    def finish(self, state: RequestState, tokens: np.ndarray, prompt_length: int) -> None:
        with self.store.lock:
            self.store.add(state.tenant, tokens.tolist(), prompt_length)


SUFFIX_OPTIONS = ("match", "factor", "min_p")


@DRAFTERS.register(
    "suffix",
    "SuffixDecoding: frequency-scored continuations of what the service said (per tenant) and of the request",
    SUFFIX_OPTIONS,
)
def _make_suffix(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return SuffixDrafter(
        resources.suffixes,
        match=int_option(options, "match", 16, 1, 64),
        factor=float_option(options, "factor", 1.0, 0.1, 64.0),
        min_probability=float_option(options, "min_p", 0.1, 0.0, 1.0),
    )
