"""``recycle``: Token Recycling (Luo et al. 2024, arXiv 2408.08696), learnt online, no training.

Every verify forward ranks the whole vocabulary after each of its input rows, and plain decoding
keeps only one token of that ranking. Token Recycling keeps the target's k likeliest next tokens
after every input token in an adjacency matrix, and here also after its last two and three
tokens (``recycle_store``: one set of rows per tenant, retained across requests, updated after
every step), and drafts a tree from it: from the root, the children of a node are the first
entries of the row of its context (the longest written, else its token's own), expanded along a
static tree template. The planner learns how often a node is accepted by the context length of
its row, its rank among its siblings and whether that row was written since the request began,
and keeps what pays on this machine's verify cost curve.

The template: the ``nodes`` paths of ranks, at most ``depth`` deep, with the highest product of
``RANK_ACCEPT`` along them (``best_paths``). Under independent acceptance per rank this is the
static tree with the most expected accepted tokens for its size (the argument of Medusa's and
Sequoia's trees), and it has the paper's shape: the likeliest branch deepest, more children
under higher ranks. Any of its prefixes in that order is again the best tree of its size, so
``nodes=`` shrinks it without changing its shape.

Example: row 7 = [3, 9], row 3 = [5, 2], row 9 = [4, 1]; root 7 with template
[(0,), (1,), (0, 0)] → nodes 3 and 9 under the root, 5 under 3; had the context [7, 3] a row
[6, 8] of its own, 6 under 3.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    RequestState,
    affordable_nodes,
    int_option,
)
from llm_worker.drafters.recycle_store import CONTEXT_ORDERS, EMPTY, RecycleStore, TenantMatrix
from llm_worker.model.target import TargetModel
from llm_worker.types import DraftTree, ForwardCandidates

RANK_ACCEPT = (0.7, 0.1, 0.05, 0.03, 0.02, 0.02, 0.02, 0.02)
"""The prior of the r-th entry of a row being accepted, which shapes the template (the planner
learns the real rates as it runs, by rank, context length and depth): the likeliest entry of a
row read after the same three tokens was accepted 60-90 % of the time in a tuning run, of a
one-token row 5-27 %. Chosen on 16 open-ended prompts of the corpus's training split (none of a
benchmark's): this deep shape (rank 0 chained to the full depth) gave τ 1.26-1.27, the template of
the measured one-token rates (0.21, 0.078, 0.032, 0.022, then 0.013), three levels deep, 1.20
(``docs/measurements/2026-11-27-recycle-context.md``)."""

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
    nodes: tuple[tuple[int, int, int], ...]
    """(parent, rank, depth) of each node as Python ints: ``expand`` walks them one by one."""

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
            tuple((parent[i], p[-1], len(p)) for i, p in enumerate(ordered)),
        )

    def __len__(self) -> int:
        return len(self.paths)


class Expansion(NamedTuple):
    """A tree grown from the template (``expand``): the nodes that exist, their parents as
    ``DraftTree`` numbers them (-1: the root), their template node numbers, and for each node the
    context length of the row that drafted it (1: the parent's one-token row) and when that row
    was written."""

    tokens: np.ndarray
    parents: np.ndarray
    kept: np.ndarray
    order: np.ndarray
    written: np.ndarray


def expand(matrix: TenantMatrix, context: np.ndarray, template: TreeTemplate, max_depth: int) -> Expansion:
    """The template grown from the root (``context[-1]``, the committed text ending with it) over a
    tenant's ``matrix`` to at most ``max_depth``: a node's children come from the row of its
    context (``TenantMatrix.row``: the longest one written along the committed text and the
    branch, else its token's own). A node whose entry is ``EMPTY`` is dropped with its subtree.
    Siblings carry distinct tokens: a row holds a top-k, distinct by construction.

    Example: see the module's docstring.
    """
    width = max(CONTEXT_ORDERS)
    texts: list[tuple[int, ...]] = [tuple(int(t) for t in context[len(context) - min(len(context), width) :])]
    rows: dict[int, tuple[list[int], int, int]] = {}  # position (0: the root) → its row, order, written
    tokens: list[int] = []
    parents: list[int] = []
    kept: list[int] = []
    orders: list[int] = []
    written: list[int] = []
    number = {0: -1}  # position → tree number (-1: the root)
    for i, (above, rank, depth) in enumerate(template.nodes):
        if depth > max_depth:
            break
        texts.append(())
        if above not in number:  # its parent was dropped
            continue
        found = rows.get(above)
        if found is None:
            row, order, when = matrix.row(texts[above])
            found = rows[above] = (row.tolist(), order, when)
        token = found[0][rank]
        if token == EMPTY:
            continue
        texts[1 + i] = (*texts[above][1 - width :], token)
        number[1 + i] = len(tokens)
        tokens.append(token)
        parents.append(number[above])
        kept.append(i)
        orders.append(found[1])
        written.append(found[2])
    return Expansion(
        np.array(tokens, dtype=np.int64),
        np.array(parents, dtype=np.int64),
        np.array(kept, dtype=np.int64),
        np.array(orders, dtype=np.int64),
        np.array(written, dtype=np.int64),
    )


class _State(DrafterState):
    def __init__(self, since: int) -> None:
        self.since = since  # the store's clock when the request began: later rows are "new"


class RecycleDrafter(Drafter):
    """Drafts from ``store``'s matrix of the request's tenant along ``template``; feeds the
    matrix from every verify forward (``observe_candidates``)."""

    def __init__(
        self,
        store: RecycleStore,
        vocab: int,
        template: TreeTemplate,
        sized: Callable[[int], TreeTemplate] | None = None,
    ) -> None:
        """``sized``: the template of at most n nodes, for a step whose verify prices afford
        fewer nodes than ``template`` has (``affordable_nodes``); None = ``template`` always."""
        self.store = store
        self.vocab = vocab
        self.template = template
        self.sized = sized
        self._sized: dict[int, TreeTemplate] = {}
        self.candidates = store.k
        self._features = {
            (o, r, new): f"tr:o{o}:r{r}:{'new' if new else 'old'}"
            for o in (1, *CONTEXT_ORDERS)
            for r in range(store.k)
            for new in (False, True)
        }

    def propose(self, ctx: DraftContext) -> DraftTree:
        state = ctx.request_state
        if not isinstance(state.drafter, _State):
            state.drafter = _State(self.store.clock + 1)
        matrix = self.store.get(state.tenant)
        if matrix is None or len(matrix.next) != self.vocab or ctx.budget <= 0 or not len(ctx.tokens):
            return DraftTree.empty()  # none yet, or a seed of another vocabulary
        root = int(ctx.tokens[-1])
        if not 0 <= root < len(matrix.next):  # a token of logits wider than the vocabulary
            return DraftTree.empty()
        template = self.template_for(ctx)
        grown = expand(matrix, ctx.tokens[-max(CONTEXT_ORDERS) :], template, ctx.budget)
        if not len(grown.tokens):
            return DraftTree.empty()
        new = grown.written >= state.drafter.since
        features = [
            self._features[o, r, n]
            for o, r, n in zip(
                grown.order.tolist(), template.rank[grown.kept].tolist(), new.tolist(), strict=True
            )
        ]
        return DraftTree(tuple(grown.tokens.tolist()), tuple(grown.parents.tolist()), (), tuple(features))

    def template_for(self, ctx: DraftContext) -> TreeTemplate:
        """This step's template: ``template``, or where ``sized``, the one of the nodes the step's
        verify prices afford (``affordable_nodes``; made once per size)."""
        if self.sized is None or ctx.verify_seconds is None:
            return self.template
        nodes = affordable_nodes(ctx.verify_seconds, len(self.template.rank))
        template = self._sized.get(nodes)
        if template is None:
            template = self._sized[nodes] = self.sized(nodes)
        return template

    def observe_candidates(self, state: RequestState, rows: ForwardCandidates) -> None:
        contexts = rows.contexts(max(CONTEXT_ORDERS))
        self.store.observe(state.tenant, self.vocab, rows.inputs, rows.candidates, contexts)


@DRAFTERS.register(
    "recycle",
    "Token Recycling: a tree from the target's past top-k candidates per token and context, learnt online",
    ("nodes", "depth"),
)
def _make_recycle(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    nodes = int_option(options, "nodes", DEFAULT_NODES, 1, 256)
    depth = int_option(options, "depth", DEFAULT_DEPTH, 1, 16)
    store = resources.recycling

    def template(n: int) -> TreeTemplate:
        return TreeTemplate.from_paths(best_paths(RANK_ACCEPT[: store.k], n, depth))

    # without nodes=, the tree a step's verify prices afford (rest does the same)
    return RecycleDrafter(
        store, target.info.vocab_size, template(nodes), None if "nodes" in options else template
    )
