"""Every mode against ``ar`` on tiny random models: greedy token equality, sampling in distribution.

Two extra drafters exercise what the built-in chain drafters do not: a tree of several candidates
(``test-tree``) and drafts sampled from a distribution q (``test-q``). The fixture ``extra_modes``
registers them for the tests that ask for it and removes them after this module: no other module
ever sees them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.models import (
    CPU_LIKE_CURVE,
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
from llm_worker.config import ModelConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftContext, Drafter
from llm_worker.drafters.heads import HeadScore, HeadsFile, save_heads
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.planner import CostCurve
from llm_worker.types import DraftTree


class TreeOfContinuations(Drafter):
    """What followed the last three occurrences of the root token, plus one random branch."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.rng = np.random.default_rng(0)

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = ctx.tokens
        last = len(tokens) - 1
        hits = np.flatnonzero(tokens[:last] == tokens[last])[-3:]
        seqs = [tokens[j + 1 : j + 1 + min(6, ctx.budget)].tolist() for j in hits]
        srcs = [list(range(j + 1, j + 1 + len(s))) for j, s in zip(hits, seqs, strict=True)]
        seqs.append(self.rng.integers(0, self.vocab, size=min(3, ctx.budget)).tolist())
        srcs.append([-1] * len(seqs[-1]))
        return DraftTree.from_sequences(
            [s for s in seqs if s], [s for s, q in zip(srcs, seqs, strict=True) if q]
        )


class SampledDrafts(Drafter):
    """A chain sampled from a fixed distribution q with the request's noise (stands in for a
    learned drafter); greedy requests get q's argmax."""

    def __init__(self, vocab: int) -> None:
        self.q = torch.softmax(torch.linspace(1.5, -1.5, vocab), dim=0)  # [vocab]

    def propose(self, ctx: DraftContext) -> DraftTree:
        k = min(3, ctx.budget)
        if ctx.noise is None or ctx.sampling.greedy:
            return DraftTree.chain([int(self.q.argmax())] * k)
        first = len(ctx.tokens)  # the sequence position of the depth-1 token
        return DraftTree.chain([ctx.noise.choose(self.q, first + d) for d in range(k)])


@pytest.fixture(scope="module")
def extra_modes() -> Iterator[None]:
    """``test-tree`` and ``test-q`` in the global registry while this module's tests run."""
    with (
        DRAFTERS.registered(
            "test-tree", "test only", lambda target, opts, res: TreeOfContinuations(target.info.vocab_size)
        ),
        DRAFTERS.registered(
            "test-q", "test only", lambda target, opts, res: SampledDrafts(target.info.vocab_size)
        ),
    ):
        yield


@pytest.fixture(scope="module")
def heads_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("heads") / "tiny.json"
    heads = (HeadScore(1, 0, 0.9), HeadScore(1, 3, 0.5), HeadScore(0, 2, 0.1))
    return save_heads(HeadsFile("tiny", "x", heads, 10, 1), path)


@pytest.mark.parametrize(
    "kind,backend", [("llama", "fast"), ("llama", "hf"), ("qwen2", "fast"), ("gpt2", "hf")]
)
@pytest.mark.parametrize("curve", [FLAT_CURVE, CPU_LIKE_CURVE], ids=["flat", "cpu"])
def test_greedy_every_mode_equals_ar(
    kind: str, backend: str, curve: CostCurve, heads_file: Path, extra_modes: None
) -> None:
    target = tiny_target(kind, backend=backend)
    engine = engine_for(target, curve, heads_file)
    modes = [
        "pld",
        "pld:max_n=1",
        "pld+h:layer=1",
        "pld+h:layer=2:theta=0.2",
        "test-tree",
        "suffix",
        "recycle",
    ]
    if target.supports_queries:
        modes.append("pld+a")
    tally = DraftTally()
    for i, prompt in enumerate(prompts(target.info.vocab_size)):
        ref = greedy_tokens(engine, prompt, "ar", 64)
        for mode in modes:
            res = engine.generate(GenerationRequest(tuple(prompt), 64, mode))
            assert_greedy_identical(target, prompt, ref, res.token_ids, f"{kind}/{backend}/{mode}/prompt{i}")
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(f"{kind}/{backend}")


def test_spec_modes_actually_draft_and_accept(heads_file: Path, extra_modes: None) -> None:
    target = tiny_target("llama")
    engine = engine_for(target, FLAT_CURVE, heads_file)
    prompt = prompts(target.info.vocab_size)[0]
    for mode in ["pld", "pld+h:layer=1", "pld+a", "test-tree", "suffix"]:
        res = engine.generate(GenerationRequest(tuple(prompt), 64, mode))
        assert res.stats.drafted_tokens > 0, mode
        assert res.stats.accepted_tokens > 0, mode
        assert res.stats.tau > 1.0, mode


# -- sampling: the exact distribution of short continuations, by enumeration --------------------


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.3), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)],
    ids=["t1.3", "t0.8-k5-p0.9"],
)
def test_sampling_every_mode_matches_exact_distribution(
    params: SamplingParams, tmp_path: Path, extra_modes: None
) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    heads = save_heads(HeadsFile("t", "x", (HeadScore(1, 0, 1.0),), 1, 1), tmp_path / "h.json")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    dist = exact_distribution(model, prompt, params)
    engine = engine_for(target, FLAT_CURVE, heads)
    for mode in ["ar", "pld", "pld+h:layer=1", "pld+a", "test-tree", "test-q", "suffix", "recycle"]:
        counts, drafted, accepted = sample_counts(engine, prompt, mode, params)
        p = chi_square_p(counts, dist, SAMPLES)
        assert p > 1e-3, f"{mode}: sampled continuations do not follow the target distribution (p = {p:.2g})"
        if mode != "ar":
            assert drafted > SAMPLES // 4, f"{mode} hardly drafted ({drafted}); the test would prove nothing"
            assert accepted > 0, f"{mode}: no draft was ever accepted; the test would prove nothing"


def test_seeded_sampling_is_reproducible() -> None:
    target = tiny_target("llama")
    engine = engine_for(target, FLAT_CURVE)
    req = GenerationRequest((1, 2, 3, 4, 1, 2), 32, "pld", SamplingParams(temperature=1.0, seed=11))
    assert engine.generate(req).token_ids == engine.generate(req).token_ids


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_seeded_sampling_every_mode_equals_ar_with_the_seed(
    kind: str, heads_file: Path, extra_modes: None
) -> None:
    """Sampling is coupled to the position: with the same seed every mode emits ``ar``'s tokens,
    whatever it drafted (the fast backend is batch-invariant, so bit for bit)."""
    target = tiny_target(kind, backend="fast")
    engine = engine_for(target, CPU_LIKE_CURVE, heads_file)
    tally = DraftTally()
    for seed, prompt in enumerate(prompts(target.info.vocab_size)):
        params = SamplingParams(temperature=0.3, top_p=0.95, seed=seed)
        ref = engine.generate(GenerationRequest(tuple(prompt), 48, "ar", params)).token_ids
        for mode in ["pld", "pld+h:layer=1", "pld+a", "test-tree", "test-q", "suffix", "recycle"]:
            res = engine.generate(GenerationRequest(tuple(prompt), 48, mode, params))
            assert res.token_ids == ref, f"{kind}/{mode}/seed {seed}"
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(kind)
