"""Turning target logits into the distribution a request samples from, and sampling from it.

Order as in transformers' generate: temperature, then top-k, then top-p. Speculative sampling
verifies against this *warped* distribution, so it is what every mode reproduces exactly.

**Sampling is coupled to the output position.** A request's token at sequence position i is
``argmax_x p_i(x) / E_i(x)``, where ``E_i`` is a vector of standard exponential noise drawn from a
generator seeded by (the request's seed, i) alone — the exponential-race form of the Gumbel-max
trick. Given the tokens before i, ``E_i`` is fresh noise, so the token is an exact sample from
p_i; and since the noise depends on the position only, not on how many forwards or draft tokens
led there, a seeded request yields the *same tokens in every mode* as plain sampling (``ar``) with
that seed, as greedy decoding does. Verification of a draft is then exact matching against these
tokens, and a drafter that samples uses the same noise (``SamplingNoise.choose``), which makes
its guess agree with the target's whenever their distributions agree.

Example: p_i = (0.5, 0.3, 0.2) and E_i = (1.9, 0.2, 0.7) give scores (0.26, 1.5, 0.29): token 1.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

import numpy as np
import torch

from llm_worker.config import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature / top-k / top-p.

    logits: [n, vocab] (any float dtype) → [n, vocab] float32 rows summing to 1.
    """
    scores = logits.float() / max(params.temperature, 1e-6)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        for r in range(probs.shape[0]):
            keep[r, nucleus(probs[r], params.top_p)] = True
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


_NUCLEUS_SPAN = 2.0**-20
"""The tokens at least this fraction as likely as the likeliest are searched for the nucleus first."""


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The ids of top-p's nucleus of one row of probabilities [vocab]: its tokens sorted
    likeliest first, ties by id, up to and including the first at which their mass (summed in
    float64) reaches ``top_p`` — a token is kept when the mass before it is below ``top_p``, so
    the likeliest always is.

    Any *top set* (every token at least as likely as its least likely member) whose mass reaches
    ``top_p`` holds the nucleus, and sorting it gives the nucleus in the same order, so the tokens
    within ``_NUCLEUS_SPAN`` of the likeliest are sorted first (a comparison over the vocabulary,
    not a sort of it: 3.7 ms a row for 49 152 tokens), the whole row only when they fall short."""
    ids = torch.nonzero(probs >= probs.max() * _NUCLEUS_SPAN).squeeze(1)  # a top set, ids ascending
    head = _sorted_head(probs, ids, top_p)
    if head is None:
        head = _sorted_head(probs, torch.arange(probs.numel(), device=probs.device), top_p)
    assert head is not None
    return head


def _sorted_head(probs: torch.Tensor, ids: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """The nucleus among ``ids`` (ascending), or None if their mass does not reach ``top_p`` and
    they are not the whole row."""
    values = probs[ids]
    order = torch.sort(values, descending=True, stable=True).indices  # ties keep id order
    mass = values[order].double().cumsum(0)
    if float(mass[-1]) < top_p and ids.numel() < probs.numel():
        return None
    kept = min(int((mass < top_p).sum()) + 1, ids.numel())
    return ids[order[:kept]]


MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for ``position`` of a request seeded ``seed`` (SplitMix64's
    finaliser over both): nearby positions and seeds give unrelated streams."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class SamplingNoise:
    """The exponential noise of one request, per output position (see the module docstring).

    ``seed`` None draws a random one. The last few positions' noise is kept, since a position is
    usually asked for twice (by a drafter, then by the verifier).
    """

    KEEP = 8

    def __init__(self, seed: int | None, vocab: int) -> None:
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self.vocab = vocab
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._copies: OrderedDict[tuple[int, torch.device], torch.Tensor] = OrderedDict()

    def exponentials(self, position: int) -> torch.Tensor:
        """[vocab] float64 standard exponential noise of ``position``, every entry > 0."""
        noise = self._kept.get(position)
        if noise is None:
            # numpy's PCG64 and ziggurat: 0.19 ms for 49 152 draws where torch's generator took 0.9
            gen = np.random.Generator(np.random.PCG64(mix_seed(self.seed, position)))
            noise = torch.from_numpy(gen.standard_exponential(self.vocab))
            noise.clamp_(min=1e-300)
            self._kept[position] = noise
            if len(self._kept) > self.KEEP:
                self._kept.popitem(last=False)
        return noise

    def exponentials_on(self, position: int, device: torch.device) -> torch.Tensor:
        """``exponentials(position)`` on ``device``: drawn on the host, copied to another device
        once and kept there (a position is usually asked for twice, by a drafter, then by the
        verifier: on a GPU one 400 kB copy of the default model's vocabulary, not two)."""
        noise = self.exponentials(position)
        if device == noise.device:
            return noise
        key = (position, device)
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = noise.to(device)
            if len(self._copies) > self.KEEP:
                self._copies.popitem(last=False)
        return copy

    def choose(self, probs: torch.Tensor, position: int, ids: torch.Tensor | None = None) -> int:
        """The token sampled at ``position`` from probs: [vocab] (or, with ``ids`` [n] the
        vocabulary ids of probs' n entries — a drafter's reduced vocabulary —, the index into
        probs whose token wins the same race)."""
        noise = self.exponentials_on(position, probs.device)
        if ids is not None:
            noise = noise[ids]
        return int((probs.double() / noise).argmax())
