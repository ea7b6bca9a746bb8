"""``llm_worker.logits.top_k``: each row's k largest entries against a stable sort of the whole
row (ties, signed zeros, infinities, NaN, vocabularies that are no multiple of the groups), and
the engine's candidates for ``recycle`` computed with it, on one thread; the fused kernels' top k
and top-1 probability (``csrc/logits.cpp``) against the same references."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.models import FLAT_CURVE, engine_for, tiny_target
from llm_worker import engine as engine_module
from llm_worker.engine import GenerationRequest
from llm_worker.logits import top_k, top_k_rows, top_probability


def brute_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The first k of each row sorted by value, descending, equal values in index order."""
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


VALUES = st.sampled_from([-np.inf, -3.0, -1.5, -0.0, 0.0, 0.5, 1.0, 2.0, 7.25, np.inf])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 40),
    groups=st.integers(1, 9),
    data=st.data(),
)
def test_top_k_matches_a_stable_sort(rows: int, vocab: int, groups: int, data: st.DataObject) -> None:
    """Few distinct values: ties everywhere, also at the k-th group maximum."""
    values = data.draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab))
    x = np.array(values, dtype=np.float32).reshape(rows, vocab)
    k = data.draw(st.integers(1, min(vocab, 9)))
    np.testing.assert_array_equal(top_k(x, k, groups), brute_top_k(x, k))


@pytest.mark.parametrize("vocab", [49_152, 50_257, 96, 385])
def test_top_k_on_vocabulary_sized_rows(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((7, vocab)) * 4).astype(np.float32)
    x[1] = np.round(x[1])  # ties among the largest
    x[2, :] = -np.inf
    x[2, 5] = 1.0
    x[3] = np.round(x[3] * 64).astype(np.float32) / 64  # float32 logits rounded from bfloat16-like values
    for k in (1, 8):
        np.testing.assert_array_equal(top_k(x, k), brute_top_k(x, k))
    rows = torch.from_numpy(x[4:])  # no ties: the same as torch's
    np.testing.assert_array_equal(top_k_rows(rows, 8), torch.topk(rows, 8).indices)


def test_top_k_example_and_bounds() -> None:
    x = np.array([[1, 9, 3, 9, 5, 0]], dtype=np.float32)
    np.testing.assert_array_equal(top_k(x, 2, groups=3), [[1, 3]])
    with pytest.raises(ValueError):
        top_k(x, 7)
    with pytest.raises(ValueError):
        top_k(x, 0)


def test_a_row_with_nan_ranks_as_torch_does() -> None:
    x = np.arange(20, dtype=np.float32).reshape(2, 10)
    x[0, 3] = np.nan
    got = top_k(x, 3, groups=4)
    np.testing.assert_array_equal(got, torch.topk(torch.from_numpy(x), 3).indices.numpy())
    assert got[0, 0] == 3


def test_recycle_candidates_never_call_torch_topk_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.topk`` over a verify forward's rows shares them between torch's OpenMP threads,
    whose spinning workers then slow the next forward: the engine's candidates come from
    ``top_k_rows`` (numpy, one thread) and are the rows' brute-force top 8."""
    engine = engine_for(tiny_target(), FLAT_CURVE)
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def record(logits: torch.Tensor, k: int) -> np.ndarray:
        top = top_k_rows(logits, k)
        seen.append((logits.numpy().copy(), top))
        return top

    def no_topk(*args: object, **kwargs: object) -> object:
        raise AssertionError("torch.topk over the verify forward's logits")

    monkeypatch.setattr(engine_module, "top_k_rows", record)
    monkeypatch.setattr(torch, "topk", no_topk)
    prompt = (5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7)
    for _ in range(2):
        res = engine.generate(GenerationRequest(prompt, 24, "recycle", tenant="t"))
    assert res.stats.drafted_tokens > 0
    assert any(len(logits) > 1 for logits, _ in seen)  # rows of drafted nodes too
    for logits, top in seen:
        np.testing.assert_array_equal(top, brute_top_k(logits, 8))


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 40), data=st.data())
def test_the_fused_kernels_top_k_matches_a_stable_sort(
    fused: ModuleType, rows: int, vocab: int, data: st.DataObject
) -> None:
    """Ties, signed zeros and infinities across the 8-lane blocks and the tail; a row with a NaN
    comes back as -1 (``top_k_rows`` ranks it as torch does)."""
    values = data.draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab))
    x = np.array(values, dtype=np.float32).reshape(rows, vocab)
    k = data.draw(st.integers(1, min(vocab, 9)))
    np.testing.assert_array_equal(fused.top_k_rows(torch.from_numpy(x), k).numpy(), brute_top_k(x, k))
    x[-1, data.draw(st.integers(0, vocab - 1))] = np.nan
    got = fused.top_k_rows(torch.from_numpy(x), k).numpy()
    assert (got[-1] == -1).all()
    np.testing.assert_array_equal(got[:-1], brute_top_k(x[:-1], k))
    with_nan = top_k_rows(torch.from_numpy(x), k)  # through llm_worker.logits, the kernels loaded
    np.testing.assert_array_equal(with_nan[-1], torch.topk(torch.from_numpy(x[-1:]), k).indices.numpy()[0])


@pytest.mark.parametrize("vocab", [49_152, 50_257, 13])
def test_the_fused_kernels_top_k_and_top_probability_on_vocabulary_sized_rows(
    fused: ModuleType, vocab: int
) -> None:
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((5, vocab)) * 4).astype(np.float32)
    x[1] = np.round(x[1])  # ties among the largest
    x[2, :] = -np.inf
    x[2, 5] = 1.0
    for k in (1, 8):
        np.testing.assert_array_equal(fused.top_k_rows(torch.from_numpy(x), k).numpy(), brute_top_k(x, k))
    for row in x:
        exact = 1.0 / np.exp((row - row.max()).astype(np.float64)).sum()
        assert fused.top_probability(torch.from_numpy(row)) == pytest.approx(exact, rel=1e-6)
        assert top_probability(torch.from_numpy(row)) == pytest.approx(exact, rel=1e-6)
    assert math.isnan(fused.top_probability(torch.full((vocab,), -np.inf)))
    nan_row = torch.from_numpy(x[0].copy())
    nan_row[vocab // 2] = float("nan")
    assert math.isnan(fused.top_probability(nan_row))
