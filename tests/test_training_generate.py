"""The training data's answers written through the target's own batched forward."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from helpers.models import engine_for, greedy_tokens, prompts, tiny_model, tiny_target
from llm_worker.training.data import Completer
from llm_worker.training.generate import TargetCompleter, sample_top_p


def test_greedy_completions_are_ar_whatever_the_batch() -> None:
    target = tiny_target(backend="fast")
    engine = engine_for(target)
    batch = [*prompts(target.info.vocab_size), [5, 9, 11]]
    eos = list(target.info.eos_token_ids)
    alone = TargetCompleter(target, eos, batch_size=1).complete(batch, 24, 0.0, seed=1)
    together = TargetCompleter(target, eos, batch_size=4, prefill_chunk=7).complete(batch, 24, 0.0, seed=1)
    assert together == alone
    assert any(ended for _, ended in alone) and not all(ended for _, ended in alone)
    for prompt, (ids, ended) in zip(batch, alone, strict=True):
        reference = greedy_tokens(engine, prompt, "ar", 24)
        if ended:  # cut at the end token, which the completion leaves out
            assert reference == [*ids, *eos]
        else:
            assert ids == reference and len(ids) == 24


def test_sampled_completions_depend_on_the_seed_only() -> None:
    target = tiny_target(backend="fast")
    batch = prompts(target.info.vocab_size)
    one = TargetCompleter(target, [], batch_size=1).complete(batch, 16, 0.8, seed=5)
    many = TargetCompleter(target, [], batch_size=6).complete(batch, 16, 0.8, seed=5)
    other = TargetCompleter(target, [], batch_size=6).complete(batch, 16, 0.8, seed=6)
    assert one == many
    assert one != other
    assert all(len(ids) == 16 and not ended for ids, ended in one)
    # with a seed of its own, a prefix samples the same wherever it stands and whatever is beside it
    seeds = [101 + i for i in range(len(batch))]
    own = TargetCompleter(target, [], batch_size=6).complete(batch, 16, 0.8, seed=5, seeds=seeds)
    alone = TargetCompleter(target, [], batch_size=6).complete(batch[2:3], 16, 0.8, seed=9, seeds=seeds[2:3])
    assert alone[0] == own[2] and own != one


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    drawn = {sample_top_p(logits, 1.0, 0.75, rng) for _ in range(400)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.75: tokens 2 and 3 are cut
    drawn = {sample_top_p(logits, 1.0, 0.85, rng) for _ in range(400)}
    assert drawn == {0, 1, 2}


def _nucleus_by_full_sort(
    logits: torch.Tensor, temperature: float, top_p: float, rng: np.random.Generator
) -> int:
    """The definition: every token sorted likeliest first (ties by id), the shortest head that
    reaches ``top_p``, one draw from it."""
    scaled = logits.double().numpy() / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    ids = np.arange(probs.size)
    order = ids[np.lexsort((ids, -probs))]
    ordered = probs[order]
    kept = min(int(np.searchsorted(np.cumsum(ordered), top_p)) + 1, order.size)
    ordered = ordered[:kept] / ordered[:kept].sum()
    return int(order[rng.choice(kept, p=ordered)])


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0, 20.0])
def test_top_p_draws_what_a_sort_of_the_whole_vocabulary_draws(scale: float) -> None:
    """Whichever candidate set serves (the tokens near the likeliest, the 1 024 likeliest, all),
    the draw is the definition's, token for token for the same generator state; bfloat16-rounded
    logits bring ties."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    for row in range(40):
        logits = (torch.randn(4096, generator=gen) * scale).bfloat16().float()
        logits[row % 7] += 2 * scale  # a clear favourite in some rows
        for top_p in (0.5, 0.9, 0.95):
            got = sample_top_p(logits, 0.8, top_p, np.random.default_rng([row, 1]))
            want = _nucleus_by_full_sort(logits, 0.8, top_p, np.random.default_rng([row, 1]))
            assert got == want, (scale, row, top_p)


class _Tok:
    pad_token_id = 0


def _hf_greedy(model: Any, prefix: list[int], n: int, eos: int) -> tuple[list[int], bool]:
    out = model.generate(
        input_ids=torch.tensor([prefix]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0
    )[0, len(prefix) :].tolist()
    if eos in out:
        return out[: out.index(eos)], True
    return out, False


def test_the_transformers_loop_writes_what_generate_writes_row_by_row() -> None:
    """Greedy: each row of a batch (left-padded, sorted by length, finished rows dropped from
    the cache on the way) is what ``generate`` writes for that prefix alone."""
    model = tiny_model("llama", vocab=96, seed=3).eval()
    eos = 95
    rng = np.random.default_rng(0)
    batch = [rng.integers(1, 95, size=int(n)).tolist() for n in rng.integers(2, 30, size=12)]
    loop = Completer(model, _Tok(), [eos], batch_size=5).complete(batch, 40, 0.0, seed=0)  # type: ignore[arg-type]
    with torch.inference_mode():
        alone = [_hf_greedy(model, p, 40, eos) for p in batch]
    assert loop == alone
    assert any(ended for _, ended in alone), "the model should end some rows early"


def test_the_transformers_loop_samples_from_the_nucleus_and_by_its_seed() -> None:
    model = tiny_model("llama", vocab=96, seed=3).eval()
    batch = [[5, 6, 7], [9, 10], [11, 12, 13, 14]] * 4
    completer = Completer(model, _Tok(), [95], batch_size=16)  # type: ignore[arg-type]
    first = completer.complete(batch, 12, 0.8, seed=4)
    assert first == completer.complete(batch, 12, 0.8, seed=4)
    assert first != completer.complete(batch, 12, 0.8, seed=5)
    completer.top_p = 1e-6  # the nucleus is the likeliest token alone: greedy
    assert completer.complete(batch, 12, 0.8, seed=4) == completer.complete(batch, 12, 0.0, seed=4)
