"""Batched completions through the target's own forward (``TargetModel.forward_many``).

transformers' ``generate`` pads a batch to its longest prompt, grows a dynamic cache by
concatenation and keeps finished rows in the batch until the last one ends; on the 2-core
reference CPU it wrote about 65 tokens/s in batches of 24-48. ``TargetCompleter`` keeps up to
``batch_size`` sequences in flight instead: each forward carries every active sequence's next
token (and the prompt of a sequence that joins, in chunks), a finished sequence leaves at once
and the next prompt takes its place; the fast backend runs that forward as one GEMM chain over
all rows. Same interface as ``llm_worker.training.data.Completer``.

Sampling draws each sequence's tokens from its own generator seeded by ``seed`` and the
sequence's index, so an answer does not depend on what else was in the batch (nor, the forward
being batch-invariant, do the greedy ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llm_worker.logits import argmax
from llm_worker.model.target import ForwardCall, SequenceState, TargetModel
from llm_worker.types import ArtifactNeeds

_NUCLEUS_FIRST = 1024
_NUCLEUS_SPAN = 12.0
"""Scaled-logit distance below the likeliest token searched first: a probability ratio of e^-12."""


@dataclass
class _Running:
    index: int
    state: SequenceState
    pending: list[int]  # tokens not yet forwarded (the prompt's rest, or the last sampled token)
    rng: np.random.Generator | None
    out: list[int] = field(default_factory=list)


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token from ``softmax(logits / temperature)`` cut to the smallest set of most likely
    tokens whose probability reaches ``top_p`` (nucleus sampling). In numpy on one thread, as
    ``llm_worker.logits`` (no OpenMP workers left spinning against the next forward).

    The nucleus is the head of the tokens sorted likeliest first (ties by id), so any *top set*
    (every token at least as likely as its least likely member) whose mass reaches ``top_p``
    contains it, and sorting that set gives the same head: the tokens within ``_NUCLEUS_SPAN`` of
    the likeliest first (one comparison over the vocabulary), then the 1 024 likeliest (a
    partition), then all of them — the same token for the same ``rng`` whichever set serves."""
    scaled = logits.detach().float().numpy().astype(np.float64) / temperature
    top = scaled.max()
    probs = np.exp(scaled - top)
    probs /= probs.sum()
    candidates = np.arange(probs.size)
    if probs.size > _NUCLEUS_FIRST:
        near = np.flatnonzero(scaled >= top - _NUCLEUS_SPAN)  # a top set
        if near.size <= _NUCLEUS_FIRST and probs[near].sum() >= top_p:
            candidates = near
        else:
            head = np.argpartition(-probs, _NUCLEUS_FIRST - 1)[:_NUCLEUS_FIRST]
            if probs[head].sum() >= top_p:
                candidates = head
    order = candidates[np.lexsort((candidates, -probs[candidates]))]  # likeliest first, ties by id
    ordered = probs[order]
    kept = min(int(np.searchsorted(np.cumsum(ordered), top_p)) + 1, order.size)  # the first always kept
    ordered = ordered[:kept] / ordered[:kept].sum()
    return int(order[rng.choice(kept, p=ordered)])


class TargetCompleter:
    """Completions of token prefixes, ``batch_size`` sequences in flight through one forward."""

    def __init__(
        self,
        target: TargetModel,
        eos_ids: Sequence[int],
        batch_size: int,
        prefill_chunk: int = 512,
        top_p: float = 0.95,
    ) -> None:
        self.target = target
        self.eos_ids = set(eos_ids)
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.top_p = top_p
        self.max_context = target.info.max_context

    def complete(
        self,
        prefixes: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        seeds: Sequence[int] | None = None,
    ) -> list[tuple[list[int], bool]]:
        """Per prefix: the generated ids (the end token cut off) and whether it ended by itself.
        ``temperature`` 0 = greedy. Prefix i samples from a generator seeded by (``seed``, i), or
        by ``seeds[i]`` alone when given (what it writes then depends on nothing else)."""
        results: list[tuple[list[int], bool] | None] = [None] * len(prefixes)
        waiting = list(range(len(prefixes)))[::-1]
        running: list[_Running] = []
        needs = ArtifactNeeds()
        while waiting or running:
            while waiting and len(running) < self.batch_size:
                index = waiting.pop()
                prefix = [int(t) for t in prefixes[index]]
                if not prefix or len(prefix) >= self.max_context:
                    results[index] = ([], False)
                    continue
                own = [seeds[index]] if seeds is not None else [seed, index]
                rng = np.random.default_rng(own) if temperature > 0 else None
                running.append(_Running(index, self.target.start(), prefix, rng))
            calls = []
            for run in running:
                chunk = run.pending[: self.prefill_chunk]
                calls.append(ForwardCall(run.state, torch.tensor(chunk), None, needs, last_logits_only=True))
            outputs = self.target.forward_many(calls)
            still: list[_Running] = []
            for run, call, output in zip(running, calls, outputs, strict=True):
                n = len(call.tokens)
                self.target.commit(run.state, range(n))
                run.pending = run.pending[n:]
                if run.pending:  # the prompt continues in the next forward
                    still.append(run)
                    continue
                logits = output.logits[-1]
                if run.rng is None:
                    token = argmax(logits)
                else:
                    token = sample_top_p(logits, temperature, self.top_p, run.rng)
                if token in self.eos_ids:
                    results[run.index] = (run.out, True)
                    continue
                run.out.append(token)
                if len(run.out) >= max_new_tokens or run.state.length + 1 >= self.max_context:
                    results[run.index] = (run.out, False)
                    continue
                run.pending = [token]
                still.append(run)
            running = still
        return [r if r is not None else ([], False) for r in results]
