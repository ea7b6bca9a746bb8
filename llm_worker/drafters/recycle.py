"""``recycle``: Token Recycling (Luo et al. 2024, arXiv 2408.08696), learnt online, no training.

Every verify forward ranks the whole vocabulary after each of its input rows, and plain decoding
keeps only one token of that ranking. Token Recycling keeps the target's k likeliest next tokens
after every input token in an adjacency matrix (``recycle_store``: one per tenant, retained
across requests, updated after every step) and drafts a tree from it: from the root token, the
children of a node with token t are the first entries of row t, expanded along a static tree
template. The planner learns how often a node is accepted by its rank among its siblings and by
whether its parent's row was written since the request began, and keeps what pays on this
machine's verify cost curve.

The template: the ``nodes`` paths of ranks, at most ``depth`` deep, with the highest product of
``RANK_ACCEPT`` along them (``best_paths``). Under independent acceptance per rank this is the
static tree with the most expected accepted tokens for its size (the argument of Medusa's and
Sequoia's trees), and it has the paper's shape: the likeliest branch deepest, more children
under higher ranks. Any of its prefixes in that order is again the best tree of its size, so
``nodes=`` shrinks it without changing its shape.

Example: row 7 = [3, 9], row 3 = [5, 2], row 9 = [4, 1]; root 7 with template
[(0,), (1,), (0, 0)] → nodes 3 and 9 under the root, 5 under 3.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    RequestState,
    int_option,
)
from llm_worker.drafters.recycle_store import EMPTY, RecycleStore
from llm_worker.model.target import TargetModel
from llm_worker.types import DraftTree

RANK_ACCEPT = (0.21, 0.078, 0.032, 0.022, 0.013, 0.013, 0.013, 0.013)
"""P(the target's next token is the r-th entry of the root's matrix row), by rank r: the prior that
shapes the template (the planner learns the real rates as it runs). Measured on 16 open-ended
corpus prompts that are no benchmark's questions, a row never written counting as a miss; ranks
4-7 pooled (``docs/measurements/2026-11-27-recycle.md``)."""

DEFAULT_NODES = 24
DEFAULT_DEPTH = 6


def best_paths(accept: tuple[float, ...], nodes: int, depth: int) -> list[tuple[int, ...]]:
    """The ``nodes`` rank paths of at most ``depth`` ranks with the highest product of
    ``accept`` along them, best first (ties: shorter, then smaller ranks). Closed under parents:
    a path's product never exceeds its parent's.

    Example: accept (0.5, 0.2), nodes 4, depth 3 → [(0,), (0, 0), (1,), (0, 0, 0)]
    (products 0.5, 0.25, 0.2, 0.125).
    """
    heap: list[tuple[float, int, tuple[int, ...]]] = [(-a, 1, (r,)) for r, a in enumerate(accept)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        score, length, path = heapq.heappop(heap)
        chosen.append(path)
        if length < depth:
            for r, a in enumerate(accept):
                heapq.heappush(heap, (score * a, length + 1, (*path, r)))
    return chosen


@dataclass(frozen=True)
class TreeTemplate:
    """Rank paths as arrays, nodes ordered by depth (a parent before its children).

    ``parent[i]``: node i's parent as an index into [root, node 0, node 1, ...] (0: the root);
    ``rank[i]``: which entry of its parent's matrix row node i takes; ``levels[d - 1]``: the
    (start, stop) of depth d's nodes.
    Example: paths [(0,), (1,), (0, 0)] → parent [0, 0, 1], rank [0, 1, 0], levels ((0, 2), (2, 3)).
    """

    paths: tuple[tuple[int, ...], ...]
    parent: np.ndarray  # [nodes] int64
    rank: np.ndarray  # [nodes] int64
    levels: tuple[tuple[int, int], ...]

    @staticmethod
    def from_paths(paths: list[tuple[int, ...]]) -> TreeTemplate:
        ordered = sorted(set(paths), key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(ordered)}
        parent = []
        for p in ordered:
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"template path {p} without its parent {p[:-1]}")
            parent.append(0 if len(p) == 1 else 1 + index[p[:-1]])
        depth = np.array([len(p) for p in ordered], dtype=np.int64)
        levels = tuple(
            (int(np.searchsorted(depth, d)), int(np.searchsorted(depth, d, side="right")))
            for d in range(1, int(depth.max(initial=0)) + 1)
        )
        return TreeTemplate(
            tuple(ordered),
            np.array(parent, dtype=np.int64),
            np.array([p[-1] for p in ordered], dtype=np.int64),
            levels,
        )

    def __len__(self) -> int:
        return len(self.paths)


def expand(
    next_tokens: np.ndarray, root: int, template: TreeTemplate, max_depth: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The template grown from ``root`` over ``next_tokens`` [vocab, k] (a tenant's matrix), level
    by level with one gather each, to at most ``max_depth``. A node whose entry is ``EMPTY`` is
    dropped with its subtree. Returns (tokens, parents, kept): the tokens of the nodes that exist,
    their parents as ``DraftTree`` numbers them (-1: the root) and their template node numbers.
    Siblings carry distinct tokens: a matrix row holds a top-k, distinct by construction.

    Example: see the module's docstring.
    """
    stop = template.levels[min(max_depth, len(template.levels)) - 1][1] if max_depth > 0 else 0
    tokens = np.full(1 + stop, EMPTY, dtype=np.int64)  # [root, node 0, ...]
    tokens[0] = root
    for lo, hi in template.levels[:max_depth]:
        above = tokens[template.parent[lo:hi]]
        found = next_tokens[np.maximum(above, 0), template.rank[lo:hi]]
        tokens[1 + lo : 1 + hi] = np.where(above >= 0, found, EMPTY)
    kept = np.flatnonzero(tokens[1:] >= 0)
    renumber = np.full(1 + stop, -1, dtype=np.int64)  # template number + 1 → tree number
    renumber[1 + kept] = np.arange(len(kept))
    return tokens[1 + kept], renumber[template.parent[kept]], kept


class _State(DrafterState):
    def __init__(self, since: int) -> None:
        self.since = since  # the store's clock when the request began: later rows are "new"


class RecycleDrafter(Drafter):
    """Drafts from ``store``'s matrix of the request's tenant along ``template``; feeds the
    matrix from every verify forward (``observe_candidates``)."""

    def __init__(self, store: RecycleStore, vocab: int, template: TreeTemplate) -> None:
        self.store = store
        self.vocab = vocab
        self.template = template
        self.candidates = store.k
        self._features = {
            (r, new): f"tr:r{r}:{'new' if new else 'old'}" for r in range(store.k) for new in (0, 1)
        }

    def propose(self, ctx: DraftContext) -> DraftTree:
        state = ctx.request_state
        if not isinstance(state.drafter, _State):
            state.drafter = _State(self.store.clock + 1)
        matrix = self.store.get(state.tenant)
        if matrix is None or ctx.budget <= 0 or not len(ctx.tokens):
            return DraftTree.empty()
        root = int(ctx.tokens[-1])
        if not 0 <= root < len(matrix.next):  # a token of logits wider than the vocabulary
            return DraftTree.empty()
        tokens, parents, kept = expand(matrix.next, root, self.template, ctx.budget)
        if not len(tokens):
            return DraftTree.empty()
        above = np.where(parents >= 0, tokens[np.maximum(parents, 0)], root)  # whose row drafted each
        new = (matrix.written[above] >= state.drafter.since).tolist()
        features = [self._features[r, n] for r, n in zip(self.template.rank[kept].tolist(), new, strict=True)]
        return DraftTree(tuple(tokens.tolist()), tuple(parents.tolist()), (), tuple(features))

    def observe_candidates(self, state: RequestState, inputs: np.ndarray, candidates: np.ndarray) -> None:
        self.store.observe(state.tenant, self.vocab, inputs, candidates)


@DRAFTERS.register(
    "recycle",
    "Token Recycling: a tree from the target's past top-k candidates per token, learnt online",
    ("nodes", "depth"),
)
def _make_recycle(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    nodes = int_option(options, "nodes", DEFAULT_NODES, 1, 256)
    depth = int_option(options, "depth", DEFAULT_DEPTH, 1, 16)
    store = resources.recycling
    template = TreeTemplate.from_paths(best_paths(RANK_ACCEPT[: store.k], nodes, depth))
    return RecycleDrafter(store, target.info.vocab_size, template)
