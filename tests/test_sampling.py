"""Top-p's nucleus (``llm_worker.sampling``) against its definition: every token sorted likeliest
first, ties by id, kept while the mass before it is below ``top_p``."""

from __future__ import annotations

import pytest
import torch

from llm_worker import sampling
from llm_worker.config import SamplingParams
from llm_worker.sampling import SamplingNoise, nucleus, warp_logits


def nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    ids = sorted(range(probs.numel()), key=lambda i: (-float(probs[i]), i))
    kept, before = [], 0.0
    for i in ids:
        if before >= top_p:
            break
        kept.append(i)
        before += float(probs[i])  # float64, in the sorted order
    return set(kept)


def rows(scale: float, count: int = 12, vocab: int = 3000) -> list[torch.Tensor]:
    """Softmax rows of bfloat16-rounded logits (ties), some with a clear favourite."""
    gen = torch.Generator().manual_seed(int(scale * 100))
    out = []
    for r in range(count):
        logits = (torch.randn(vocab, generator=gen) * scale).bfloat16().float()
        logits[r % 5] += 3 * scale * (r % 2)
        out.append(torch.softmax(logits, dim=-1))
    return out


@pytest.mark.parametrize("span", [sampling._NUCLEUS_SPAN, 0.5, 1.0])
@pytest.mark.parametrize("scale", [0.2, 2.0, 8.0])
def test_the_nucleus_is_the_definitions_whichever_set_is_searched_first(
    scale: float, span: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default search, and spans that make the first set fall short (the whole row then)."""
    monkeypatch.setattr(sampling, "_NUCLEUS_SPAN", span)
    for probs in rows(scale):
        for top_p in (1e-6, 0.3, 0.9, 0.95, 0.999):
            assert set(nucleus(probs, top_p).tolist()) == nucleus_by_full_sort(probs, top_p), (top_p, span)


def test_warp_keeps_the_nucleus_renormalised_row_by_row() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0, 0], [0, 0, 0.375, 0.625]]))
    alone = warp_logits(logits[1:], SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.equal(probs[1:], alone)  # a row's distribution does not depend on the others


def test_noise_is_copied_to_another_device_once_per_position() -> None:
    """On a GPU the verifier and a sampling drafter read a position's noise beside their
    probabilities: it is copied there once, not at every ``choose`` (the meta device stands in)."""
    noise = SamplingNoise(7, 50)
    meta = torch.device("meta")
    first = noise.exponentials_on(3, meta)
    assert first.device == meta and first.shape == (50,) and first.dtype == torch.float64
    assert noise.exponentials_on(3, meta) is first
    assert noise.exponentials_on(3, torch.device("cpu")) is noise.exponentials(3)
    for position in range(4, 4 + SamplingNoise.KEEP):  # only the last few positions are kept
        noise.exponentials_on(position, meta)
    assert noise.exponentials_on(3, meta) is not first
