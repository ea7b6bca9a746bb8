"""CAPE's sibling table, derived from held-out acceptance.

``glide+cape`` adds the draft's next-best tokens as siblings at each depth, how many by the
draft's top-1 probability (``llm_worker.drafters.glide``: four bands, ``CAPE_BOUNDS``). Which
counts is measured here, not taken from the paper: on prompts training never saw, the target
answers greedily (``ar``); replaying each answer, the drafter drafts a chain teacher-forced along
it from every position (``GlideDrafter.depth_ranks``: each depth as on a path whose every node so
far was accepted), and we count per band how often the target's token was the draft's rank-r
candidate. A sibling of rank r is worth proposing in a band where it was the target's token at
least ``min_hit`` of the time; the band's count is the ranks 2, 3, ... in a row that clear it.

``min_hit`` is a property of the drafter, not of the machine: the planner still keeps, per step,
only the nodes that pay for their verify cost here (on this CPU a node must be right about one
time in six; on a GPU far less often), so the table only bounds what it may choose from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llm_worker.drafters.base import DraftContext, RequestState
from llm_worker.drafters.glide import CAPE_BOUNDS, DEFAULT_CAPE, MAX_SIBLINGS, GlideDrafter, cape_band
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model.target import KVBuffers, SequenceState, TargetModel


@dataclass
class CapeStats:
    """Ranks of the target's tokens among the draft's candidates, per CAPE band and per depth."""

    ranks: int = MAX_SIBLINGS + 1
    bands: list[list[int]] = field(default_factory=list)
    """[band][r]: positions whose true token was the draft's rank r (r = 1 .. ranks; r = 0:
    none of them)."""
    depths: dict[int, list[int]] = field(default_factory=dict)  # depth -> [top-1 hits, positions]
    turns: int = 0

    def __post_init__(self) -> None:
        if not self.bands:
            self.bands = [[0] * (self.ranks + 1) for _ in CAPE_BOUNDS]

    def add(self, depth: int, confidence: float, rank: int) -> None:
        self.bands[cape_band(confidence)][rank] += 1
        entry = self.depths.setdefault(depth, [0, 0])
        entry[0] += rank == 1
        entry[1] += 1

    def seen(self, band: int) -> int:
        return sum(self.bands[band])

    def hit_rates(self, band: int) -> list[float]:
        """[r - 1]: the share of the band's positions whose true token had rank r."""
        total = self.seen(band)
        return [self.bands[band][r] / total if total else 0.0 for r in range(1, self.ranks + 1)]

    def to_json(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "positions": sum(self.seen(b) for b in range(len(CAPE_BOUNDS))),
            "bands": [
                {
                    "top1_at_most": bound,
                    "positions": self.seen(b),
                    "hit_rate_by_rank": [round(x, 4) for x in self.hit_rates(b)],
                }
                for b, bound in enumerate(CAPE_BOUNDS)
            ],
            "top1_accuracy_by_depth": {
                str(d): round(hits / seen, 4) for d, (hits, seen) in sorted(self.depths.items()) if seen
            },
        }


def derive_table(stats: CapeStats, min_hit: float = 0.02, min_positions: int = 100) -> tuple[int, ...]:
    """Siblings per band: the ranks 2, 3, ... in a row whose hit rate is at least ``min_hit``
    (at most ``MAX_SIBLINGS``). A band seen at fewer than ``min_positions`` positions keeps
    the paper's count (``DEFAULT_CAPE``): too little evidence to overrule it."""
    table = []
    for band, default in enumerate(DEFAULT_CAPE):
        if stats.seen(band) < min_positions:
            table.append(default)
            continue
        rates = stats.hit_rates(band)
        count = 0
        while count < MAX_SIBLINGS and count + 1 < len(rates) and rates[count + 1] >= min_hit:
            count += 1
        table.append(count)
    return tuple(table)


def _replay_context(
    target: TargetModel, state: SequenceState, request_state: RequestState, tokens: list[int], budget: int
) -> DraftContext:
    """The draft context of the step whose root is ``tokens[-1]``, over a cache that already holds
    the whole replayed sequence: the drafter sees positions before the root only, as at that step
    (the KV views are cut there; the fused cross-attention reads keys below its rows' limits,
    which never pass the root)."""
    root = len(tokens) - 1

    def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = target.kv(state, layer)
        return keys[:, :root], values[:, :root]

    def kv_buffers(layer: int) -> KVBuffers | None:
        return target.kv_buffers(state, layer)

    return DraftContext(
        np.asarray(tokens, dtype=np.int64), budget, request_state=request_state, kv=kv, kv_buffers=kv_buffers
    )


def collect_stats(
    engine: Engine,
    drafter: GlideDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    depth: int = 5,
    progress: Callable[[int], None] | None = None,
) -> CapeStats:
    """The target answers each prompt greedily; every answer position is then the root of a
    teacher-forced chain of up to ``depth`` tokens, read off the target's own cache as it stood
    at that step. The cache is filled once per answer, in prefill chunks: the target's forward
    is batch-invariant, so its K/V are those of the step-by-step decode. ``progress``: called
    with the answer tokens replayed after each prompt."""
    target = engine.target
    needs = drafter.needs
    chunk = max(1, engine.config.prefill_chunk)
    stats = CapeStats()
    for prompt in prompts:
        answer = engine.generate(GenerationRequest(tuple(prompt), max_new_tokens, "ar")).token_ids
        seq = [int(t) for t in prompt] + [int(t) for t in answer]
        stats.turns += 1
        state = target.start()
        request_state = RequestState()
        with torch.inference_mode():
            cached = seq[:-1]  # the last answer token is never a root with a next token
            for lo in range(0, len(cached), chunk):
                piece = torch.tensor(cached[lo : lo + chunk])
                target.forward(state, piece, None, needs, last_logits_only=True)
                target.commit(state, range(len(piece)))
            for root in range(len(prompt) - 1, len(seq) - 1):  # the drafter sees seq[:root]
                ctx = _replay_context(target, state, request_state, seq[: root + 1], depth)
                truth = seq[root + 1 : root + 1 + depth]
                for d, (confidence, rank) in enumerate(drafter.depth_ranks(ctx, truth, stats.ranks), 1):
                    stats.add(d, confidence, rank)
        if progress is not None:
            progress(len(answer))
    return stats
