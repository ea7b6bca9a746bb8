"""The verify step for each kind of draft, looked up by the draft's type (never by mode name).

A step is the middle of the engine's loop for one proposed draft: size it (the planner), run one
target forward over the root and the draft, take the verdict, and commit the KV of the root and
the accepted tokens. Two kinds today:

- ``DraftTree`` (chains included): one flattened forward with a tree attention mask
  (``llm_worker.verify.tree``), verdict on the tree, cache compacted to the accepted path;
- ``DraftBatch``: D rows of one batched forward, verdict on the rows' trie, one row's
  accepted columns committed (``llm_worker.verify.batch``).

A new kind of draft registers its ``Verification`` in ``VERIFICATIONS``; the engine does not
change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from llm_worker.config import SamplingParams
from llm_worker.logits import argmax, argmax_rows
from llm_worker.model.target import ForwardOutput, SequenceState, TargetModel
from llm_worker.penalties import Penalties
from llm_worker.planner import ALONE, BatchLoad, DraftBudget, DraftPlanner
from llm_worker.sampling import SamplingNoise, warp_logits
from llm_worker.types import NO_SOURCE, ArtifactNeeds, Draft, DraftBatch, DraftTree, VerifyResult
from llm_worker.verify.batch import chosen_row, trie_logits
from llm_worker.verify.tree import tree_buffers
from llm_worker.verify.verifier import verify_greedy, verify_sampling, verify_tokens

Decide = Callable[[torch.Tensor, DraftTree, int], VerifyResult]
"""(logits [1 + num_nodes, vocab] of the root and every node, the tree, the sequence position the
root's row predicts) → the verdict."""


def decider(sampling: SamplingParams, noise: SamplingNoise, penalties: Penalties | None = None) -> Decide:
    """Greedy: exact match with the argmax. Sampling: exact match with the position-coupled sample
    of the warped p (each row warped alone, as plain sampling warps it).

    ``penalties``: each row is penalised first, as at its own position — the committed tokens
    plus the path of the node it belongs to (``llm_worker.penalties``); only the rows of the
    accepted path are computed."""
    if penalties is not None:
        p = penalties

        def row_at(logits: torch.Tensor, tree: DraftTree, row: int) -> torch.Tensor:  # [vocab] float32
            return p.apply(logits[row], tree.path(row - 1))

        if sampling.greedy:
            return lambda logits, tree, position: verify_tokens(
                lambda row: argmax(row_at(logits, tree, row)), tree
            )
        return lambda logits, tree, position: verify_sampling(
            lambda row: warp_logits(row_at(logits, tree, row)[None], sampling)[0], tree, noise, position
        )
    if sampling.greedy:
        return lambda logits, tree, position: verify_greedy(argmax_rows(logits), tree)
    return lambda logits, tree, position: verify_sampling(
        lambda row: warp_logits(logits[row : row + 1], sampling)[0], tree, noise, position
    )


@dataclass(frozen=True)
class StepResult:
    """What one verify step committed, and what the planner and drafter learn from."""

    forward: ForwardOutput  # the rows the committed KV came from (a batch: the chosen row's)
    rows: list[int]  # committed rows of ``forward``: the root, then the accepted path
    decided: DraftTree  # the tree the verdict is about: the draft itself, or a batch's trie
    result: VerifyResult  # verdict on ``decided``'s nodes

    @property
    def tokens(self) -> list[int]:
        """Accepted tokens, then the bonus token."""
        return [self.decided.tokens[node] for node in self.result.accepted] + [self.result.bonus]

    @property
    def sources(self) -> list[int]:
        """[len(tokens)] context position each token was copied from (the bonus: none)."""
        return [self.decided.source(node) for node in self.result.accepted] + [NO_SOURCE]


DraftT = TypeVar("DraftT", DraftTree, DraftBatch)


class Verification(ABC, Generic[DraftT]):
    """Planning and verifying one kind of draft."""

    @abstractmethod
    def plan(
        self,
        planner: DraftPlanner,
        draft: DraftT,
        context: int,
        confidence: float,
        budget: DraftBudget,
        load: BatchLoad = ALONE,
    ) -> DraftT:
        """The part of ``draft`` worth verifying after ``context`` cached tokens, within ``budget``.

        ``confidence``: the target's top-1 probability at the step that produced the root.
        ``load``: the other requests sharing the forward (continuous batching).
        """

    @abstractmethod
    def step(
        self,
        target: TargetModel,
        state: SequenceState,
        root: int,
        draft: DraftT,
        needs: ArtifactNeeds,
        decide: Decide,
        position: int,
    ) -> StepResult:
        """One target forward over ``root`` and ``draft``, the verdict, and the commit.
        ``position``: the sequence position the root's row predicts."""


class TreeVerification(Verification[DraftTree]):
    def plan(
        self,
        planner: DraftPlanner,
        draft: DraftTree,
        context: int,
        confidence: float,
        budget: DraftBudget,
        load: BatchLoad = ALONE,
    ) -> DraftTree:
        return planner.plan(draft, context, confidence, max_nodes=budget.tree_nodes, load=load).tree

    def step(
        self,
        target: TargetModel,
        state: SequenceState,
        root: int,
        draft: DraftTree,
        needs: ArtifactNeeds,
        decide: Decide,
        position: int,
    ) -> StepResult:
        limit = target.branching_rows_limit(state)
        if limit is not None and 1 + len(draft) > limit and not draft.is_chain():
            draft = draft.subtree(range(limit - 1))  # nodes are in topological order: a subtree
        device = torch.device(target.info.device)
        inputs = torch.tensor((root, *draft.tokens), dtype=torch.long, device=device)  # [1 + num_nodes]
        fwd = target.forward(state, inputs, tree_buffers(draft.parents) if len(draft) else None, needs)
        result = decide(fwd.logits, draft, position)
        rows = [0] + [node + 1 for node in result.accepted]
        target.commit(state, rows)
        return StepResult(fwd, rows, draft, result)


class BatchVerification(Verification[DraftBatch]):
    """D rows of one batched forward; see ``llm_worker.verify.batch`` for why the trie verdict
    is exact."""

    def plan(
        self,
        planner: DraftPlanner,
        draft: DraftBatch,
        context: int,
        confidence: float,
        budget: DraftBudget,
        load: BatchLoad = ALONE,
    ) -> DraftBatch:
        plan = planner.plan_batch(
            draft, context, confidence, max_nodes=budget.tokens, max_depth=budget.depth, load=load
        )
        return plan.batch

    def step(
        self,
        target: TargetModel,
        state: SequenceState,
        root: int,
        draft: DraftBatch,
        needs: ArtifactNeeds,
        decide: Decide,
        position: int,
    ) -> StepResult:
        limit = target.branching_rows_limit(state)
        if limit is not None and draft.num_rows > 1 and 1 + len(draft) > limit:
            draft = _fit_rows(draft, limit - 1)
        if not len(draft):  # nothing to verify: a plain one-token step
            return TREE.step(target, state, root, DraftTree.empty(), needs, decide, position)
        device = torch.device(target.info.device)
        tokens = torch.cat(
            (
                torch.full((draft.num_rows, 1), root, dtype=torch.long, device=device),
                draft.padded(pad=root, device=device),
            ),
            dim=1,
        )  # [D, 1 + L]
        fwd = target.forward_batch(state, tokens, [len(r) for r in draft.rows], needs)
        trie = draft.trie()
        result = decide(trie_logits(fwd.logits, trie), trie.tree, position)
        row, count = chosen_row(trie, result)
        target.commit_batch(state, row, count)
        return StepResult(fwd.row(row), list(range(count)), trie.tree, result)


def _fit_rows(batch: DraftBatch, tokens: int) -> DraftBatch:
    """The first rows of ``batch`` holding at most ``tokens`` draft tokens in all, the last one cut."""
    keep = []
    for r, row in enumerate(batch.rows):
        take = min(len(row), tokens)
        keep.append((r, take))
        tokens -= take
    return batch.truncated(keep)


TREE = TreeVerification()
VERIFICATIONS: dict[type, Verification[Any]] = {DraftTree: TREE, DraftBatch: BatchVerification()}


def verification_for(draft: Draft) -> Verification[Any]:
    try:
        return VERIFICATIONS[type(draft)]
    except KeyError:
        raise TypeError(f"no verification registered for drafts of type {type(draft).__name__}") from None
