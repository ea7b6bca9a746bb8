"""Induction-head calibration and ``pld+a`` against a model whose induction head is known.

``induction_model`` is a hand-built 2-layer Llama (see ``tests/helpers/induction_model.py``)
whose only induction head is layer 1, head 1. Calibration must find exactly that head, and
``pld+a`` reading it must copy losslessly with a high τ. ``copy_source`` and ``rank_heads`` are
also tested directly on small hand examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch

from helpers.induction_model import induction_model
from helpers.models import FLAT_CURVE, engine_for, greedy_tokens
from llm_worker.calibrate import calibrate_heads
from llm_worker.config import ModelConfig
from llm_worker.drafters.heads import HeadScore, copy_source, load_heads, rank_heads, save_heads
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.target import TargetModel

VOCAB = 16


def induction_target(backend: Literal["fast", "hf"] = "fast") -> TargetModel:
    return wrap_model(induction_model(VOCAB), None, ModelConfig(backend=backend))


def cycle(seed: int, length: int) -> list[int]:
    """``length`` distinct random tokens: one period of a copy prompt."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:length].tolist()


def copy_prompt(seq: list[int], extra: int) -> list[int]:
    """``seq`` once, then its first ``extra`` tokens: A B C D E ... A B."""
    return seq + seq[:extra]


def periodic(seq: list[int], start: int, count: int) -> list[int]:
    """``count`` tokens of ``seq`` repeated forever, from index ``start``: the copying continuation."""
    return [seq[(start + i) % len(seq)] for i in range(count)]


# -- the model copies ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize(("seed", "length", "extra"), [(0, 10, 3), (1, 7, 1), (2, 16, 5)])
def test_induction_model_copies_greedily(
    backend: Literal["fast", "hf"], seed: int, length: int, extra: int
) -> None:
    seq = cycle(seed, length)
    engine = engine_for(induction_target(backend))
    out = greedy_tokens(engine, copy_prompt(seq, extra), "ar", 24)
    assert out == periodic(seq, extra, 24)


# -- calibration finds the head --------------------------------------------------------------


def calibration_prompts() -> list[list[int]]:
    return [copy_prompt(cycle(seed, length), 2) for seed, length in [(10, 8), (11, 9), (12, 11), (13, 12)]]


def test_calibration_ranks_the_induction_head_first() -> None:
    heads = calibrate_heads(induction_target(), calibration_prompts(), max_new_tokens=24)
    assert heads.events > 0
    assert heads.prompts == 4
    assert len(heads.heads) == 4  # 2 layers x 2 heads
    best, *rest = heads.heads
    assert (best.layer, best.head) == (1, 1)
    assert best.score > 0.8
    assert all(other.score < best.score - 0.5 for other in rest), heads.heads


# -- copy_source -----------------------------------------------------------------------------


def test_copy_source_docstring_example() -> None:
    assert copy_source(np.array([7, 1, 2, 9, 1, 2]), 5) == 2


def test_copy_source_no_candidate_is_none() -> None:
    assert copy_source(np.array([1, 2, 3]), 2) is None
    assert copy_source(np.array([4]), 0) is None


def test_copy_source_longest_match_beats_recency() -> None:
    # t = 9 is a 1 preceded by 2, 5. s = 2 is preceded by 2, 5 (length 2), s = 5 by 2, 7 (length 1).
    tokens = np.array([5, 2, 1, 7, 2, 1, 9, 5, 2, 1])
    assert copy_source(tokens, 9) == 2


def test_copy_source_tie_goes_to_most_recent() -> None:
    # s = 1 and s = 4 are both preceded by 2 and then differ (or run out): length 1 each.
    tokens = np.array([2, 1, 9, 2, 1, 8, 2, 1])
    assert copy_source(tokens, 7) == 4


def test_copy_source_min_match() -> None:
    tokens = np.array([2, 1, 9, 2, 1, 8, 2, 1])
    assert copy_source(tokens, 7, min_match=2) is None  # both candidates match only 1 token
    # Candidates 1 and 3 (token 1) match nothing before them (3 vs 2): no source by default,
    # but with min_match 0 any occurrence qualifies, and the tie goes to the most recent.
    tokens = np.array([3, 1, 3, 1, 2, 1])
    assert copy_source(tokens, 5) is None
    assert copy_source(tokens, 5, min_match=0) == 3


def test_copy_source_only_looks_before_t() -> None:
    tokens = np.array([6, 4, 6, 4, 6, 4])
    assert copy_source(tokens, 3) == 1  # ignores positions 3 .. 5
    assert copy_source(tokens, 1) is None


# -- rank_heads ------------------------------------------------------------------------------


def test_rank_heads_orders_by_hits_ties_in_layer_head_order() -> None:
    hits = np.array([[3, 0], [5, 5]])  # [layers, heads]
    assert rank_heads(hits, 5) == [
        HeadScore(1, 0, 1.0),
        HeadScore(1, 1, 1.0),
        HeadScore(0, 0, 0.6),
        HeadScore(0, 1, 0.0),
    ]


def test_rank_heads_without_events_is_empty() -> None:
    assert rank_heads(np.zeros((2, 2), dtype=np.int64), 0) == []


# -- pld+a end to end ------------------------------------------------------------------------


def test_pld_a_with_the_calibrated_head_is_lossless_and_copies(tmp_path: Path) -> None:
    target = induction_target()
    path = save_heads(
        calibrate_heads(target, calibration_prompts(), max_new_tokens=24), tmp_path / "heads.json"
    )
    assert load_heads(path).top(1) == ((1, 1),)
    engine = engine_for(target, FLAT_CURVE, path)
    seq = cycle(5, 10)
    prompt = copy_prompt(seq, 2)
    reference = greedy_tokens(engine, prompt, "ar", 40)
    assert reference == periodic(seq, 2, 40)

    mode = "pld+a:heads=1"
    result = engine.generate(GenerationRequest(tuple(prompt), 40, mode))
    assert result.token_ids == reference
    assert result.stats.drafted_tokens > 0 and result.stats.accepted_tokens > 0, result.stats
    assert result.stats.tau > 2.0, result.stats
    assert result.provenance
    context = prompt + result.token_ids  # what source indices point into
    for span in result.provenance:
        assert span.length >= 1
        assert span.drafter == "pld+a"  # the registered name, without its options
        for i in range(span.length):
            out_index, source = span.output_start + i, span.source_start + i
            assert source < len(prompt) + out_index  # copied from before the token itself
            assert result.token_ids[out_index] == context[source], span
