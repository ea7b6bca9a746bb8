"""Batch verification: the batched forward against chains, the trie verdict, sizing, ``rest-batch``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from helpers.datastores import datastore_engine, datastore_for, own_samples_engine
from helpers.models import CPU_LIKE_CURVE, FLAT_CURVE, DraftTally, greedy_tokens, prompts, tiny_model
from helpers.stats import SAMPLES, chi_square_p, exact_distribution, sample_counts
from llm_worker.config import ModelConfig, PlannerConfig, SamplingParams
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.target import SequenceState, TargetModel
from llm_worker.planner import CostCurve, DraftPlanner
from llm_worker.sampling import SamplingNoise
from llm_worker.types import ArtifactNeeds, DraftBatch, DraftTree
from llm_worker.verify import steps
from llm_worker.verify.batch import chosen_row, trie_logits
from llm_worker.verify.verifier import verify_greedy, verify_sampling

NONE = ArtifactNeeds()
PREFIX = [3, 17, 42, 5, 9, 11, 23]
ROOT = 7
# Rows of different lengths: shared prefixes, a row that is a prefix of another, a 1-token row.
ROWS = ((8, 9, 10, 12), (8, 30), (31,), (8, 9, 10), (8, 9, 44, 45))


def reference_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def batch_inputs(batch: DraftBatch, root: int = ROOT) -> torch.Tensor:
    """[D, 1 + L]: the root, then each row padded."""
    return torch.cat((torch.full((batch.num_rows, 1), root), batch.padded(pad=root)), dim=1)


def prefilled(target: TargetModel) -> SequenceState:
    state = target.start()
    target.forward(state, torch.tensor(PREFIX), None, NONE)
    target.commit(state, range(len(PREFIX)))
    return state


# -- the data type and the pure verdict functions ------------------------------------------------


def test_draft_batch_trie_padding_and_truncation() -> None:
    batch = DraftBatch(((5, 6, 7), (5, 8)), features=(("a", "b", "c"), ("x", "y")))
    assert len(batch) == 5 and batch.num_rows == 2 and batch.max_length == 3
    assert batch.padded(pad=0).tolist() == [[5, 6, 7], [5, 8, 0]]
    trie = batch.trie()
    assert trie.tree.tokens == (5, 6, 7, 8) and trie.tree.parents == (-1, 0, 1, 0)
    assert trie.first_row == (0, 0, 0, 1)
    assert trie.tree.features == ("a", "b", "c", "y")  # a shared node keeps the first row's feature
    cut = batch.truncated([(1, 1), (0, 2)])
    assert cut.rows == ((5,), (5, 6)) and cut.features == (("x",), ("a", "b"))
    with pytest.raises(ValueError):
        DraftBatch(((5,), ()))
    with pytest.raises(ValueError):
        DraftBatch(((5, 6),), features=(("a",),))


def test_trie_logits_and_chosen_row() -> None:
    batch = DraftBatch(((5, 6, 7), (5, 8)))
    trie = batch.trie()
    logits = torch.arange(2 * 4, dtype=torch.float).view(2, 4, 1).expand(2, 4, 3)  # [D, 1 + L, vocab]
    # root: (0, 0); 5: (0, 1); 6: (0, 2); 7: (0, 3); 8: (1, 2) → values row * 4 + col
    assert trie_logits(logits, trie)[:, 0].tolist() == [0, 1, 2, 3, 6]
    # Greedy on the trie: the root predicts 5, node 5 predicts 8, node 8 predicts 3.
    argmax = [5, 8, 0, 0, 3]
    res = verify_greedy(argmax, trie.tree)
    assert res.accepted == (0, 3) and res.bonus == 3
    assert chosen_row(trie, res) == (1, 3)  # row 1's root, 5, 8
    assert chosen_row(trie, verify_greedy([9, 0, 0, 0, 0], trie.tree)) == (0, 1)


def test_greedy_trie_verdict_is_the_longest_accepted_row_first_on_ties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = tuple(
            tuple(int(t) for t in rng.integers(0, 3, size=rng.integers(1, 4)))
            for _ in range(rng.integers(1, 5))
        )
        batch = DraftBatch(rows)
        argmax_of = {}  # a deterministic "target": argmax as a function of the path
        paths = {row[:i] for row in rows for i in range(len(row) + 1)}
        for path in sorted(paths):
            argmax_of[path] = int(rng.integers(0, 3))
        # Row by row: the longest accepted prefix, the first row among equals.
        per_row = []
        for row in rows:
            k = 0
            while k < len(row) and row[k] == argmax_of[row[:k]]:
                k += 1
            per_row.append(k)
        best = max(range(len(rows)), key=lambda r: (per_row[r], -r))
        trie = batch.trie()
        paths_of = [tuple(trie.tree.tokens[v] for v in trie.tree.path_to(n)) for n in range(len(trie.tree))]
        argmax = [argmax_of[()]] + [argmax_of[p] for p in paths_of]
        res = verify_greedy(argmax, trie.tree)
        row, count = chosen_row(trie, res)
        assert (row, count) == (best, 1 + per_row[best])
        assert res.bonus == argmax_of[rows[best][: per_row[best]]]


P = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])


def test_trie_rejection_sampling_preserves_the_target() -> None:
    """Rows sharing prefixes, each row its own (identical) logits: the first token follows p."""
    batch = DraftBatch(((1, 2), (1, 3), (3,), (0, 1)))
    trie = batch.trie()
    probs = P.expand(batch.num_rows, 1 + batch.max_length, -1)  # [D, 1 + L, vocab]
    rows = trie_logits(probs, trie)
    n = 20000
    counts = np.zeros(len(P))
    for trial in range(n):
        res = verify_sampling(lambda row: rows[row], trie.tree, SamplingNoise(trial, len(P)), 0)
        counts[trie.tree.tokens[res.accepted[0]] if res.accepted else res.bonus] += 1
    assert stats.chisquare(counts, P.numpy() * n).pvalue > 1e-3


# -- the target: batched forward and commit --------------------------------------------------------


@pytest.mark.parametrize(
    "kind,backend", [("llama", "fast"), ("qwen2", "fast"), ("llama", "hf"), ("gpt2", "hf")]
)
def test_batched_forward_rows_equal_their_own_chains(kind: str, backend: str) -> None:
    model = tiny_model(kind)
    target = wrap_model(model, None, ModelConfig(backend=backend))
    batch = DraftBatch(ROWS)
    needs = ArtifactNeeds(hidden_layers=frozenset({1}))
    with torch.inference_mode():
        state = prefilled(target)
        out = target.forward_batch(state, batch_inputs(batch), [len(r) for r in ROWS], needs)
        assert state.length == len(PREFIX)  # nothing committed
        assert out.logits.shape == (len(ROWS), 1 + batch.max_length, 96)
        for r, row in enumerate(ROWS):
            ref = reference_logits(model, [*PREFIX, ROOT, *row])[len(PREFIX) :]  # [1 + len(row), vocab]
            assert torch.allclose(out.logits[r, : 1 + len(row)], ref, atol=1e-5), (r, row)
            hidden = model(torch.tensor([[*PREFIX, ROOT, *row]]), output_hidden_states=True).hidden_states[1]
            assert torch.allclose(out.hidden[1][r, : 1 + len(row)], hidden[0, len(PREFIX) :], atol=1e-5)


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("row,accepted", [(4, 2), (0, 4), (2, 0), (1, 1)])
def test_commit_of_a_row_equals_running_its_accepted_tokens_as_a_chain(
    backend: str, row: int, accepted: int
) -> None:
    model = tiny_model("llama")
    target = wrap_model(model, None, ModelConfig(backend=backend))
    batch = DraftBatch(ROWS)
    kept = [ROOT, *ROWS[row][:accepted]]
    with torch.inference_mode():
        state = prefilled(target)
        target.forward_batch(state, batch_inputs(batch), [len(r) for r in ROWS], NONE)
        target.commit_batch(state, row, 1 + accepted)
        assert state.length == len(PREFIX) + 1 + accepted
        chain = prefilled(target)
        target.forward(chain, torch.tensor(kept), None, NONE)
        target.commit(chain, range(len(kept)))
        if isinstance(target, FastLlamaTarget):
            for layer in range(target.info.num_layers):
                assert torch.allclose(target.keys(state, layer), target.keys(chain, layer), atol=1e-5)
        # The next step (here itself a batch) sees exactly the chain's context.
        nxt = target.forward_batch(state, torch.tensor([[50, 51], [50, 52]]), [1, 1], NONE)
        chained = target.forward(chain, torch.tensor([50, 51]), None, NONE)
    ref = reference_logits(model, [*PREFIX, *kept, 50, 51])
    assert torch.allclose(nxt.logits[0], ref[-2:], atol=1e-5)
    assert torch.allclose(chained.logits, ref[-2:], atol=1e-5)
    assert torch.allclose(nxt.logits[1, 1], reference_logits(model, [*PREFIX, *kept, 50, 52])[-1], atol=1e-5)


# -- sizing -------------------------------------------------------------------------------------


def _planner(curve: CostCurve, p: float) -> DraftPlanner:
    return DraftPlanner(curve, PlannerConfig(max_draft_tokens=64, prior_accept=p, prior_weight=1e6))


def test_batch_plan_prices_every_row_in_full_and_respects_the_budget() -> None:
    rows = tuple(tuple(range(10 * r, 10 * r + 8)) for r in range(6))  # 6 disjoint rows of 8
    batch = DraftBatch(rows, features=tuple(("f",) * 8 for _ in rows))
    # Flat cost: keep as much as fits D·(1 + L) ≤ 1 + budget.
    for budget in (64, 20, 5, 1):
        chosen = _planner(FLAT_CURVE, 0.9).plan_batch(batch, 100, max_nodes=budget).batch
        assert 0 < chosen.num_rows * (1 + chosen.max_length) <= 1 + budget
        assert len(chosen) <= budget
        assert all(row == rows[i][: len(row)] for i, row in enumerate(chosen.rows))  # prefixes, in order
    # A steep cost: a batch of D rows costs t(D·(1 + L)); fewer, shorter rows than a flat curve.
    steep = _planner(CostCurve.linear(0.04, 0.04 * 0.06), 0.8).plan_batch(batch, 100)
    flat = _planner(FLAT_CURVE, 0.8).plan_batch(batch, 100)
    assert (
        0
        < steep.batch.num_rows * (1 + steep.batch.max_length)
        < flat.batch.num_rows * (1 + flat.batch.max_length)
    )
    # Hopeless drafts are not verified.
    assert len(_planner(CostCurve.linear(0.04, 0.04), 0.05).plan_batch(batch, 100).batch) == 0


def test_batch_plan_keeps_rows_whose_leaves_survive() -> None:
    # Every node is accepted with P = 0.9 given its parent: reach 5: .9, 6: .81, 7: .73, 8: .81, 9: .9.
    # Nodes join likeliest first (5, 9, 6, 8, 7); a row is its first containing row cut at a kept
    # leaf, in the drafter's order.
    batch = DraftBatch(((5, 6, 7), (5, 8), (9,)), features=(("a", "a", "a"), ("a", "b"), ("c",)))
    planner = _planner(FLAT_CURVE, 0.9)
    plan = planner.plan_batch(batch, 100, max_nodes=64)
    assert plan.batch.rows == ((5, 6, 7), (5, 8), (9,))
    assert plan.expected_tokens == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.81 + 0.9)
    # 2 positions at most: the root and one token, in a single row: the likeliest node, 5.
    assert planner.plan_batch(batch, 100, max_nodes=1).batch.rows == ((5,),)
    # 4 positions: {5, 9} as two rows of one token; adding 6 would need 2 rows of 2 (6 > 4).
    assert planner.plan_batch(batch, 100, max_nodes=3).batch.rows == ((5,), (9,))
    # Only one more token can be output: rows cut to depth 1, duplicates merged.
    assert planner.plan_batch(batch, 100, max_depth=1).batch.rows == ((5,), (9,))
    assert len(planner.plan_batch(batch, 100, max_depth=0).batch) == 0


# -- the engine: rest-batch ---------------------------------------------------------------------


class SpyBatchVerification(steps.BatchVerification):
    """Records, per batch step, the rows verified and the row committed."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []  # (rows, draft tokens, chosen row)

    def step(
        self, target: TargetModel, state: SequenceState, root: int, draft: DraftBatch, *rest: Any
    ) -> steps.StepResult:
        result = super().step(target, state, root, draft, *rest)
        if len(draft):
            row, _ = chosen_row(draft.trie(), result.result)
            self.steps.append((draft.num_rows, len(draft), row))
        return result


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> SpyBatchVerification:
    spy = SpyBatchVerification()
    monkeypatch.setitem(steps.VERIFICATIONS, DraftBatch, spy)
    return spy


def test_rest_batch_drafts_and_accepts_in_distribution(spy: SpyBatchVerification, tmp_path: Path) -> None:
    """On a datastore of the model's own greedy answers τ is high on both backends; every row's
    tokens count as drafted. Where extra rows cost nothing (a flat curve) steps verify several
    rows and accept paths from rows other than the first, still token-identical to ``ar``."""
    model = tiny_model("llama")
    retriever = None
    for backend in ("fast", "hf"):
        target = wrap_model(model, None, ModelConfig(backend=backend))
        retriever = retriever or datastore_for(target, tmp_path / "v3")
        engine = datastore_engine(target, retriever, CPU_LIKE_CURVE)
        for prompt in prompts(target.info.vocab_size)[:2]:
            spy.steps.clear()
            res = engine.generate(GenerationRequest(tuple(prompt), 48, "rest-batch"))
            assert res.token_ids == greedy_tokens(engine, prompt, "ar", 48)
            assert res.datastore_version == "v3"
            assert res.stats.drafted_tokens == sum(tokens for _, tokens, _ in spy.steps)
            assert res.stats.accepted_tokens > 0 and res.stats.tau > 3.0, (backend, res.stats)
    engine = datastore_engine(target, retriever, FLAT_CURVE)
    spy.steps.clear()
    tally = DraftTally()
    for prompt in prompts(target.info.vocab_size)[::5]:
        res = engine.generate(GenerationRequest(tuple(prompt[:10]), 48, "rest-batch"))
        assert res.token_ids == greedy_tokens(engine, prompt[:10], "ar", 48)
        tally.observe("rest-batch", res.stats)
    tally.assert_every_mode_drafted_and_accepted("flat curve")
    assert sum(rows > 1 for rows, _, _ in spy.steps) > 10 and sum(row > 0 for _, _, row in spy.steps) > 5


def test_the_engine_dispatches_on_the_draft_type() -> None:
    assert isinstance(steps.verification_for(DraftTree.empty()), steps.TreeVerification)
    assert isinstance(steps.verification_for(DraftBatch.empty()), steps.BatchVerification)
    with pytest.raises(TypeError, match="no verification"):
        steps.verification_for((1, 2))  # type: ignore[arg-type]


def test_sampling_rest_batch_matches_exact_distribution(spy: SpyBatchVerification, tmp_path: Path) -> None:
    """χ² against enumeration, 4 new tokens (so that a step can accept 2), on a datastore of the
    model's own samples: many rows, shared prefixes, accepted paths from rows other than the first."""
    new = 4
    params = SamplingParams(temperature=1.0, top_k=4)
    model, engine, prompt = own_samples_engine(tmp_path, params)
    dist = exact_distribution(model, prompt, params, new)
    counts, _, accepted = sample_counts(engine, prompt, "rest-batch", params, new)
    p = chi_square_p(counts, dist, SAMPLES)
    multi = sum(1 for rows, _, _ in spy.steps if rows > 1)
    shared = sum(1 for rows, tokens, _ in spy.steps if rows > 1 and tokens > rows)
    other_rows = sum(1 for _, _, row in spy.steps if row > 0)
    summary = f"steps {len(spy.steps)}, multi-row {multi}, deep {shared}, accepted {accepted}"
    summary += f", other rows {other_rows}"
    assert p > 1e-3, f"rest-batch: sampled continuations do not follow the target distribution (p = {p:.2g})"
    assert multi > SAMPLES // 2 and shared > SAMPLES // 10, summary
    assert accepted > SAMPLES // 2 and other_rows > SAMPLES // 10, summary
