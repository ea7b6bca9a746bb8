"""The cost curve and the draft-size rule."""

from __future__ import annotations

import time

import pytest

from helpers.models import engine_for, greedy_tokens, prompts, tiny_target
from llm_worker.config import CostConfig, PlannerConfig
from llm_worker.drafters import DRAFTERS, DraftContext, Drafter
from llm_worker.engine import GenerationRequest
from llm_worker.planner import AcceptanceModel, CostCurve, DraftGate, DraftPlanner, measure_cost_curve
from llm_worker.types import DraftTree, Outcome, VerifyResult


class CostlyWrong(Drafter):
    """Spends 2 ms on every draft and is never right (a token the target never chose)."""

    gated = True

    def propose(self, ctx: DraftContext) -> DraftTree:
        time.sleep(0.002)
        return DraftTree.chain([(int(ctx.tokens[-1]) + 1) % 7], features=["w"])


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


def test_gate_closes_where_drafting_lost_time_and_probes_to_reopen() -> None:
    gate = DraftGate(PlannerConfig(gate_warmup=4, gate_probe=5, gate_rate=0.5))
    for _ in range(4):  # warm-up: always drafts, whatever it cost
        assert gate.open(0.5)
        gate.observe(0.5, 0.1, 0.3)  # spent 0.3 of a step drafting, the verify earned 0.1
    assert [gate.open(0.5) for _ in range(10)] == [False] * 4 + [True] + [False] * 4 + [True]
    gate.observe(0.5, 0.1, 0.3)  # a probe that did not pay: the next one waits twice as long
    assert [gate.open(0.5) for _ in range(10)] == [False] * 9 + [True]
    assert gate.open(0.995)  # another confidence bucket keeps its own record
    for _ in range(3):  # probes that earned time bring the mean above the margin: open again
        gate.observe(0.5, 1.3, 0.3)
    assert all(gate.open(0.5) for _ in range(6))


def test_probes_of_a_costly_drafter_come_rarely_enough_to_cost_one_percent() -> None:
    """A probe that spends a whole step drafting comes at most every 100 steps (share 0.01),
    one that spends a tenth of a step every 32 (``gate_probe_max``)."""
    for spent, longest in ((1.0, 100), (0.1, 32)):
        gate = DraftGate(PlannerConfig(gate_warmup=2, gate_probe=8, gate_probe_max=32, gate_probe_share=0.01))
        for _ in range(2):
            gate.observe(0.5, 0.0, spent)
        intervals = []
        for _ in range(8):
            skipped = 1
            while not gate.open(0.5):
                skipped += 1
            intervals.append(skipped)
            gate.observe(0.5, 0.0, spent)  # a probe that did not pay
        assert intervals[:3] == [8, 16, 32] and intervals[-1] == longest, intervals


def test_gate_prices_a_catch_up_after_a_gap_at_the_usual_spending() -> None:
    gate = DraftGate(PlannerConfig(gate_warmup=2))
    for _ in range(2):
        gate.observe(0.5, 0.5, 0.2)  # earned 0.3 a step
    gate.observe(0.5, 0.5, 3.0, after_gap=True)  # caught up on many skipped steps at once
    assert gate.open(0.5)
    assert gate.buckets[0.6].spent == pytest.approx(0.2)


def test_gate_off_always_drafts() -> None:
    gate = DraftGate(PlannerConfig(gate=False, gate_warmup=1))
    gate.observe(0.5, 0.0, 1.0)
    assert gate.open(0.5)


def test_gate_stays_open_for_drafters_that_cost_next_to_nothing() -> None:
    gate = DraftGate(PlannerConfig(gate_warmup=1, gate_margin=0.05))
    for _ in range(20):
        gate.observe(0.5, -0.2, 0.01)  # 1 % of a step looking, then a verify that failed
    assert all(gate.open(0.5) for _ in range(10))


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


def test_engine_stops_drafting_where_drafts_cost_more_than_they_earn() -> None:
    target = tiny_target("llama")
    prompt = prompts(target.info.vocab_size)[0]
    with DRAFTERS.registered("test-costly", "test only", lambda target, opts, res: CostlyWrong()):
        for gate, gated in ((True, True), (False, False)):
            engine = engine_for(target, CostCurve.linear(0.001, 0.0), gate=gate, gate_warmup=4, gate_probe=8)
            ref = greedy_tokens(engine, prompt, "ar", 48)
            res = engine.generate(GenerationRequest(tuple(prompt), 48, "test-costly"))
            assert res.token_ids == ref
            steps = res.stats.target_forwards - 1  # the prefill drafts nothing
            if gated:  # after the warm-up of each bucket, only one step in eight still drafts
                assert steps > 12 and res.stats.gated_steps >= steps // 2
            else:
                assert res.stats.gated_steps == 0
