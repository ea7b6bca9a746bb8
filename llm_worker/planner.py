"""Sizing drafts by expected tokens per second.

Two measured inputs:

- the verify cost curve t(n, L): seconds for one target forward of n new tokens after L cached
  ones, measured on this machine at start-up (and cached per model, dtype, device, threads);
- the acceptance model: P(node accepted | its parent accepted), learned online per drafter
  from verification outcomes, keyed by the drafter's feature for the node, the node's depth and
  the target's confidence in the root token.

A node's chance to be accepted is the product of those conditional chances along its path, so
the expected tokens of a step that verifies nodes S is E(S) = 1 + Σ_{v∈S} P(v) (the bonus token
always comes). The planner keeps the most likely nodes (a prefix of the nodes sorted by P, which
is a valid subtree because P never grows down a path) and chooses how many to keep by maximising
E(S) / t(1 + |S|, L). On a GPU, where t is nearly flat, that means long drafts; on this CPU, where
t(65) ≈ 4·t(1), it means short ones unless the drafter is often right.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llm_worker.config import CostConfig, PlannerConfig
from llm_worker.model.loading import cache_root
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds, DraftTree, Outcome, VerifyResult

log = logging.getLogger(__name__)

DEPTH_BOUNDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
CONFIDENCE_BOUNDS = (0.3, 0.6, 0.9, 0.99)


@dataclass(frozen=True)
class CostCurve:
    """t(n, L): measured seconds per target forward of n new tokens after L cached tokens."""

    sizes: tuple[int, ...]  # [S] ascending
    contexts: tuple[int, ...]  # [C] ascending
    seconds: tuple[tuple[float, ...], ...]  # [C][S]

    def _at_context(self, row: tuple[float, ...], n: int) -> float:
        sizes = self.sizes
        if n <= sizes[0] or len(sizes) == 1:
            return row[0]
        i = bisect.bisect_left(sizes, n)
        if i >= len(sizes):  # beyond the largest measured size: extend the last slope
            i = len(sizes) - 1
        lo, hi = sizes[i - 1], sizes[i]
        return row[i - 1] + (row[i] - row[i - 1]) * (n - lo) / (hi - lo)

    def t(self, n: int, context: int) -> float:
        if len(self.contexts) == 1:
            return self._at_context(self.seconds[0], n)
        c = self.contexts
        i = min(max(bisect.bisect_left(c, context), 1), len(c) - 1)
        a = self._at_context(self.seconds[i - 1], n)
        b = self._at_context(self.seconds[i], n)
        value = a + (b - a) * (context - c[i - 1]) / (c[i] - c[i - 1])
        return max(value, 1e-6)

    def relative(self, n: int, context: int) -> float:
        """t(n) / t(1) at this context."""
        return self.t(n, context) / self.t(1, context)

    def to_json(self) -> dict[str, object]:
        return {
            "sizes": list(self.sizes),
            "contexts": list(self.contexts),
            "seconds": [list(r) for r in self.seconds],
        }

    @staticmethod
    def from_json(data: dict[str, list]) -> CostCurve:
        return CostCurve(
            tuple(int(s) for s in data["sizes"]),
            tuple(int(c) for c in data["contexts"]),
            tuple(tuple(float(v) for v in row) for row in data["seconds"]),
        )

    @staticmethod
    def linear(base: float, per_token: float, sizes: tuple[int, ...] = (1, 65)) -> CostCurve:
        """A synthetic curve t(n) = base + per_token * (n - 1), context-independent (for tests)."""
        return CostCurve(sizes, (0,), (tuple(base + per_token * (s - 1) for s in sizes),))


def measure_cost_curve(target: TargetModel, cfg: CostConfig, max_size: int) -> CostCurve:
    """Time forwards of each size at each context length; medians of ``cfg.repeats``.

    Sizes are visited in a shuffled order on every repeat so that machine noise spreads over
    all of them instead of biasing one.
    """
    max_size = max(1, min(max_size, target.info.max_context // 2))
    sizes = tuple(sorted({s for s in cfg.sizes if s <= max_size} | {1, max_size}))
    limit = max(1, target.info.max_context - max(sizes) - 1)
    contexts = tuple(sorted({max(1, min(c, limit)) for c in cfg.contexts}))
    vocab = target.info.vocab_size
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for context in contexts:
            state = target.start()
            prompt = torch.randint(0, vocab, (context,), generator=gen)
            target.forward(state, prompt, None, ArtifactNeeds())
            target.commit(state, range(context))
            samples: dict[int, list[float]] = {s: [] for s in sizes}
            order = list(sizes)
            for _ in range(cfg.repeats + 1):  # the first round warms up
                rng.shuffle(order)
                for n in order:
                    tokens = torch.randint(0, vocab, (n,), generator=gen)
                    begin = time.perf_counter()
                    target.forward(state, tokens, None, ArtifactNeeds())
                    samples[n].append(time.perf_counter() - begin)
                    target.commit(state, [])
            rows.append(tuple(statistics.median(samples[n][1:]) for n in sizes))
    return CostCurve(sizes, contexts, tuple(rows))


def cost_cache_path(target: TargetModel) -> Path:
    i = target.info
    threads = torch.get_num_threads()
    backend = i.backend + target.kernel_variant
    key = f"{i.fingerprint}-{backend}-{i.dtype}-{i.device}-t{threads}-torch{torch.__version__}"
    return cache_root() / "cost" / (key.replace("/", "_").replace(":", "_") + ".json")


def load_or_measure(target: TargetModel, cfg: CostConfig, max_size: int) -> CostCurve:
    path = cost_cache_path(target)
    if cfg.cache and path.is_file():
        try:
            curve = CostCurve.from_json(json.loads(path.read_text()))
            if curve.sizes[-1] >= max_size:
                return curve
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable cost curve %s: %s", path, exc)
    log.info("measuring the verify cost curve (once per model, dtype, device and thread count)")
    curve = measure_cost_curve(target, cfg, max_size)
    if cfg.cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(curve.to_json(), f)
        os.replace(tmp, path)
    return curve


def depth_bucket(depth: int) -> int:
    return DEPTH_BOUNDS[min(bisect.bisect_left(DEPTH_BOUNDS, depth), len(DEPTH_BOUNDS) - 1)]


def confidence_bucket(confidence: float) -> float:
    """The target's top-1 probability when it produced the root, coarsely."""
    for bound in CONFIDENCE_BOUNDS:
        if confidence < bound:
            return bound
    return 1.0


@dataclass
class AcceptanceModel:
    """P(node accepted | parent accepted), learned from verification outcomes.

    Keyed by (drafter feature, depth bucket, confidence bucket), where the confidence is the
    target's top-1 probability at the step that produced the root: a model that is sure of its
    next token is usually copying, and copies continue. Estimates are Beta-smoothed towards the
    pooled estimate over all features at that depth and confidence, itself smoothed towards the
    configured prior, so a rare feature borrows strength from the common ones.
    """

    cfg: PlannerConfig
    fine: dict[tuple[str, int, float], list[float]] = field(default_factory=dict)  # key -> [accepted, seen]
    pooled: dict[tuple[int, float], list[float]] = field(default_factory=dict)

    def p(self, feature: str, depth: int, confidence: float = 1.0) -> float:
        d, c = depth_bucket(depth), confidence_bucket(confidence)
        w = self.cfg.prior_weight
        acc, seen = self.pooled.get((d, c), (0.0, 0.0))
        prior = (acc + w * self.cfg.prior_accept) / (seen + w)
        acc, seen = self.fine.get((feature, d, c), (0.0, 0.0))
        return (acc + w * prior) / (seen + w)

    def observe(self, tree: DraftTree, result: VerifyResult, confidence: float = 1.0) -> None:
        depths = tree.depths()
        decay = self.cfg.decay
        c = confidence_bucket(confidence)
        for node, outcome in enumerate(result.outcomes):
            if outcome == Outcome.UNREACHED:
                continue
            d = depth_bucket(depths[node])
            hit = 1.0 if outcome == Outcome.ACCEPTED else 0.0
            for table, key in ((self.fine, (tree.feature(node), d, c)), (self.pooled, (d, c))):
                entry = table.setdefault(key, [0.0, 0.0])  # type: ignore[attr-defined]
                entry[0] = entry[0] * decay + hit
                entry[1] = entry[1] * decay + 1.0


@dataclass
class Plan:
    tree: DraftTree  # the nodes to verify (possibly empty)
    expected_tokens: float  # E(S), bonus included
    expected_seconds: float  # t(1 + |S|, L)


class DraftPlanner:
    """Chooses which draft nodes to verify; learns from outcomes. One per drafter."""

    def __init__(self, curve: CostCurve, cfg: PlannerConfig) -> None:
        self.curve = curve
        self.cfg = cfg
        self.acceptance = AcceptanceModel(cfg)
        self._skipped = 0

    def budget(self, remaining_tokens: int) -> int:
        """Most draft tokens worth asking for: never more than can still be emitted."""
        return max(0, min(self.cfg.max_draft_tokens, self.curve.sizes[-1] - 1, remaining_tokens - 1))

    def plan(
        self, tree: DraftTree, context: int, confidence: float = 1.0, max_nodes: int | None = None
    ) -> Plan:
        """The nodes of ``tree`` worth verifying after ``context`` cached tokens.

        ``confidence``: the target's top-1 probability at the step that produced the root.
        ``max_nodes``: never keep more nodes than this (the request's draft budget), whatever
        the drafter proposed.
        """
        base = self.curve.t(1, context)
        if not len(tree):
            return Plan(tree, 1.0, base)
        depths = tree.depths()
        reach: list[float] = []
        for node, parent in enumerate(tree.parents):
            p = self.acceptance.p(tree.feature(node), depths[node], confidence)
            reach.append(p * (reach[parent] if parent >= 0 else 1.0))
        order = sorted(range(len(tree)), key=lambda v: (-reach[v], v))
        best_k, best_rate = 0, 1.0 / base * self.cfg.min_gain
        expected = 1.0
        limit = self.cfg.max_draft_tokens if max_nodes is None else min(max_nodes, self.cfg.max_draft_tokens)
        for k, node in enumerate(order[:limit], start=1):
            expected += reach[node]
            rate = expected / self.curve.t(1 + k, context)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            # Explore now and then, so that a feature judged hopeless can prove otherwise.
            self._skipped += 1
            if self._skipped % 16 != 0:
                return Plan(DraftTree.empty(), 1.0, base)
            best_k = 1
        keep = order[:best_k]
        chosen = tree.subtree(keep)
        e = 1.0 + sum(reach[v] for v in keep)
        return Plan(chosen, e, self.curve.t(1 + len(keep), context))

    def observe(self, tree: DraftTree, result: VerifyResult, confidence: float = 1.0) -> None:
        self.acceptance.observe(tree, result, confidence)
