"""The per-request speculation policy without a model: the gate, the back-off, the averages."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from llm_worker.config import PlannerConfig
from llm_worker.planner import ALONE, BatchLoad, CostCurve, DraftPlanner
from llm_worker.speculation import SpeculationPolicy
from llm_worker.stats import GenerationStats

LOADED = BatchLoad(rows=3.0, tokens=3.0)
CURVE = CostCurve.linear(0.01, 0.001)  # t(1 + n) = 10 ms + 1 ms a draft token
ROOT = torch.tensor([0.0, 0.0, 0.0, 0.0])  # [vocab] a uniform row: top-1 probability 1/4


def policy(gated: bool = False, **cfg: Any) -> SpeculationPolicy:
    planner = DraftPlanner(CURVE, PlannerConfig(**cfg))
    return SpeculationPolicy(planner, threading.Lock(), gated, root_logits=ROOT)


def close_gate(p: SpeculationPolicy, confidence: float) -> None:
    """Book warm-up steps that spent a whole step drafting and earned nothing."""
    assert p.planner is not None
    for _ in range(p.planner.cfg.gate_warmup):
        p.planner.gate.observe(confidence, 0.0, 1.0)


def test_a_mode_without_a_planner_never_drafts() -> None:
    p = SpeculationPolicy(None, threading.Lock(), False, root_logits=ROOT)
    assert not p.before_step(ALONE, True, GenerationStats())
    assert not p.measured  # no pass over the vocabulary for a step that does not draft


def test_no_budget_no_draft_and_no_confidence_measured() -> None:
    p, stats = policy(), GenerationStats()
    assert not p.before_step(ALONE, False, stats)
    assert not p.measured and stats.gated_steps == 0


def test_the_confidence_is_measured_once_per_root() -> None:
    p, stats = policy(), GenerationStats()
    assert p.before_step(ALONE, True, stats)
    assert p.measured and p.confidence == pytest.approx(0.25)
    p.root_logits = torch.tensor([10.0, 0.0])  # not remeasured until after_step brings a new root
    assert p.before_step(ALONE, True, stats)
    assert p.confidence == pytest.approx(0.25)
    p.after_step(None, 0, 0, 0.0, time.perf_counter(), torch.tensor([0.0, 0.0]))
    assert not p.measured and p.confidence == pytest.approx(0.25)  # kept for the planner's observe
    assert p.before_step(ALONE, True, stats)
    assert p.confidence == pytest.approx(0.5)


def test_gate_open_lets_a_gated_drafter_draft() -> None:
    p, stats = policy(gated=True), GenerationStats()
    assert p.before_step(ALONE, True, stats)
    assert stats.gated_steps == 0


def test_gate_closed_holds_a_gated_drafter_back_and_probes() -> None:
    p, stats = policy(gated=True, gate_warmup=4, gate_probe=3), GenerationStats()
    close_gate(p, 0.25)
    drafts = [p.before_step(ALONE, True, stats) for _ in range(6)]
    assert drafts == [False, False, True, False, False, True]  # a probe every third step
    assert stats.gated_steps == 4


def test_a_gate_closed_everywhere_measures_no_confidence_between_probes() -> None:
    """Every bucket closed: the steps between probes skip the pass over the vocabulary; a probe
    measures it and is booked to its own bucket; a bucket that then pays opens again."""
    p, stats = policy(gated=True, gate_warmup=4, gate_probe=3), GenerationStats()
    close_gate(p, 0.25)
    close_gate(p, 0.95)
    assert p.planner is not None
    gate = p.planner.gate
    measured = []
    for _ in range(6):
        measured.append(p.before_step(ALONE, True, stats) and p.measured)
        p.after_step(None, 0, 0, 0.0, time.perf_counter(), ROOT)
    assert measured == [False, False, True, False, False, True]
    assert stats.gated_steps == 4
    for _ in range(40):  # drafting at confidence 1/4 pays again: its bucket opens, the gate looks again
        gate.observe(0.25, 3.0, 0.1)
    assert not gate.closed_everywhere()
    assert p.before_step(ALONE, True, stats) and p.measured


def test_a_closed_gate_leaves_an_ungated_drafter_alone() -> None:
    p, stats = policy(gated=False, gate_warmup=4), GenerationStats()
    close_gate(p, 0.25)
    assert all(p.before_step(ALONE, True, stats) for _ in range(5))
    assert stats.gated_steps == 0


def test_back_off_waits_1_2_4_8_16() -> None:
    p, stats = policy(), GenerationStats()
    pauses = []
    for _ in range(6):
        p.after_propose(LOADED, 0, 0.001)
        pauses.append(p.pause)
        assert p.skip == p.pause
        for _ in range(p.pause):
            assert not p.before_step(LOADED, True, stats)
        assert p.before_step(LOADED, True, stats)
    assert pauses == [1, 2, 4, 8, 16, 16]
    assert stats.gated_steps == sum(pauses)


def test_a_kept_plan_ends_the_back_off() -> None:
    p, stats = policy(), GenerationStats()
    for _ in range(3):
        p.after_propose(LOADED, 0, 0.001)
    assert p.pause == 4
    p.after_propose(LOADED, 2, 0.001)
    assert p.pause == p.skip == 0
    assert p.before_step(LOADED, True, stats)


def test_no_load_resets_the_back_off() -> None:
    p, stats = policy(), GenerationStats()
    for _ in range(4):
        p.after_propose(LOADED, 0, 0.001)
    assert p.pause == p.skip == 8
    assert p.before_step(ALONE, True, stats)  # alone: drafts at once, and the wait is forgotten
    assert p.pause == p.skip == 0
    p.after_propose(ALONE, 0, 0.001)  # an empty plan alone starts no back-off
    assert p.pause == p.skip == 0
    p.after_propose(LOADED, 0, 0.001)
    assert p.pause == 1  # under load again: from 1
    assert stats.gated_steps == 0


def test_a_step_that_does_not_want_to_draft_does_not_use_up_the_back_off() -> None:
    p, stats = policy(), GenerationStats()
    p.after_propose(LOADED, 0, 0.001)
    assert not p.before_step(LOADED, False, stats)
    assert p.skip == 1 and stats.gated_steps == 0


def test_drafting_seconds_are_a_moving_average_priced_under_load() -> None:
    p = policy()
    p.after_propose(ALONE, 1, 0.002)
    assert p.draft_seconds == pytest.approx(0.002)  # the first sample stands alone
    p.after_propose(ALONE, 1, 0.012)
    assert p.draft_seconds == pytest.approx(0.9 * 0.002 + 0.1 * 0.012)
    assert p.load(LOADED).draft_seconds == p.draft_seconds
    assert p.load(LOADED).rows == LOADED.rows


def test_plain_steps_are_a_moving_average_for_gated_drafters_only() -> None:
    root = torch.tensor([0.0, 1.0])
    for gated in (True, False):
        p = policy(gated=gated)
        p.after_step(None, 0, 0, 0.0, time.perf_counter() - 0.5, root)
        first = p.plain_step
        p.after_step(None, 0, 0, 0.0, time.perf_counter() - 1.5, root)
        if not gated:
            assert first is None and p.plain_step is None
            continue
        assert first == pytest.approx(0.5, abs=0.05)
        assert p.plain_step == pytest.approx(0.9 * first + 0.1 * 1.5, abs=0.05)
        assert p.gap


def test_the_gate_books_what_a_drafting_step_earned() -> None:
    p, stats = policy(gated=True), GenerationStats()
    p.plain_step = 0.02  # a plain step of this request takes 20 ms
    p.gap = True  # the step before did not draft
    assert p.before_step(ALONE, True, stats)
    price = p.price(ALONE, 100)
    assert price(0) == pytest.approx(0.01) and price(4) == pytest.approx(0.014)
    p.after_step(price, 4, 2, 0.005, time.perf_counter(), ROOT)
    assert p.planner is not None
    (bucket,) = p.planner.gate.buckets.values()
    # 2 accepted tokens saved 2 plain steps (40 ms); the 4 nodes cost 4 ms; drafting took 5 ms:
    # in steps of the root alone (10 ms) the verify earned 3.6, drafting spent 0.5
    assert bucket.seen == 1
    assert bucket.spent == pytest.approx(0.5)
    assert bucket.earned == pytest.approx(3.6 - 0.5)
    assert not p.gap and not p.measured


def test_a_step_that_drafted_is_not_a_plain_step() -> None:
    p = policy(gated=False)
    p.after_step(p.price(ALONE, 10), 3, 1, 0.001, time.perf_counter() - 1.0, ROOT)
    assert p.plain_step is None and p.planner is not None and not p.planner.gate.buckets
