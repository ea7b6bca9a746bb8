"""Sampling in distribution: the exact distribution of short continuations (by enumeration over a
tiny vocabulary), seeded sampling counts, and a χ² goodness-of-fit test."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from scipy import stats

from llm_worker.config import SamplingParams
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.sampling import warp_logits

VOCAB = 8
"""The vocabulary of tiny models whose every short continuation can be enumerated (8³ of 3 tokens)."""
NEW = 3  # new tokens per sampled continuation, unless a test says otherwise
SAMPLES = 2500  # seeded generations per χ² test


def exact_distribution(
    model: Any, prompt: list[int], params: SamplingParams, new: int = NEW
) -> dict[tuple[int, ...], float]:
    """P(continuation) under temperature / top-k / top-p for every continuation of ``new`` tokens
    of a model with vocabulary ``VOCAB``."""
    prefixes = list(itertools.product(range(VOCAB), repeat=new - 1))
    batch = torch.tensor([prompt + list(p) for p in prefixes])
    with torch.inference_mode():
        logits = model(batch).logits[:, len(prompt) - 1 :]  # [prefixes, new, VOCAB]
    probs = warp_logits(logits.reshape(-1, VOCAB), params).reshape(len(prefixes), new, VOCAB)
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
        sp = replace(params, seed=seed)
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


def assert_sampling_exact(
    engine: Engine, model: Any, prompt: list[int], modes: list[str], params: SamplingParams
) -> None:
    """Each of ``modes`` samples continuations of ``prompt`` by the target's exact distribution
    (χ², p > 1e-3), drafting in more than a quarter of the samples, with drafts accepted."""
    dist = exact_distribution(model, prompt, params)
    for mode in modes:
        counts, drafted, accepted = sample_counts(engine, prompt, mode, params)
        p = chi_square_p(counts, dist, SAMPLES)
        assert p > 1e-3, f"{mode}: sampled continuations do not follow the target distribution (p = {p:.2g})"
        assert drafted > SAMPLES // 4, f"{mode} hardly drafted ({drafted})"
        assert accepted > 0, f"{mode}: no draft was ever accepted"
