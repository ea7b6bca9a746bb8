"""Per-step reductions over the vocabulary: greedy argmax, the top-1 probability, the top k of
each row (``recycle``'s candidates), and the log-probabilities a request asks for.

On the CPU they run in numpy, on one thread. torch splits a reduction over 49 k logits between
its OpenMP threads, whose workers then spin for a while after it; the fused kernels' own pool
(``llm_worker/model/csrc/``) wants those cores for the next forward, and each decode
step lost about a third of its speed to that contention on a 2-core machine. The results are
torch's: the first index of the largest value, and 1 / Σ exp(l − max) (the exponentials in float32,
summed in float64). Where this process has loaded the fused kernels, the top k and the top-1
probability run there instead (``csrc/logits.cpp``; one pass, no scratch buffers): the same top k,
the same probability to about 1e-6 (its exponentials are a polynomial's), 0.1–0.4 ms a step less.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from llm_worker.model import native
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
    kernels = native.loaded()
    if kernels is not None and logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_contiguous():
        p = float(kernels.top_probability(logits.detach()))
        if not math.isnan(p):  # a NaN or no finite entry: numpy's result, as before
            return p
    row = logits.detach().float().numpy()
    shifted = _scratch(row.shape[0])
    np.subtract(row, row.max(), out=shifted)
    return float(1.0 / np.exp(shifted, out=shifted).sum(dtype=np.float64))


TOP_K_GROUPS = 384
"""``top_k``'s groups: index i belongs to group i mod 384 (one vectorised max over a [n, 128, 384]
view of SmolLM2's 49 152 logits)."""


def top_k_rows(logits: torch.Tensor, k: int) -> np.ndarray:
    """[n, vocab] → [n, k] int64: each row's ``k`` largest entries, largest first, equal values by
    index (``top_k``). On the CPU in numpy, on one thread, for the reason ``argmax_rows`` is:
    ``torch.topk`` over a few rows shares them between torch's OpenMP threads, whose spinning
    workers then slow the next forward (figures: docs/modes.md, Token Recycling)."""
    if logits.device.type != "cpu":
        return torch.topk(logits, k, dim=-1).indices.cpu().numpy()
    kernels = native.loaded()
    if kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous():
        chosen: np.ndarray = kernels.top_k_rows(logits.detach(), k).numpy()
        nan_rows = np.flatnonzero(chosen[:, 0] < 0)  # a row with a NaN: ranked as below
        if len(nan_rows):
            chosen[nan_rows] = top_k(logits.detach()[nan_rows].numpy(), k)
        return chosen
    return top_k(logits.detach().float().numpy(), k)


def top_k(x: np.ndarray, k: int, groups: int = TOP_K_GROUPS) -> np.ndarray:
    """[n, v] float32 → [n, k] int64, 1 ≤ k ≤ v: the first k indices of each row sorted by value,
    descending, equal values in index order (``np.argsort(-x, kind="stable")[:, :k]``, which the
    tests check it against). Rows with a NaN are ranked by ``torch.topk`` instead (NaN first).

    Without sorting the row: the maximum of each group (index i in group i mod ``groups``) gives
    t, the k-th largest of those maxima. The k groups with the largest maxima hold k entries ≥ t,
    so the row's k largest are all ≥ t, and only the entries ≥ t (k and a few more) are sorted.
    Example: x = [[1, 9, 3, 9, 5, 0]], k = 2, groups 3: group maxima [9, 9, 3] (groups {0, 3},
    {1, 4}, {2, 5}), t = 9, entries ≥ 9 at 1 and 3 → [[1, 3]].
    """
    n, v = x.shape
    if not 1 <= k <= v:
        raise ValueError(f"k must be in 1..{v}, not {k}")
    g = min(max(groups, k), v)
    full = v - v % g
    maxima = x[:, :full].reshape(n, -1, g).max(axis=1)  # [n, g]
    if full < v:  # the tail: index full + j is in group j
        np.maximum(maxima[:, : v - full], x[:, full:], out=maxima[:, : v - full])
    if np.isnan(maxima).any():
        return torch.topk(torch.from_numpy(x), k, dim=-1).indices.numpy()
    t = np.partition(maxima, g - k, axis=1)[:, g - k : g - k + 1]  # [n, 1]
    mask = _scratch(n * v, np.bool_)
    np.greater_equal(x, t, out=mask.reshape(n, v))
    flat = np.flatnonzero(mask)  # [m] the entries ≥ t, row by row, in index order
    rows = flat // v
    order = np.lexsort((-x.reshape(-1)[flat], rows))  # by row, then value descending, stable
    starts = np.searchsorted(rows[order], np.arange(n))  # [n] each row has ≥ k entries
    chosen = flat[order[starts[:, None] + np.arange(k)]]  # [n, k]
    return chosen - np.arange(n)[:, None] * v


_local = threading.local()


def _scratch(size: int, dtype: type = np.float32) -> np.ndarray:
    """This thread's buffer of ``dtype``, its first ``size`` entries: a fresh one each step was
    as many page faults as the pass itself (its 200 kB came from mmap each time)."""
    buffers: dict[type, np.ndarray] | None = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.shape[0] < size:
        buffer = buffers[dtype] = np.empty(size, dtype=dtype)
    return buffer[:size]


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
