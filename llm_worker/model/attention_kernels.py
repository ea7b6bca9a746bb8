"""Attention's batched GEMMs made row-invariant by padding, checked on this machine.

The two batched products of attention (scores = Q K^T, then weights · values) must give a query
row the same result whatever the number of rows beside it, as the GEMMs of ``kernels`` must; some
BLAS builds agree only from a few rows up, so the rows are padded with zeros to the fewest that
agree here (``attention_min_rows``). Moved out of ``kernels`` (which re-exports it) for size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

ATTENTION_PADS = (1, 2, 4, 8, 16, 32)
"""Candidate minimum query-row counts of attention's batched GEMMs, smallest first."""


def attention_min_rows(
    kv_heads: int,
    group: int,
    head_dim: int,
    chunk: int,
    max_rows: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """The fewest query rows attention's two batched GEMMs (scores = Q K^T over ``head_dim``,
    then weights · values over a chunk of ``chunk`` keys) must be padded to for a query row's
    result not to depend on how many rows there are, checked bitwise on this machine for every
    row count a forward of up to ``max_rows`` tokens makes (``group`` query rows per token and
    KV head). On an Intel Sapphire Rapids VM 1 (no padding); on a 2-core AMD EPYC (AVX2) MKL's
    batched GEMM agrees only from 4 rows up. Falls back to the largest candidate, with an error
    in the log, if none is invariant."""
    from llm_worker.model.kernels import CHECK_ROWS

    gen = torch.Generator().manual_seed(0)
    counts = sorted({group * n for n in CHECK_ROWS if n <= max_rows} | {group * max_rows})
    keys = torch.randn(kv_heads, chunk, head_dim, generator=gen).to(device=device, dtype=dtype)
    values = torch.randn(kv_heads, chunk, head_dim + 1, generator=gen).to(device=device, dtype=dtype)
    queries = torch.randn(kv_heads, max(counts), head_dim, generator=gen).to(device=device, dtype=dtype)
    weights = torch.rand(kv_heads, max(counts), chunk, generator=gen).to(device=device, dtype=dtype)
    for pad in ATTENTION_PADS:

        def scores(x: torch.Tensor, pad: int = pad) -> torch.Tensor:
            return pad_rows_bmm(x, keys.transpose(1, 2), pad)

        def mixed(x: torch.Tensor, pad: int = pad) -> torch.Tensor:
            return pad_rows_bmm(x, values, pad)

        if all(_bmm_invariant(f, x, counts) for f, x in ((scores, queries), (mixed, weights))):
            return pad
    log.error(
        "attention is not row-invariant at any padding on this machine: tokens may differ between modes"
    )
    return ATTENTION_PADS[-1]


def pad_rows_bmm(a: torch.Tensor, b: torch.Tensor, min_rows: int) -> torch.Tensor:
    """``torch.bmm(a, b)`` with a's rows (dim 1) padded with zeros to at least ``min_rows``:
    a [batch, m, k], b [batch, k, n] → [batch, m, n]."""
    m = a.shape[1]
    if m >= min_rows:
        return torch.bmm(a, b)
    padded = torch.cat((a, a.new_zeros(a.shape[0], min_rows - m, a.shape[2])), dim=1)
    return torch.bmm(padded, b)[:, :m]


def _bmm_invariant(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: Sequence[int]
) -> bool:
    """Whether row i of ``product(x[:, :m])`` equals ``product(x[:, i:i+1])`` bitwise, for the
    first and last row of every m in ``counts``."""
    alone: dict[int, torch.Tensor] = {}
    for m in counts:
        out = product(x[:, :m])
        for i in {0, m - 1}:
            if i not in alone:
                alone[i] = product(x[:, i : i + 1])[:, 0]
            if not torch.equal(out[:, i], alone[i]):
                return False
    return True
