"""Every mode against ``ar`` on tiny random models: greedy token equality, sampling in distribution.

Two extra drafters registered here exercise what the built-in chain drafters do not: a tree of
several candidates (``test-tree``) and drafts sampled from a distribution q (``test-q``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_greedy_identical, engine_for, greedy_tokens, tiny_model, tiny_target
from scipy import stats

from llm_worker.config import ModelConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftContext, Drafter
from llm_worker.drafters.heads import HeadScore, HeadsFile, save_heads
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.planner import CostCurve
from llm_worker.sampling import warp_logits
from llm_worker.types import DraftTree

FLAT_CURVE = CostCurve.linear(0.05, 0.0)  # GPU-like: the planner verifies every node it gets


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
    """A chain sampled from a fixed distribution q (stands in for a learned drafter)."""

    def __init__(self, vocab: int) -> None:
        self.q = torch.softmax(torch.linspace(1.5, -1.5, vocab), dim=0)  # [vocab]
        self.gen = torch.Generator().manual_seed(1)

    def propose(self, ctx: DraftContext) -> DraftTree:
        k = min(3, ctx.budget)
        tokens = torch.multinomial(self.q, k, replacement=True, generator=self.gen).tolist()
        return DraftTree.chain(tokens, draft_probs=self.q.expand(k, -1).clone())


def _register_test_modes() -> None:
    if "test-tree" not in DRAFTERS.names():
        DRAFTERS.register("test-tree", "test only")(
            lambda target, opts, res: TreeOfContinuations(target.info.vocab_size)
        )
        DRAFTERS.register("test-q", "test only")(
            lambda target, opts, res: SampledDrafts(target.info.vocab_size)
        )


_register_test_modes()


@pytest.fixture(scope="module")
def heads_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("heads") / "tiny.json"
    heads = (HeadScore(1, 0, 0.9), HeadScore(1, 3, 0.5), HeadScore(0, 2, 0.1))
    return save_heads(HeadsFile("tiny", "x", heads, 10, 1), path)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(6):
        body = rng.integers(1, vocab - 1, size=20).tolist()
        out.append(body + body[:12] if i % 2 == 0 else body)  # repeats (copyable) / random (drafts wrong)
    return out


@pytest.mark.parametrize(
    "kind,backend", [("llama", "fast"), ("llama", "hf"), ("qwen2", "fast"), ("gpt2", "hf")]
)
@pytest.mark.parametrize("curve", [FLAT_CURVE, CostCurve.linear(0.05, 0.003)], ids=["flat", "cpu"])
def test_greedy_every_mode_equals_ar(kind: str, backend: str, curve: CostCurve, heads_file: Path) -> None:
    target = tiny_target(kind, backend=backend)
    engine = engine_for(target, curve)
    modes = ["pld", "pld:max_n=1", "pld+h:layer=1", "pld+h:layer=2:theta=0.2", "test-tree"]
    if target.supports_queries:
        modes.append(f"pld+a:file={heads_file}")
    for i, prompt in enumerate(prompts(target.info.vocab_size)):
        ref = greedy_tokens(engine, prompt, "ar", 64)
        for mode in modes:
            got = greedy_tokens(engine, prompt, mode, 64)
            assert_greedy_identical(target, prompt, ref, got, f"{kind}/{backend}/{mode}/prompt{i}")


def test_spec_modes_actually_draft_and_accept(heads_file: Path) -> None:
    target = tiny_target("llama")
    engine = engine_for(target, FLAT_CURVE)
    prompt = prompts(target.info.vocab_size)[0]
    for mode in ["pld", "pld+h:layer=1", f"pld+a:file={heads_file}", "test-tree"]:
        res = engine.generate(GenerationRequest(tuple(prompt), 64, mode))
        assert res.stats.drafted_tokens > 0, mode
        assert res.stats.accepted_tokens > 0, mode
        assert res.stats.tau > 1.0, mode


# -- sampling: the exact distribution of short continuations, by enumeration --------------------

VOCAB, NEW, SAMPLES = 8, 3, 2500


def exact_distribution(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) under temperature / top-k / top-p for every continuation of NEW tokens."""
    prefixes = list(itertools.product(range(VOCAB), repeat=NEW - 1))
    batch = torch.tensor([prompt + list(p) for p in prefixes])
    with torch.inference_mode():
        logits = model(batch).logits[:, len(prompt) - 1 :]  # [B, NEW, vocab]
    probs = warp_logits(logits.reshape(-1, VOCAB), params).reshape(len(prefixes), NEW, VOCAB)
    dist = {}
    for b, prefix in enumerate(prefixes):
        for last in range(VOCAB):
            seq = (*prefix, last)
            p = 1.0
            for i, tok in enumerate(seq):
                p *= float(probs[b, i, tok])
            dist[seq] = p
    return dist


def sample_counts(
    engine: Engine, prompt: list[int], mode: str, params: SamplingParams, new: int = NEW
) -> tuple[dict[tuple[int, ...], int], int, int]:
    """SAMPLES generations seeded 0 .. SAMPLES-1: how often each continuation came, and the drafted
    and accepted token totals (so that a test can show that drafts were really verified)."""
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for seed in range(SAMPLES):
        sp = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        res = engine.generate(GenerationRequest(tuple(prompt), new, mode, sp, stop_at_eos=False))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        drafted += res.stats.drafted_tokens
        accepted += res.stats.accepted_tokens
    return counts, drafted, accepted


def chi_square_p(counts: dict[tuple[int, ...], int], dist: dict[tuple[int, ...], float], n: int) -> float:
    """Goodness of fit, pooling the rarest outcomes so that every bin expects at least 5."""
    items = sorted(dist, key=lambda s: dist[s])
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for seq in items:
        pool_o += counts.get(seq, 0)
        pool_e += dist[seq] * n
        if pool_e >= 5:
            observed.append(pool_o)
            expected.append(pool_e)
            pool_o = pool_e = 0.0
    if pool_e:
        observed[-1] += pool_o
        expected[-1] += pool_e
    expected_arr = np.array(expected) * n / sum(expected)
    return float(stats.chisquare(observed, expected_arr).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.3), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)],
    ids=["t1.3", "t0.8-k5-p0.9"],
)
def test_sampling_every_mode_matches_exact_distribution(params: SamplingParams, tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    heads = save_heads(HeadsFile("t", "x", (HeadScore(1, 0, 1.0),), 1, 1), tmp_path / "h.json")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    dist = exact_distribution(model, prompt, params)
    engine = engine_for(target, FLAT_CURVE)
    for mode in ["ar", "pld", "pld+h:layer=1", f"pld+a:file={heads}", "test-tree", "test-q"]:
        counts, drafted, _ = sample_counts(engine, prompt, mode, params)
        p = chi_square_p(counts, dist, SAMPLES)
        assert p > 1e-3, f"{mode}: sampled continuations do not follow the target distribution (p = {p:.2g})"
        if mode != "ar":
            assert drafted > SAMPLES // 4, f"{mode} hardly drafted ({drafted}); the test would prove nothing"


def test_seeded_sampling_is_reproducible() -> None:
    target = tiny_target("llama")
    engine = engine_for(target, FLAT_CURVE)
    req = GenerationRequest((1, 2, 3, 4, 1, 2), 32, "pld", SamplingParams(temperature=1.0, seed=11))
    assert engine.generate(req).token_ids == engine.generate(req).token_ids
