"""PLD+ (Somasundaram et al., 2024): rank the earlier occurrences of the last token by what the
model itself computed, and draft what follows the best one.

Let the context be x_0 .. x_{T-1}; x_{T-1}, the root, has no hidden state yet. Candidates are
the occurrences j (j <= T-2) with x_j = x_{T-1}; the draft is x_{j+1} .. x_{j+K}.

- ``pld+h``: score j by the cosine similarity of H_{j-1} and H_{T-2}, layer l's hidden states
  just before the occurrence and just before the root.
- ``pld+a``: score j by the attention the calibrated induction heads pay, from position T-2
  (the query that predicted x_{T-1}), to position j; max over heads.

Every draft node cites the context position it copies, which becomes the provenance of the
accepted span.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DraftResources,
    ModeUnavailableError,
    float_option,
    int_option,
)
from llm_worker.drafters.heads import find_heads_file, load_heads
from llm_worker.drafters.pld import common_suffix_length, match_bucket
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds, DraftTree

DEFAULT_HIDDEN_LAYER_FRACTION = 0.5  # replaced per model by the sweep result below
# fingerprint or weights id -> best layer (README, "pld+h layer"); swept in float32
SWEPT_LAYERS: dict[str, int] = {"28011fabd34fa01b": 17, "de7dc0073f16aefd": 17}
DEFAULT_HEADS = 50

log = logging.getLogger(__name__)


def occurrences(tokens: np.ndarray, first: int = 0) -> np.ndarray:
    """Positions j in [first, T-2] holding the root token x_{T-1}.

    Example: tokens [5, 1, 5, 2, 5] → [0, 2].
    """
    last = len(tokens) - 1
    return np.flatnonzero(tokens[first:last] == tokens[last]) + first


def rank_by_hidden(hidden: torch.Tensor, occ: np.ndarray) -> torch.Tensor:
    """Cosine similarity of H_{j-1} and H_{T-2} for each occurrence j.

    hidden: [T-1, hidden_size] (positions 0 .. T-2); occ: [m], every j >= 1 → [m].
    """
    current = hidden[-1].float()
    before = hidden[torch.from_numpy(occ - 1)].float()  # [m, hidden_size]
    return torch.nn.functional.cosine_similarity(before, current[None], dim=-1)


def rank_by_attention(attention: torch.Tensor, occ: np.ndarray) -> torch.Tensor:
    """Max over heads of the attention paid to each occurrence.

    attention: [heads, T-1] (query T-2 over keys 0 .. T-2); occ: [m] → [m].
    """
    return attention[:, torch.from_numpy(occ)].max(dim=0).values


def score_bucket(prefix: str, score: float) -> str:
    """Acceptance feature of a ranking score in [0, 1], in tenths."""
    return f"{prefix}{min(max(int(score * 10), 0), 9)}"


def top_copies(
    tokens: np.ndarray,
    occ: np.ndarray,
    scores: torch.Tensor,
    budget: int,
    prefix: str,
    theta: float | None,
    branches: int = 1,
) -> DraftTree:
    """Draft what follows the best-scoring occurrences (ties: the most recent first).

    ``branches`` > 1 merges the continuations of the top occurrences into a tree (shared
    prefixes once); each branch carries its own score as acceptance feature, so the planner can
    keep the likely branches and drop the others.
    """
    if occ.size == 0 or budget <= 0:
        return DraftTree.empty()
    values = scores.float().tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], -int(occ[i])))
    seqs: list[list[int]] = []
    srcs: list[list[int]] = []
    feats: list[list[str]] = []
    last = len(tokens) - 1
    for i in order:
        if len(seqs) == branches or (theta is not None and values[i] < theta):
            break
        start = int(occ[i]) + 1
        seq = tokens[start : start + budget].tolist()
        if not seq or seq in seqs:
            continue
        agree = common_suffix_length(tokens, int(occ[i]), last)
        feature = f"{score_bucket(prefix, values[i])}|{match_bucket(agree)}"
        seqs.append(seq)
        srcs.append(list(range(start, start + len(seq))))
        feats.append([feature] * len(seq))
    if not seqs:
        return DraftTree.empty()
    if len(seqs) == 1:
        return DraftTree.chain(seqs[0], sources=srcs[0], features=feats[0])
    return DraftTree.from_sequences(seqs, srcs, feats)


class HiddenStateDrafter(Drafter):
    def __init__(self, layer: int, theta: float | None, branches: int = 1) -> None:
        self.layer, self.theta, self.branches = layer, theta, branches
        self.needs = ArtifactNeeds(hidden_layers=frozenset({layer}))

    def propose(self, ctx: DraftContext) -> DraftTree:
        occ = occurrences(ctx.tokens, first=1)
        if occ.size == 0:
            return DraftTree.empty()
        scores = rank_by_hidden(ctx.hidden(self.layer), occ)
        return top_copies(ctx.tokens, occ, scores, ctx.budget, "h", self.theta, self.branches)


class AttentionDrafter(Drafter):
    def __init__(self, heads: tuple[tuple[int, int], ...], theta: float | None, branches: int = 1) -> None:
        self.heads, self.theta, self.branches = heads, theta, branches
        self.needs = ArtifactNeeds(query_heads=heads)

    def propose(self, ctx: DraftContext) -> DraftTree:
        occ = occurrences(ctx.tokens)
        if occ.size == 0:
            return DraftTree.empty()
        scores = rank_by_attention(ctx.attention(), occ)
        return top_copies(ctx.tokens, occ, scores, ctx.budget, "a", self.theta, self.branches)


def default_hidden_layer(target: TargetModel) -> int:
    swept = SWEPT_LAYERS.get(target.info.fingerprint, SWEPT_LAYERS.get(target.info.weights_id))
    if swept is not None:
        return swept
    return max(1, round(target.info.num_layers * DEFAULT_HIDDEN_LAYER_FRACTION))


@DRAFTERS.register(
    "pld+h",
    "PLD+: occurrences of the last token ranked by hidden-state similarity",
    ("layer", "theta", "branches"),
)
def _make_pld_h(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    layer = int_option(options, "layer", default_hidden_layer(target), 0, target.info.num_layers)
    branches = int_option(options, "branches", 1, 1, 16)
    return HiddenStateDrafter(layer, float_option(options, "theta", None, -1.0, 1.0), branches)


@DRAFTERS.register(
    "pld+a",
    "PLD+: occurrences of the last token ranked by induction-head attention",
    ("heads", "theta", "branches"),
)
def _make_pld_a(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    info = target.info
    count = int_option(options, "heads", DEFAULT_HEADS, 1, info.num_layers * info.num_heads)
    branches = int_option(options, "branches", 1, 1, 16)
    theta = float_option(options, "theta", None, -1.0, 1.0)
    if not target.supports_queries:
        raise ModeUnavailableError(
            f"pld+a reads per-head attention, which the {target.info.backend} backend does not expose; "
            "use a Llama-family model with --backend fast"
        )
    path = resources.heads_file or find_heads_file(target.info.fingerprint, target.info.weights_id)
    if path is None:
        raise ModeUnavailableError(
            f"no induction-head calibration for this model (fingerprint {target.info.fingerprint}); "
            "run: specdraft calibrate-heads --model DIR"
        )
    try:
        heads = load_heads(path)
    except ValueError as exc:
        log.error("pld+a: %s", exc)
        raise ModeUnavailableError(
            "the worker's induction-head file is not valid (the worker log says why)"
        ) from None
    outside = [
        (h.layer, h.head)
        for h in heads.heads
        if not (0 <= h.layer < info.num_layers and 0 <= h.head < info.num_heads)
    ]
    if outside:
        raise ModeUnavailableError(
            f"the worker's induction-head file names head {outside[0]}, which does not exist in this model "
            f"({info.num_layers} layers × {info.num_heads} heads); the file was calibrated for another model"
        )
    return AttentionDrafter(heads.top(count), theta, branches)
