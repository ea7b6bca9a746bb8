"""Whether a step drafts, and what drafting cost: one request's speculation policy.

The planner (``llm_worker.planner``) chooses how much of a draft to verify once it exists; this
decides before a drafter spends anything whether a step drafts at all, and books what it cost:

- **the draft gate** (``DraftGate``, shared by the mode's requests): asked before a gated drafter
  (a learned network) proposes, told after every step that drafted what drafting earned, in steps
  of the root alone;
- **the back-off under load**: with other requests in the forward, after a plan that kept nothing
  the next 1, 2, 4 … 16 steps do not draft at all (the wait doubles while plans keep coming back
  empty; a step with no load resets it);
- **two moving averages** of this request: its drafting time a step (priced into a plan under
  load as ``BatchLoad.draft_seconds``: every request's step is waited for by the next forward)
  and the time of a step that drafted nothing (what an accepted token saved, for the gate).

A step asks ``before_step`` whether to draft, ``price`` for the planner's price of its forward,
reports its proposal with ``after_propose`` and the verified step with ``after_step``. Output
never depends on any of it: a step that does not draft is a plain decoding step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from llm_worker.logits import top_probability
from llm_worker.planner import BatchLoad, DraftPlanner
from llm_worker.stats import GenerationStats

MAX_PAUSE_STEPS = 16
"""The longest back-off under load: steps that do not draft after plans that kept nothing."""

Pricer = Callable[[int], float]
"""Seconds of this step's forward with the root and n draft tokens (n = 0: the root alone)."""


def _average(mean: float | None, sample: float) -> float:
    """The moving average (weight 0.1 on the newest sample) with ``sample`` in it; the first
    sample (``mean`` None) stands alone."""
    return sample if mean is None else 0.9 * mean + 0.1 * sample


@dataclass
class SpeculationPolicy:
    """One request's speculation policy (see the module's docstring). Calls into the shared
    gate are made under the mode's ``lock``; everything else here is the request's own."""

    planner: DraftPlanner | None
    """The mode's planner for the request's kind of sampling (its gate and cost curve); None: a
    mode that never drafts."""
    lock: threading.Lock = field(repr=False)
    """The mode's lock: the planner, its gate and the drafter are shared by the mode's requests."""
    gated: bool
    """Whether the drafter asks the gate (``Drafter.gated``: learned networks)."""
    root_logits: torch.Tensor = field(repr=False)
    """[vocab] the logits of the row that produced the root of the next step."""
    confidence: float = 0.0
    """The target's top-1 probability at a root (the planner's and the gate's feature); measured
    only before a step that drafts, so it stays the last drafting step's until the next one."""
    measured: bool = False
    """Whether ``confidence`` is that of ``root_logits`` (a pass over the vocabulary, made once)."""
    draft_seconds: float = 0.0
    """Moving average of the seconds a drafting step spent proposing and planning (0: none yet)."""
    plain_step: float | None = None
    """Moving average of the seconds of a step that drafted nothing, all told (None: none yet);
    measured for gated drafters only."""
    pause: int = 0
    """Steps the back-off waits after the last plan under load that kept nothing (0, 1, 2 … 16)."""
    skip: int = 0
    """Steps of the current back-off still to wait."""
    gap: bool = False
    """The last step did not draft (a drafter that keeps state catches up on such steps)."""

    def load(self, others: BatchLoad) -> BatchLoad:
        """``others`` (the rest of the forward) with this request's drafting time in it."""
        return replace(others, draft_seconds=self.draft_seconds)

    def before_step(self, load: BatchLoad, wanted: bool, stats: GenerationStats) -> bool:
        """Whether this step drafts. ``wanted``: the planner left it a draft budget. Under
        ``load`` a step of a back-off does not; then a gated drafter asks the gate (at the root's
        confidence, measured here, unless every bucket is closed and no probe is due). Steps
        either held back count in ``stats.gated_steps``."""
        drafting = wanted and self.planner is not None
        if not load.rows:
            self.pause = self.skip = 0
        elif drafting and self.skip:
            self.skip -= 1
            drafting = False
            stats.gated_steps += 1
        blind = False  # every bucket closed: no confidence needed unless a probe is due
        if drafting and self.gated:
            assert self.planner is not None
            with self.lock:
                if self.planner.gate.closed_everywhere():
                    drafting = blind = self.planner.gate.probe_blind()
            stats.gated_steps += int(not drafting)
        if drafting and not self.measured:
            self.confidence, self.measured = top_probability(self.root_logits), True
        if drafting and self.gated and not blind:
            assert self.planner is not None
            with self.lock:
                drafting = self.planner.gate.open(self.confidence)
            stats.gated_steps += int(not drafting)
        return drafting

    def price(self, load: BatchLoad, length: int) -> Pricer:
        """Seconds of a forward of the root and n draft tokens after ``length`` cached tokens,
        beside the batch's other rows under ``load`` (what the planner prices a plan at)."""
        planner = self.planner
        assert planner is not None
        return lambda n: load.cost(planner.curve, 1 + n, length)

    def after_propose(self, load: BatchLoad, kept: int, seconds: float) -> None:
        """A step that drafted: the plan kept ``kept`` draft tokens; proposing and planning took
        ``seconds``. Under ``load`` a plan that kept nothing starts (or doubles) a back-off."""
        if load.rows:
            self.pause = 0 if kept else min(2 * self.pause or 1, MAX_PAUSE_STEPS)
            self.skip = self.pause
        self.draft_seconds = _average(self.draft_seconds or None, seconds)

    def after_step(
        self,
        price: Pricer | None,
        nodes: int,
        accepted: int,
        propose_seconds: float,
        step_began: float,
        root_logits: torch.Tensor,
    ) -> None:
        """A verified step. ``price``: its pricer if it drafted (None: it did not); ``nodes``:
        the draft tokens it verified, ``accepted`` of them accepted; ``propose_seconds``: its time
        proposing and planning; ``step_began``: when it began (``time.perf_counter``);
        ``root_logits``: [vocab] the row that produced the next root.

        After a drafting step a gated drafter's gate books what drafting earned (each accepted
        token saved a plain step, the verified nodes cost their share of the forward) and spent,
        in steps of the root alone; after a step that drafted nothing, its time is averaged.
        """
        if self.gated and price is not None:
            assert self.planner is not None
            saved = accepted * (self.plain_step or price(0))
            verified = (saved - (price(nodes) - price(0))) / price(0)
            with self.lock:
                self.planner.gate.observe(self.confidence, verified, propose_seconds / price(0), self.gap)
        elif self.gated and not nodes:  # a plain step: what one costs this request, all told
            self.plain_step = _average(self.plain_step, time.perf_counter() - step_began)
        self.gap = price is None
        self.root_logits, self.measured = root_logits, False
