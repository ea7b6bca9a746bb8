"""Sizing drafts by expected tokens per second: what the planner keeps of a draft that exists.

Two measured inputs:

- the verify cost curve t(n, L): seconds for one target forward of n new tokens after L cached
  ones (``llm_worker.costs``: measured on this machine, cached when measured quietly, checked
  against the forwards the engine times; ``CostCurve`` and its loaders are re-exported here);
- the acceptance model (``AcceptanceModel``): P(node accepted | its parent accepted), learned
  online per drafter from verification outcomes, keyed by the drafter's feature for the node, the
  node's depth and the target's confidence in the root token.

A node's chance to be accepted is the product of those conditional chances along its path, so
the expected tokens of a step that verifies nodes S is E(S) = 1 + Σ_{v∈S} P(v) (the bonus token
always comes). ``DraftPlanner.plan`` keeps the most likely nodes (a prefix of the nodes sorted by
P, which is a valid subtree because P never grows down a path) and chooses how many to keep by
maximising E(S) / t(1 + |S|, L): where t is nearly flat (a GPU) that means long drafts, where it
grows steeply with n (a CPU) short ones unless the drafter is often right. ``plan_batch`` prices
a batch of drafts by the positions its forward computes, t(D·(1 + L)). Both stay within the
step's ``DraftBudget`` (the planner's cap, the curve's measured range, the request's budget and
the tokens left) and, under continuous batching, price the whole forward the draft joins
(``BatchLoad``: the other requests' rows and tokens, the excess of the last shared forward over
the curve, the request's drafting time).

Whether a step drafts at all is decided before a drafter spends, by the request's speculation
policy (``llm_worker.speculation``); the draft gate it asks (``DraftGate``: per confidence
bucket, what drafting earned and spent) lives in the planner, one per drafter and kind of
sampling, beside the acceptance model it complements.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from llm_worker.config import PlannerConfig
from llm_worker.costs import CURVE_FORMAT as CURVE_FORMAT
from llm_worker.costs import CostCurve as CostCurve
from llm_worker.costs import CurveCheck as CurveCheck
from llm_worker.costs import cost_cache_path as cost_cache_path
from llm_worker.costs import load_or_measure_curve as load_or_measure_curve
from llm_worker.costs import measure_cost_curve as measure_cost_curve
from llm_worker.types import DraftBatch, DraftTree, Outcome, VerifyResult

DEPTH_BOUNDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
CONFIDENCE_BOUNDS = (0.3, 0.6, 0.9, 0.99)


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
            for entry in (
                self.fine.setdefault((tree.feature(node), d, c), [0.0, 0.0]),
                self.pooled.setdefault((d, c), [0.0, 0.0]),
            ):
                entry[0] = entry[0] * decay + hit
                entry[1] = entry[1] * decay + 1.0


@dataclass
class _GateBucket:
    earned: float = 0.0  # mean steps a drafting step earned (negative: lost)
    square: float = 0.0  # mean of their squares
    spent: float = 0.0  # mean steps a drafting step spent drafting, before any verify
    seen: int = 0
    skipped: int = 0  # steps skipped since the last probe
    interval: int = 0  # a probe every this many steps while closed (0: not closed yet)


@dataclass
class DraftGate:
    """Whether a step drafts at all: learned from what drafting earned, before a drafter spends.

    The acceptance model sizes a draft after it exists; a learned drafter pays for its forwards
    before that (``glide``: a catch-up forward and one forward per chain token), so where its
    drafts rarely pay the cheapest plan is not to draft. After every step that drafted, the gate
    books what drafting earned, in steps of the root alone,

        (accepted · s − draft seconds − (t(1 + n) − t(1))) / t(1),

    and what drafting spent, draft seconds / t(1) (each accepted token saved a step, s seconds
    as the request's plain steps measured; the n verified nodes' share of the forward is priced
    under the batch's load),
    keyed by the target's confidence in the root (``confidence_bucket``), as running means that
    turn into exponential ones (weight ``gate_rate``). A bucket closes where drafting lost more
    than ``gate_margin`` of a step beyond doubt (``_closed``) and spent more than that before
    verifying. Only drafters marked ``gated`` (learned networks) are asked about: a copy
    drafter costs next to nothing (``pld`` looks a context up in under 2 % of a step on the
    default model; a larger share of a tiny model's step) and is left to the acceptance model,
    so its bursts of long copies are never missed. A closed bucket still
    drafts every ``gate_probe``-th step, the interval doubling after each probe that did not
    reopen it (to ``gate_probe_max``, or further where probes that often would cost more than
    ``gate_probe_share`` of the steps), so that it can prove otherwise when the text changes; the first
    ``gate_warmup`` steps of a bucket always draft. While every bucket is closed, steps are not
    asked about one by one: a probe comes every as many steps as the shortest interval, and the
    steps between skip the pass over the vocabulary that measures the root's confidence (about
    1 % of a decoding step on the reference CPU). Output never depends on the gate: a step that
    does not draft is a plain decoding step.
    """

    cfg: PlannerConfig
    buckets: dict[float, _GateBucket] = field(default_factory=dict)
    blind_skipped: int = 0
    """Steps skipped since the last probe while every bucket was closed (``probe_blind``)."""

    def _closed(self, b: _GateBucket) -> bool:
        """Drafting spent and lost more than the margin, beyond doubt: the mean plus one standard
        error (over the ~1 / ``gate_rate`` steps the mean remembers) still below it. A step
        earns 0 to 5 or more steps, so a mean of a few dozen is no verdict by itself."""
        cfg = self.cfg
        if b.seen < cfg.gate_warmup or b.spent <= cfg.gate_margin:
            return False
        remembered = min(b.seen, 1.0 / cfg.gate_rate)
        error = math.sqrt(max(0.0, b.square - b.earned**2) / remembered)
        return b.earned + error < -cfg.gate_margin

    def open(self, confidence: float) -> bool:
        cfg = self.cfg
        b = self.buckets.get(confidence_bucket(confidence))
        if not cfg.gate or b is None or not self._closed(b):
            return True
        b.interval = b.interval or cfg.gate_probe
        b.skipped += 1
        if b.skipped >= b.interval:
            b.skipped = 0
            return True
        return False

    def closed_everywhere(self) -> bool:
        """Whether every bucket seen so far is closed: then which bucket a step falls in does not
        matter until a probe, and the root's confidence need not be measured (``probe_blind``)."""
        if not self.cfg.gate or not self.buckets or not all(self._closed(b) for b in self.buckets.values()):
            return False
        for b in self.buckets.values():
            b.interval = b.interval or self.cfg.gate_probe
        return True

    def probe_blind(self) -> bool:
        """A step while every bucket is closed, its confidence unmeasured: True every as many
        steps as the shortest probe interval of the buckets (a probe, booked to whichever bucket
        its confidence falls in; a bucket not seen yet then starts its warm-up)."""
        self.blind_skipped += 1
        if self.blind_skipped >= min(b.interval for b in self.buckets.values()):
            self.blind_skipped = 0
            return True
        return False

    def observe(self, confidence: float, verified: float, spent: float, after_gap: bool = False) -> None:
        """One drafting step: ``verified`` steps of the root alone its verify earned (accepted
        tokens less the nodes' share of the forward), ``spent`` steps drafting. ``after_gap``: the
        steps before it did not draft, so a drafter that keeps state caught up on all of them at
        once; that one-off is not what drafting costs, so the bucket's usual spending stands in."""
        b = self.buckets.setdefault(confidence_bucket(confidence), _GateBucket())
        if after_gap and b.seen:
            spent = b.spent
        b.seen += 1
        weight = max(1.0 / b.seen, self.cfg.gate_rate)
        earned = verified - spent
        b.earned += (earned - b.earned) * weight
        b.square += (earned**2 - b.square) * weight
        b.spent += (spent - b.spent) * weight
        if b.interval:  # a probe: the next one comes later if this one did not reopen the bucket
            b.interval = min(2 * b.interval, self._longest_interval(b)) if self._closed(b) else 0

    def _longest_interval(self, b: _GateBucket) -> int:
        """The probe interval's cap: ``gate_probe_max``, or longer where a probe spends so much
        that probing that often would cost more than ``gate_probe_share`` of the steps."""
        cfg = self.cfg
        return max(cfg.gate_probe_max, math.ceil(b.spent / cfg.gate_probe_share))


@dataclass(frozen=True)
class BatchLoad:
    """The rest of the forward a request's draft joins (``llm_worker.batching``): the rows the
    other requests put in it and the tokens they get out of it. None of it: a request alone."""

    rows: float = 0.0
    tokens: float = 0.0
    forward_rows: int = 0
    forward_seconds: float = 0.0
    """Rows and seconds of the last forward over several requests (0: none). The cost curve was
    measured with one request; a forward over several also attends over each one's own cache,
    so what it took beyond t(forward_rows) is added to the curve's price of the rows."""
    draft_seconds: float = 0.0
    """The request's own drafting time a step (propose and plan, measured). Under load the next
    forward waits for every request's step, so a plan that keeps nodes is charged it too: 8
    requests each drafting 0.6 ms of Python between forwards of 17 ms slow all 8 by a quarter."""

    def drafting_cost(self, curve: CostCurve, n: int, context: int) -> float:
        """``cost`` of the root and n - 1 draft rows, plus the drafting time under load."""
        return self.cost(curve, n, context) + (self.draft_seconds if self.rows and n > 1 else 0.0)

    def cost(self, curve: CostCurve, n: int, context: int) -> float:
        """Seconds of the forward with ``n`` rows of this request beside the others."""
        extra = 0.0
        if self.forward_rows:
            extra = max(0.0, self.forward_seconds - curve.t(self.forward_rows, context))
        return curve.t(round(self.rows) + n, context) + extra


ALONE = BatchLoad()


@dataclass(frozen=True)
class DraftBudget:
    """How much one step may draft.

    ``tokens``: most draft tokens one forward may verify (the planner's cap, the measured range
    of the cost curve, the request's ``draft_budget``). ``depth``: most draft tokens one path
    can still turn into output (remaining tokens - 1: the bonus token always comes). A tree or a
    chain is capped by both at once (``tree_nodes``); a batch computes rows side by side, so its
    rows are cut at ``depth`` and its size is capped by ``tokens`` alone.

    Example: 2 tokens left, a cap of 64 → depth 1: a chain of one token, or a batch of up to 32
    one-token rows (D·(1 + L) ≤ 65).
    """

    tokens: int
    depth: int

    @property
    def tree_nodes(self) -> int:
        return min(self.tokens, self.depth)


@dataclass
class Plan:
    tree: DraftTree  # the nodes to verify (possibly empty)
    expected_tokens: float  # E(S), bonus included
    expected_seconds: float  # t(1 + |S|, L)


@dataclass
class BatchPlan:
    batch: DraftBatch  # the rows to verify, each cut to its kept part (possibly no rows)
    expected_tokens: float  # E(S) over the rows' trie, bonus included
    expected_seconds: float  # t(D·(1 + L), context)


class DraftPlanner:
    """Chooses which draft nodes to verify; learns from outcomes. One per drafter."""

    def __init__(self, curve: CostCurve, cfg: PlannerConfig) -> None:
        self.curve = curve
        self.cfg = cfg
        self.acceptance = AcceptanceModel(cfg)
        self.gate = DraftGate(cfg)
        self._skipped = 0

    def step_budget(self, remaining_tokens: int, draft_budget: int | None = None) -> DraftBudget:
        """This step's ``DraftBudget``; ``draft_budget``: the request's own cap on draft tokens."""
        tokens = min(self.cfg.max_draft_tokens, self.curve.sizes[-1] - 1)
        if draft_budget is not None:
            tokens = min(tokens, draft_budget)
        return DraftBudget(max(0, tokens), max(0, remaining_tokens - 1))

    def _reach(self, tree: DraftTree, confidence: float) -> list[float]:
        """P(node accepted) for every node: the product of conditional chances along its path."""
        depths = tree.depths()
        reach: list[float] = []
        for node, parent in enumerate(tree.parents):
            p = self.acceptance.p(tree.feature(node), depths[node], confidence)
            reach.append(p * (reach[parent] if parent >= 0 else 1.0))
        return reach

    def _explore(self) -> bool:
        """When nothing pays: verify one node anyway every 16th time, so that a feature judged
        hopeless can prove otherwise."""
        self._skipped += 1
        return self._skipped % 16 == 0

    def _limit(self, max_nodes: int | None) -> int:
        return self.cfg.max_draft_tokens if max_nodes is None else min(max_nodes, self.cfg.max_draft_tokens)

    def plan(
        self,
        tree: DraftTree,
        context: int,
        confidence: float = 1.0,
        max_nodes: int | None = None,
        load: BatchLoad = ALONE,
    ) -> Plan:
        """The nodes of ``tree`` worth verifying after ``context`` cached tokens.

        ``confidence``: the target's top-1 probability at the step that produced the root.
        ``max_nodes``: never keep more nodes than this (the request's draft budget), whatever
        the drafter proposed. ``load``: the other requests in the same forward. The rate then
        counts the whole forward, (load.tokens + E(S)) / (t(load.rows + 1 + |S|) + the request's
        drafting time): a node must pay for slowing everyone's step, so when the forward is
        already big (t grows with every row) speculation shrinks and stops; alone it is
        E(S) / t(1 + |S|).
        """
        others = load.tokens
        base = load.cost(self.curve, 1, context)
        if not len(tree):
            return Plan(tree, 1.0, base)
        reach = self._reach(tree, confidence)
        order = sorted(range(len(tree)), key=lambda v: (-reach[v], v))
        best_k, best_rate = 0, (others + 1.0) / base * self.cfg.min_gain
        expected = 1.0
        for k, node in enumerate(order[: self._limit(max_nodes)], start=1):
            expected += reach[node]
            rate = (others + expected) / load.drafting_cost(self.curve, 1 + k, context)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            if load.rows or not self._explore():  # under load, off means off
                return Plan(DraftTree.empty(), 1.0, base)
            best_k = 1
        keep = order[:best_k]
        chosen = tree.subtree(keep)
        e = 1.0 + sum(reach[v] for v in keep)
        return Plan(chosen, e, load.cost(self.curve, 1 + len(keep), context))

    def plan_batch(
        self,
        batch: DraftBatch,
        context: int,
        confidence: float = 1.0,
        max_nodes: int | None = None,
        max_depth: int | None = None,
        load: BatchLoad = ALONE,
    ) -> BatchPlan:
        """The rows of ``batch`` worth verifying, each cut to the part worth its cost.

        The same expected-gain rule as ``plan``, priced as a batch. The verdict is taken on the
        rows' trie, so a kept node set S still yields E(S) = 1 + Σ_{v∈S} P(v); but the forward
        computes every row in full, D rows of 1 + L columns, so it costs t(D·(1 + L)) rather
        than t(1 + |S|). Nodes are added most likely first (a parent before its children, so S
        stays a tree); D is the number of S's leaves (each leaf is the end of one row: a row is
        its first containing row cut at the leaf) and L its depth. The size with the best
        E(S) / t(D·(1 + L)) wins.

        ``max_nodes`` (``DraftBudget.tokens``, capped by ``max_draft_tokens``) bounds the
        positions computed: D·(1 + L) ≤ 1 + max_nodes, the size of the largest tree step, so a
        batch never costs more than that tree would, and its draft tokens never exceed the budget.
        ``max_depth`` (``DraftBudget.depth``) cuts every row first: tokens past it cannot be output.

        The price assumes a real batched forward. The backends run the rows as their equivalent
        tree (the default ``TargetModel.forward_batch``) of 1 + Σ lengths positions, cheaper: the
        plan is conservative, and ``rest`` (the same candidates as a merged tree) is the better mode.

        Example: rows (5, 6, 7) and (5, 8), every node P = 0.9·parent: S = {5} is one row of
        length 1 (2 positions); adding 6 makes it (5, 6) (3 positions); adding 8 makes the rows
        (5, 6), (5, 8) (6 positions).

        ``load``: the other requests in the same forward, priced as in ``plan``.
        """
        others = load.tokens
        base = load.cost(self.curve, 1, context)
        if max_depth is not None:
            batch = batch.truncated([(r, min(len(row), max_depth)) for r, row in enumerate(batch.rows)])
        if not len(batch):
            return BatchPlan(DraftBatch.empty(), 1.0, base)
        trie = batch.trie()
        tree = trie.tree
        reach = self._reach(tree, confidence)
        depths = tree.depths()
        order = sorted(range(len(tree)), key=lambda v: (-reach[v], v))
        positions_limit = 1 + self._limit(max_nodes)
        kept_children = [0] * len(tree)
        best_k, best_rate = 0, (others + 1.0) / base * self.cfg.min_gain
        expected, leaves, deepest = 1.0, 0, 0
        sizes = []  # [k] positions the forward computes with the first k nodes of ``order``
        for node in order:
            parent = tree.parents[node]
            if parent < 0 or kept_children[parent] > 0:
                leaves += 1  # a new row; otherwise the parent's row grows by one token
            if parent >= 0:
                kept_children[parent] += 1
            deepest = max(deepest, depths[node])
            positions = leaves * (1 + deepest)
            if positions > positions_limit:
                break
            sizes.append(positions)
            expected += reach[node]
            rate = (others + expected) / load.drafting_cost(self.curve, positions, context)
            if rate > best_rate:
                best_k, best_rate = len(sizes), rate
        if best_k == 0:
            if not sizes or load.rows or not self._explore():
                return BatchPlan(DraftBatch.empty(), 1.0, base)
            best_k = 1
        keep = set(order[:best_k])
        has_kept_child = {tree.parents[v] for v in keep}
        leaf_rows = sorted((trie.first_row[v], depths[v]) for v in keep if v not in has_kept_child)
        chosen = batch.truncated(leaf_rows)
        e = 1.0 + sum(reach[v] for v in keep)
        return BatchPlan(chosen, e, load.cost(self.curve, sizes[best_k - 1], context))

    def observe(self, tree: DraftTree, result: VerifyResult, confidence: float = 1.0) -> None:
        self.acceptance.observe(tree, result, confidence)
