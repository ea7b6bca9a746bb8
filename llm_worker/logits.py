"""Per-step reductions over the vocabulary: greedy argmax, the top-1 probability, and the
log-probabilities a request asks for.

On the CPU they run in numpy, on one thread. torch splits a reduction over 49 k logits between
its OpenMP threads, whose workers then spin for a while after it; the fused kernels' own pool
(``llm_worker/model/csrc/``) wants those cores for the next forward, and each decode
step lost about a third of its speed to that contention on a 2-core machine. The results are
torch's: the first index of the largest value, and 1 / Σ exp(l − max) (the exponentials in float32,
summed in float64).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from llm_worker.results import TokenLogprob


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """[n, vocab] → each row's argmax (the first index of its largest value)."""
    if logits.device.type != "cpu":
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    return [int(t) for t in logits.detach().float().numpy().argmax(axis=-1)]


def argmax(logits: torch.Tensor) -> int:
    """[vocab] → the argmax."""
    return argmax_rows(logits.reshape(1, -1))[0]


def top_probability(logits: torch.Tensor) -> float:
    """[vocab] → the softmax's largest probability, 1 / Σ exp(l − max) (an acceptance feature)."""
    if logits.device.type != "cpu":
        return float(torch.softmax(logits.float(), dim=-1).max())
    row = logits.detach().float().numpy()
    shifted = _scratch(row.shape[0])
    np.subtract(row, row.max(), out=shifted)
    return float(1.0 / np.exp(shifted, out=shifted).sum(dtype=np.float64))


_local = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's float32 buffer of ``size``: a fresh one each step was as many page faults
    as the pass itself (its 200 kB came from mmap each time)."""
    buffer: np.ndarray | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.shape[0] != size:
        buffer = _local.buffer = np.empty(size, dtype=np.float32)
    return buffer


MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per token (OpenAI's and vLLM's limit)."""


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``logits`` [vocab]: the row that decided ``token`` → its log-softmax at ``token`` and the
    ``top`` likeliest entries (float32). One row at a time, so that ``ar``'s rows and a draft
    tree's give the same bits wherever their logits are the same bits."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]))
        alternatives = tuple(zip((int(i) for i in ids.tolist()), values.tolist(), strict=True))
    return TokenLogprob(int(token), float(logp[token]), alternatives)
