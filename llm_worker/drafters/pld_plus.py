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

from pathlib import Path

import numpy as np
import torch

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    ModeUnavailableError,
    float_option,
    int_option,
)
from llm_worker.drafters.heads import find_heads_file, load_heads
from llm_worker.drafters.pld import common_suffix_length, copy_draft, match_bucket
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds, DraftTree

DEFAULT_HIDDEN_LAYER_FRACTION = 0.5  # replaced per model by the sweep result below
SWEPT_LAYERS: dict[str, int] = {}  # fingerprint -> best layer (see README, "pld+h layer")
DEFAULT_HEADS = 50


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


def best_copy(
    tokens: np.ndarray, occ: np.ndarray, scores: torch.Tensor, budget: int, prefix: str, theta: float | None
) -> DraftTree:
    """Draft what follows the best-scoring occurrence (ties: the most recent)."""
    if occ.size == 0 or budget <= 0:
        return DraftTree.empty()
    values = scores.float()
    top = float(values.max())
    if theta is not None and top < theta:
        return DraftTree.empty()
    best = int(occ[int(torch.nonzero(values == top).max())])
    agree = common_suffix_length(tokens, best, len(tokens) - 1)
    feature = f"{score_bucket(prefix, top)}|{match_bucket(agree)}"
    return copy_draft(tokens, best + 1, budget, feature)


class HiddenStateDrafter(Drafter):
    def __init__(self, layer: int, theta: float | None) -> None:
        self.layer, self.theta = layer, theta
        self.needs = ArtifactNeeds(hidden_layers=frozenset({layer}))

    def propose(self, ctx: DraftContext) -> DraftTree:
        occ = occurrences(ctx.tokens, first=1)
        if occ.size == 0:
            return DraftTree.empty()
        scores = rank_by_hidden(ctx.hidden(self.layer), occ)
        return best_copy(ctx.tokens, occ, scores, ctx.budget, "h", self.theta)


class AttentionDrafter(Drafter):
    def __init__(self, heads: tuple[tuple[int, int], ...], theta: float | None) -> None:
        self.heads, self.theta = heads, theta
        self.needs = ArtifactNeeds(query_heads=heads)

    def propose(self, ctx: DraftContext) -> DraftTree:
        occ = occurrences(ctx.tokens)
        if occ.size == 0:
            return DraftTree.empty()
        scores = rank_by_attention(ctx.attention(), occ)
        return best_copy(ctx.tokens, occ, scores, ctx.budget, "a", self.theta)


def default_hidden_layer(target: TargetModel) -> int:
    swept = SWEPT_LAYERS.get(target.info.fingerprint)
    if swept is not None:
        return swept
    return max(1, round(target.info.num_layers * DEFAULT_HIDDEN_LAYER_FRACTION))


@DRAFTERS.register(
    "pld+h", "PLD+: occurrences of the last token ranked by hidden-state similarity", ("layer", "theta")
)
def _make_pld_h(target: TargetModel, options: dict[str, str]) -> Drafter:
    layer = int_option(options, "layer", default_hidden_layer(target), 0, target.info.num_layers)
    return HiddenStateDrafter(layer, float_option(options, "theta", None))


@DRAFTERS.register(
    "pld+a",
    "PLD+: occurrences of the last token ranked by induction-head attention",
    ("heads", "theta", "file"),
)
def _make_pld_a(target: TargetModel, options: dict[str, str]) -> Drafter:
    if not target.supports_queries:
        raise ModeUnavailableError(
            f"pld+a reads per-head attention, which the {target.info.backend} backend does not expose; "
            "use a Llama-family model with --backend fast"
        )
    path_option = options.get("file")
    path = Path(path_option) if path_option else find_heads_file(target.info.fingerprint)
    if path is None:
        raise ModeUnavailableError(
            f"no induction-head calibration for this model (fingerprint {target.info.fingerprint}); "
            "run: specdraft calibrate-heads --model DIR"
        )
    heads = load_heads(path)
    count = int_option(options, "heads", DEFAULT_HEADS, 1, target.info.num_layers * target.info.num_heads)
    return AttentionDrafter(heads.top(count), float_option(options, "theta", None))
