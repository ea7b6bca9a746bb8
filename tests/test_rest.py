"""``rest`` against ``ar`` on tiny random models: greedy token equality and sampling in distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datastore_svc.protocols import SparseAnswer
from datastore_svc.retrieval import Candidate, Retrieval
from datastore_svc.store import DatastoreVersion, LocalRetriever, write_version
from helpers.datastores import datastore_engine, datastore_for, own_samples_engine, tiny_identity
from helpers.models import (
    BACKEND_CASES,
    BACKEND_IDS,
    FLAT_CURVE,
    DraftTally,
    assert_greedy_identical,
    engine_for,
    greedy_tokens,
    prompts,
    tiny_model,
    tiny_target,
)
from helpers.stats import SAMPLES, VOCAB, chi_square_p, exact_distribution, sample_counts
from llm_worker.config import EngineConfig, ModelConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftResources
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.planner import CostCurve

REST_MODES = [
    "rest",
    "rest:ctx=0",
    "rest:c_max=4:l=6:nodes=12",
    "rest:n=4:d=2",
    "rest-batch",
    "rest-batch:c_max=4:l=6:d=4:ctx=0",
]


@pytest.mark.parametrize("kind,backend,curve", BACKEND_CASES, ids=BACKEND_IDS)
def test_greedy_rest_equals_ar(kind: str, backend: str, curve: CostCurve, tmp_path: Path) -> None:
    target = tiny_target(kind, backend=backend)
    engine = datastore_engine(target, datastore_for(target, tmp_path / "v"), curve)
    tally = DraftTally()
    for i, prompt in enumerate(prompts(target.info.vocab_size)):
        ref = greedy_tokens(engine, prompt, "ar", 64)
        for mode in REST_MODES:
            res = engine.generate(GenerationRequest(tuple(prompt), 64, mode))
            assert_greedy_identical(target, prompt, ref, res.token_ids, f"{kind}/{backend}/{mode}/prompt{i}")
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(f"{kind}/{backend}")


def test_rest_drafts_accepts_and_reports_its_version(tmp_path: Path) -> None:
    target = tiny_target("llama")
    engine = datastore_engine(target, datastore_for(target, tmp_path / "v7"))
    prompt = prompts(target.info.vocab_size)[1]
    res = engine.generate(GenerationRequest(tuple(prompt[:10]), 48, "rest"))
    assert res.stats.drafted_tokens > 0 and res.stats.accepted_tokens > 0 and res.stats.tau > 1.5
    assert res.datastore_version == "v7"
    assert engine.generate(GenerationRequest(tuple(prompt[:10]), 8, "pld")).datastore_version == ""


def test_rest_is_unavailable_without_a_datastore() -> None:
    target = tiny_target("llama")
    assert "rest" not in DRAFTERS.available(target)
    with pytest.raises(ValueError, match="needs a datastore"):
        engine_for(target).generate(GenerationRequest((1, 2, 3), 4, "rest"))


class FailingRetriever:
    def retrieve(self, context: np.ndarray, cfg: object, version: str = "") -> tuple[object, str]:
        raise ConnectionError("datastore down")


def test_a_failing_datastore_costs_drafts_not_the_generation() -> None:
    target = tiny_target("llama")
    engine = Engine(target, EngineConfig(), curve=FLAT_CURVE, resources=DraftResources(FailingRetriever()))
    prompt = prompts(target.info.vocab_size)[0]
    ref = greedy_tokens(engine, prompt, "ar", 32)
    # Drafting is impossible here by design: the datastore alone, down, drafts nothing.
    alone = engine.generate(GenerationRequest(tuple(prompt), 32, "rest:ctx=0"))
    assert alone.token_ids == ref and alone.stats.drafted_tokens == 0
    fused = engine.generate(GenerationRequest(tuple(prompt), 32, "rest"))  # the context still drafts
    assert fused.token_ids == ref
    assert fused.stats.drafted_tokens > 0 and fused.stats.accepted_tokens > 0, fused.stats


class OutOfRangeRetriever:
    """A datastore whose answers carry token ids the model does not have (corrupt data, a
    datastore of another tokenizer, a poisoned cache)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def retrieve(self, context: np.ndarray, cfg: object, version: str = "") -> SparseAnswer:
        bad = Candidate((int(context[-1]) % self.vocab_size, self.vocab_size + 5), (3, 3), None)
        return SparseAnswer(Retrieval((bad,), 1, 3, 3), "v-bad")


@pytest.mark.parametrize("mode", ["rest:ctx=0", "rest-batch:ctx=0"])
def test_drafted_ids_outside_the_vocabulary_are_dropped_not_run(mode: str) -> None:
    target = tiny_target("llama")
    resources = DraftResources(OutOfRangeRetriever(target.info.vocab_size))
    engine = Engine(target, EngineConfig(), curve=FLAT_CURVE, resources=resources)
    prompt = prompts(target.info.vocab_size)[0]
    ref = greedy_tokens(engine, prompt, "ar", 24)
    result = engine.generate(GenerationRequest(tuple(prompt), 24, mode))
    # Drafting is impossible here by design: every draft holds an id the model lacks.
    assert result.token_ids == ref and result.stats.drafted_tokens == 0


class MalformedRetriever:
    """A datastore answer whose prefix counts are not one per token (what a faulty shard could
    send): fusing it with the context's own candidates fails."""

    def retrieve(self, context: np.ndarray, cfg: object, version: str = "") -> SparseAnswer:
        bad = Candidate((int(context[-1]), 1, 2), (5,), None)
        return SparseAnswer(Retrieval((bad,), 1, 5, 5), "v-bad")


def test_an_answer_that_does_not_fuse_costs_its_drafts_not_the_generation() -> None:
    target = tiny_target("llama")
    engine = Engine(target, EngineConfig(), curve=FLAT_CURVE, resources=DraftResources(MalformedRetriever()))
    prompt = prompts(target.info.vocab_size)[0]
    fused = engine.generate(GenerationRequest(tuple(prompt), 32, "rest"))  # the context still drafts
    assert fused.token_ids == greedy_tokens(engine, prompt, "ar", 32)
    assert fused.stats.drafted_tokens > 0


def test_a_shards_malformed_candidates_are_dropped() -> None:
    """Candidates no well-behaved shard sends (empty, longer than asked, prefix counts not one per
    token) are left out of the merge; the rest are kept."""
    from datastore_svc.fanout import dense_from_response, sparse_from_response
    from specdraft.stubs import datastore_pb2

    resp = datastore_pb2.RetrieveResponse(
        candidates=[
            datastore_pb2.Candidate(tokens=[7, 8], prefix_counts=[3, 2]),
            datastore_pb2.Candidate(tokens=[7, 8, 9], prefix_counts=[5]),
            datastore_pb2.Candidate(tokens=[], count=4),
            datastore_pb2.Candidate(tokens=list(range(11)), count=1),
            datastore_pb2.Candidate(tokens=[6], count=2),
        ]
    )
    sparse = sparse_from_response(resp, max_length=10)
    assert [(c.tokens, c.counts) for c in sparse.candidates] == [((7, 8), (3, 2)), ((6,), (2,))]
    dense = dense_from_response(resp, max_length=10)
    assert [c.tokens for c in dense.candidates] == [(7, 8), (7, 8, 9), (6,)]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.3), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)],
    ids=["t1.3", "t0.8-k5-p0.9"],
)
def test_sampling_rest_matches_exact_distribution(params: SamplingParams, tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, VOCAB, size=60).astype(np.int32) for _ in range(20)]
    write_version(docs, tmp_path / "v", VOCAB, tiny_identity(VOCAB, "t"))
    engine = datastore_engine(target, LocalRetriever(DatastoreVersion(tmp_path / "v")))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    dist = exact_distribution(model, prompt, params)
    counts, drafted, accepted = sample_counts(engine, prompt, "rest", params)
    p = chi_square_p(counts, dist, SAMPLES)
    assert p > 1e-3, f"rest: sampled continuations do not follow the target distribution (p = {p:.2g})"
    assert drafted > SAMPLES // 4, f"rest hardly drafted ({drafted}); the test would prove nothing"
    assert accepted > 0, "rest: no draft was ever accepted; the test would prove nothing"


def test_sampling_rest_trees_with_siblings_match_exact_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 new tokens, so that a step verifies two nodes — often siblings (recursive rejection over
    siblings, not only chains), on a datastore of the model's own samples."""
    from llm_worker.verify.steps import TreeVerification

    branching: list[bool] = []
    original = TreeVerification.step

    def spy(self: TreeVerification, target: Any, state: Any, root: int, draft: Any, *rest: Any) -> Any:
        if len(draft):
            branching.append(len(set(draft.parents)) < len(draft.parents))
        return original(self, target, state, root, draft, *rest)

    monkeypatch.setattr(TreeVerification, "step", spy)
    new = 4
    params = SamplingParams(temperature=1.0, top_k=4)
    model, engine, prompt = own_samples_engine(tmp_path, params)
    dist = exact_distribution(model, prompt, params, new)
    counts, _, accepted = sample_counts(engine, prompt, "rest", params, new)
    p = chi_square_p(counts, dist, SAMPLES)
    assert p > 1e-3, f"rest trees: sampled continuations do not follow the target distribution (p = {p:.2g})"
    assert sum(branching) > SAMPLES // 4, f"{sum(branching)} of {len(branching)} trees branched"
    assert accepted > 0, "rest trees: no draft was ever accepted; the test would prove nothing"


def test_affordable_nodes_halves_until_a_tree_costs_at_most_two_steps() -> None:
    from llm_worker.drafters.rest import affordable_nodes

    assert affordable_nodes(lambda n: 10.0 + n, 64) == 8  # 74, 42, 26 ms > 20; 18 ≤ 20
    assert affordable_nodes(lambda n: 10.0 + 0.01 * n, 64) == 64  # a GPU: rows are almost free
    assert affordable_nodes(lambda n: 10.0 + 100 * n, 64) == 1  # never below one node
    xeon = dict(zip((0, 1, 3, 7, 15, 31, 63), (13.2, 14.8, 17.4, 24.1, 39.3, 77.5, 125.4), strict=True))
    price = lambda n: float(np.interp(n, list(xeon), list(xeon.values())))  # noqa: E731
    assert affordable_nodes(price, 64) == 8  # the 2-core Xeon's measured curve


def test_rest_sizes_its_tree_unless_nodes_is_given(tmp_path: Path) -> None:
    """Without ``nodes``, a step retrieves what its verify prices afford (capped by ``d``);
    with it, exactly what was asked."""
    from llm_worker.drafters.base import DraftContext, RequestState
    from llm_worker.drafters.rest import RestDrafter

    target = tiny_target("llama")
    resources = DraftResources(datastore_for(target, tmp_path / "v1"))
    tokens = np.arange(1, 20, dtype=np.int64) % target.info.vocab_size
    ctx = DraftContext(tokens, 64, request_state=RequestState(), verify_seconds=lambda n: 10.0 + n)
    sized = DRAFTERS.create("rest", target, resources)
    assert isinstance(sized, RestDrafter)
    assert (sized.shape_for(ctx).max_nodes, sized.shape_for(ctx).max_candidates) == (8, 4)
    assert sized.shape_for(DraftContext(tokens, 64)) == sized.cfg  # no prices (a replay): as configured
    fixed = DRAFTERS.create("rest:nodes=64:d=3", target, resources)
    assert isinstance(fixed, RestDrafter)
    assert (fixed.shape_for(ctx).max_nodes, fixed.shape_for(ctx).max_candidates) == (64, 3)
    capped = DRAFTERS.create("rest:d=2", target, resources)
    assert isinstance(capped, RestDrafter)
    assert capped.shape_for(ctx).max_candidates == 2
