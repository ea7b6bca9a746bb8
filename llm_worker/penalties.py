"""Presence, frequency and repetition penalties, applied per position exactly.

A penalty changes a row's logits by what came before the position the row predicts:

- ``repetition_penalty`` r (Hugging Face's and vLLM's): the logit l of every token in the prompt
  or generated so far becomes l / r where l > 0, l · r where not;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): then l − f · count − p · [count > 0],
  count = how often the request has *generated* the token (the prompt does not count).

The order and the arithmetic are vLLM's (float32). In a verify forward over a draft tree, the row
of node i predicts the position after i's path, so it sees the committed tokens plus the tokens of
i and its ancestors (``DraftTree.path``) — exactly what plain decoding sees at that position, so
every mode decides there as ``ar`` does (``llm_worker.verify.steps.decider``). A batch of drafts is
verified on its trie, a tree, so the same holds for it.

Example: prompt (5, 6), generated (7, 7), r = 2, f = 0.5, p = 0.25; logits 4.0 at 5, −1.0 at 7,
3.0 at 8 become 2.0 at 5 (in the prompt), −2 − 1 − 0.25 = −3.25 at 7, and 3.0 at 8 (unseen).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Set

import torch

from llm_worker.config import SamplingParams


def penalize(
    logits: torch.Tensor, params: SamplingParams, prompt: Set[int], generated: Mapping[int, int]
) -> torch.Tensor:
    """``logits`` [vocab] of one row → [vocab] float32 with the penalties of ``params`` for a
    position after ``prompt``'s tokens and ``generated`` (token → times generated)."""
    out = logits.float().clone()
    ids = sorted(set(prompt) | set(generated) if params.repetition_penalty != 1.0 else set(generated))
    if not ids:
        return out
    index = torch.tensor(ids, dtype=torch.long, device=out.device)  # [n]
    values = out[index]  # [n]
    r = params.repetition_penalty
    if r != 1.0:
        values = torch.where(values > 0, values / r, values * r)
    counts = torch.tensor([generated.get(t, 0) for t in ids], dtype=torch.float32, device=out.device)  # [n]
    values = values - params.frequency_penalty * counts
    values = values - params.presence_penalty * (counts > 0).float()
    out[index] = values
    return out


class Penalties:
    """One request's penalty state: its prompt's tokens and what it has committed since.

    ``commit`` each step's emitted tokens; ``apply`` a row of a forward with the tokens between
    the committed ones and that row (a draft node's path).
    """

    def __init__(self, params: SamplingParams, prompt: Iterable[int]) -> None:
        self.params = params
        self.prompt = frozenset(int(t) for t in prompt)
        self.generated: Counter[int] = Counter()

    def commit(self, tokens: Iterable[int]) -> None:
        self.generated.update(int(t) for t in tokens)

    def apply(self, logits: torch.Tensor, path: Iterable[int] = ()) -> torch.Tensor:
        """[vocab] → [vocab] float32: the row penalised as at the position after ``path``."""
        seen = self.generated.copy()
        seen.update(path)
        return penalize(logits, self.params, self.prompt, seen)
