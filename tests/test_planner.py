"""The cost curve and the draft-size rule."""

from __future__ import annotations

import pytest

from helpers.models import tiny_target
from llm_worker.config import CostConfig, PlannerConfig
from llm_worker.planner import AcceptanceModel, CostCurve, DraftPlanner, measure_cost_curve
from llm_worker.types import DraftTree, Outcome, VerifyResult


def test_curve_interpolates_in_size_and_context() -> None:
    curve = CostCurve((1, 5), (100, 300), ((1.0, 2.0), (3.0, 6.0)))
    assert curve.t(1, 100) == 1.0
    assert curve.t(3, 100) == pytest.approx(1.5)
    assert curve.t(3, 200) == pytest.approx((1.5 + 4.5) / 2)
    assert curve.t(9, 100) == pytest.approx(3.0)  # beyond the largest size: last slope continues
    assert curve.relative(5, 300) == pytest.approx(2.0)
    assert CostCurve.from_json(curve.to_json()) == curve


def _planner(curve: CostCurve, p: float) -> DraftPlanner:
    planner = DraftPlanner(curve, PlannerConfig(max_draft_tokens=64, prior_accept=p, prior_weight=1e6))
    return planner


def chain(n: int) -> DraftTree:
    return DraftTree.chain(list(range(n)), features=["f"] * n)


def test_flat_gpu_like_curve_verifies_long_drafts() -> None:
    plan = _planner(CostCurve.linear(0.02, 0.00002), 0.8).plan(chain(40), 500)
    assert len(plan.tree) >= 20


def test_steep_cpu_curve_verifies_short_drafts() -> None:
    # Each extra token costs 6% of a forward: with 80% acceptance a handful of tokens pays off.
    plan = _planner(CostCurve.linear(0.04, 0.04 * 0.06), 0.8).plan(chain(40), 500)
    assert 2 <= len(plan.tree) <= 12
    # With 95% acceptance the same curve wants longer drafts.
    longer = _planner(CostCurve.linear(0.04, 0.04 * 0.06), 0.95).plan(chain(40), 500)
    assert len(longer.tree) > len(plan.tree)


def test_hopeless_drafts_are_not_verified() -> None:
    planner = _planner(CostCurve.linear(0.04, 0.04), 0.05)  # each token doubles the cost
    assert len(planner.plan(chain(10), 500).tree) == 0


def test_the_choice_maximises_expected_tokens_per_second() -> None:
    curve = CostCurve.linear(0.04, 0.004)
    planner = _planner(curve, 0.7)
    plan = planner.plan(chain(30), 100)
    k = len(plan.tree)

    def rate(m: int) -> float:
        return sum(0.7**i for i in range(m + 1)) / curve.t(1 + m, 100)

    assert all(rate(k) >= rate(m) - 1e-12 for m in range(31))


def test_acceptance_is_learned_per_feature_and_depth() -> None:
    model = AcceptanceModel(PlannerConfig(prior_accept=0.5, prior_weight=2.0, decay=1.0))
    tree = DraftTree.chain([1, 2, 3], features=["good", "good", "good"])
    for _ in range(50):
        model.observe(tree, VerifyResult((0, 1), 9, (Outcome.ACCEPTED, Outcome.ACCEPTED, Outcome.REJECTED)))
    assert model.p("good", 1) > 0.95
    assert model.p("good", 3) < 0.05
    # An unseen feature borrows the pooled estimate at its depth and confidence...
    assert model.p("other", 1) > 0.9
    # ...and with no data at all for a confidence bucket, the prior stands.
    assert model.p("other", 1, confidence=0.1) == pytest.approx(0.5)


def test_target_confidence_separates_acceptance() -> None:
    model = AcceptanceModel(PlannerConfig(prior_weight=2.0, decay=1.0))
    tree = DraftTree.chain([1], features=["f"])
    for _ in range(40):
        model.observe(tree, VerifyResult((0,), 9, (Outcome.ACCEPTED,)), confidence=0.995)
        model.observe(tree, VerifyResult((), 9, (Outcome.REJECTED,)), confidence=0.2)
    assert model.p("f", 1, 0.999) > 0.9 > 0.1 > model.p("f", 1, 0.25)


def token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every node as the tokens from the root's child down to it."""
    return {tuple(tree.tokens[v] for v in tree.path_to(node)) for node in range(len(tree))}


def parent_closed_subsets(tree: DraftTree) -> list[list[int]]:
    """Every set of nodes that holds each member's parent (brute force: trees of a few nodes)."""
    nodes = range(len(tree))
    subsets = [[v for v in nodes if mask >> v & 1] for mask in range(1 << len(tree))]
    return [s for s in subsets if all(tree.parents[v] < 0 or tree.parents[v] in s for v in s)]


@pytest.mark.parametrize(
    "p,kept",
    [
        (0.6, {(1,), (5,)}),
        (0.7, {(1,), (1, 2), (1, 4), (5,)}),
        (0.9, {(1,), (1, 2), (1, 2, 3), (1, 4), (5,)}),
    ],
)
def test_tree_plans_keep_whole_paths_and_maximise_the_rate(p: float, kept: set[tuple[int, ...]]) -> None:
    """Every node is accepted with p given its parent, so its reach is p^depth: the plan keeps the
    likeliest nodes — whole paths from the root, deeper ones as p grows — and no parent-closed
    choice of nodes (brute force) expects more tokens per second."""
    tree = DraftTree.from_sequences([[1, 2, 3], [1, 4], [5]], features=[["a"] * 3, ["a"] * 2, ["a"]])
    curve = CostCurve.linear(0.04, 0.01)
    plan = _planner(curve, p).plan(tree, 100)
    assert token_paths(plan.tree) == kept
    assert plan.expected_tokens == pytest.approx(1 + sum(p ** len(path) for path in kept))
    assert plan.expected_seconds == pytest.approx(curve.t(1 + len(kept), 100))
    depths = tree.depths()

    def rate(nodes: list[int]) -> float:
        return (1 + sum(p ** depths[v] for v in nodes)) / curve.t(1 + len(nodes), 100)

    best = max(rate(nodes) for nodes in parent_closed_subsets(tree))
    assert plan.expected_tokens / plan.expected_seconds == pytest.approx(best)


def test_measured_curve_on_a_tiny_model_is_sane() -> None:
    target = tiny_target("llama")
    curve = measure_cost_curve(target, CostConfig(sizes=(1, 4, 16), contexts=(32, 64), repeats=2), 17)
    assert curve.sizes == (1, 4, 16, 17)
    assert curve.contexts == (32, 64)
    assert [len(row) for row in curve.seconds] == [len(curve.sizes)] * len(curve.contexts)  # [C][S]
