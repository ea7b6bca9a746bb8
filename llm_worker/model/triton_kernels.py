"""Row-invariant Triton kernels for the forward's operations on CUDA (``ops_triton.TritonOps``),
as plain functions over torch tensors: ``linear`` (and its float32-output form for logits),
``rms_norm``, ``silu_mul``, ``rope_store`` and ``attention``.

*Row-invariant by construction*: a row's result is bit-identical whatever other rows share the
call (1 or 1,000), in float32, bfloat16 and float16. cuBLAS and the attention libraries choose
their tiling, their split of K across thread blocks and even the algorithm by the number of rows,
so the same token's logits differ between a decode step and a draft tree; here every kernel has
one configuration per weight shape (``gemm_tiles``: a function of N, K and the dtype, never of M),
reduces K in one order from 0 (no split-K), and is never autotuned. The rows are padded only by
masks, and the row count is not a specialisation key of the compiled kernel. Attention reduces
each query's visible keys as one list in fixed chunks from its first key (see
``triton_jit.attention_kernel``), so a tree node gives what the token decoded alone gives.

The kernels (``triton_jit``) are imported, and with them triton, the first time one runs: a
CPU worker never loads them. They run on CUDA, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported: the CPU tests). Example::

    y = linear(x, w)                      # x [m, k] @ w[n, k]^T in x's dtype, float32 accumulation
    y[i] == linear(x[i : i + 1], w)[0]    # bit for bit, for every m and i
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

GEMM_ROWS = 32
"""Rows of a GEMM tile: a decode step's one row is computed in a 32-row tile like any other."""
ATTENTION_KEYS = 64
"""Keys per chunk of attention's online softmax (``attention_kernel``'s BLOCK_N)."""
DOT_MIN = 16
"""tl.dot's smallest size in every dimension."""


def available() -> bool:
    """Whether the kernels can run here: triton is installed and either CUDA is present or
    Triton's interpreter is on (``TRITON_INTERPRET=1`` when the kernels were, or will be, made)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpreted()


def interpreted() -> bool:
    """Whether the kernels run (or, not yet imported, would run) on Triton's interpreter."""
    made = sys.modules.get("llm_worker.model.triton_jit")
    if made is not None:
        return bool(made.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _jit() -> ModuleType:
    from llm_worker.model import triton_jit

    return triton_jit


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Tiles:
    """A GEMM's tile: BM rows × BN outputs, K in steps of BK."""

    bm: int
    bn: int
    bk: int


def gemm_tiles(n: int, k: int, dtype: torch.dtype) -> Tiles:
    """The one tile configuration of a [n, k] weight's GEMMs in ``dtype``, whatever the rows.
    Example: n 576, k 576, bfloat16 → 32 × 64 × 64; float32 → 32 × 64 × 32 (half the bytes a
    K step holds in shared memory)."""
    bk = 32 if dtype == torch.float32 else 64
    return Tiles(GEMM_ROWS, 64 if n >= 64 else DOT_MIN, bk if k >= bk else max(DOT_MIN, _pow2(k)))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias [n]) → [m, n] in ``out_dtype`` (default x's dtype), from a
    float32 accumulator (``out_dtype`` float32: the logits, rounded once). Row-invariant."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has {k} inputs, the weight {weight.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    t = gemm_tiles(n, k, weight.dtype)
    grid = (-(-m // t.bm), -(-n // t.bn))
    _jit().linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        BY_SUM=interpreted(),
        BM=t.bm,
        BN=t.bn,
        BK=t.bk,
    )
    return y


def rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) · weight) of h, delta [rows, width]; without delta
    (h, RMSNorm(h) · weight). One program per row."""
    rows, width = h.shape
    if h.stride(1) != 1:
        h = h.contiguous()
    if delta is not None and delta.stride(1) != 1:
        delta = delta.contiguous()
    total = torch.empty_like(h) if delta is not None else h
    out = torch.empty_like(h)
    if rows:
        _jit().rms_norm_kernel[(rows,)](
            h,
            delta if delta is not None else h,
            weight,
            total,
            out,
            width,
            float(eps),
            h.stride(0),
            delta.stride(0) if delta is not None else 0,
            total.stride(0),
            out.stride(0),
            HAS_DELTA=delta is not None,
            BLOCK=_pow2(width),
        )
    return total, out


SILU_BLOCK = 1024
"""Outputs per program of ``silu_mul``."""


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of gate_up [rows, 2 I] (gate first): [rows, I]."""
    rows, double = gate_up.shape
    width = double // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(SILU_BLOCK, _pow2(width))
        _jit().silu_mul_kernel[(rows, -(-width // block))](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out


def rope_store(
    qkv: torch.Tensor,  # [rows, (heads + 2 kv) d]
    cos: torch.Tensor,  # [rows, d]
    sin_signed: torch.Tensor,  # [rows, d] the first half negated
    q: torch.Tensor,  # [rows, heads, d] float32, written
    keys: torch.Tensor,  # [slots, kv, capacity, d], written
    values: torch.Tensor,  # [slots, kv, capacity, d + 1] (or d), written
    rows: torch.Tensor,  # [m] the rows to rotate and store
    slots: torch.Tensor,  # [m] each row's slot of keys/values
    cache: torch.Tensor,  # [m] its cache position
) -> None:
    """Rotate the query and key heads of qkv's ``rows`` with each row's cos/sin: queries into q,
    keys (and the values) into the cache at (slot, position)."""
    m = int(rows.shape[0])
    heads, kv, d = q.shape[1], keys.shape[1], keys.shape[3]
    if m == 0:
        return
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    _jit().rope_store_kernel[(m,)](
        qkv,
        cos,
        sin_signed,
        q,
        keys,
        values,
        rows,
        slots,
        cache,
        qkv.stride(0),
        cos.stride(0),
        sin_signed.stride(0),
        q.stride(0),
        *keys.stride()[:3],
        *values.stride()[:3],
        HEADS=heads,
        KV=kv,
        D=d,
        HALF=d // 2,
        HEADS_PAD=_pow2(heads),
        KV_PAD=_pow2(kv),
        HALF_PAD=_pow2(d // 2),
        D_PAD=_pow2(d),
    )


def attention(
    q: torch.Tensor,  # [rows, heads, d] post-RoPE queries (float32)
    keys: torch.Tensor,  # [slots, kv, capacity, d]
    values: torch.Tensor,  # [slots, kv, capacity, d + 1] (or d)
    out: torch.Tensor,  # [≥ rows, heads · d], written at ``rows``
    rows: torch.Tensor,  # [m] the query rows
    slots: torch.Tensor,  # [m] each row's slot
    starts: torch.Tensor,  # [m] its committed length: it sees cache positions 0 .. start − 1
    news: torch.Tensor,  # [m, w] int32: the new rows it sees (offsets from start), in order
    lengths: torch.Tensor,  # [m] int32: how many keys it sees, start + its count of news
    scale: float,
) -> None:
    """Softmax attention of each row over cache positions 0 .. start − 1 then start + news[i, j]
    for j < length − start, keys and values of its slot, into out [row, heads · d];
    row-invariant (``triton_jit.attention_kernel``). Example: start 5, news [0, 2], length 7:
    positions 0..4, 5, 7 (a tree node whose parent is the call's row 0, itself row 2)."""
    m = int(rows.shape[0])
    heads, kv, d = q.shape[1], keys.shape[1], keys.shape[3]
    if m == 0:
        return
    group = heads // kv
    _jit().attention_kernel[(m, kv)](
        q,
        keys,
        values,
        out,
        rows,
        slots,
        starts,
        lengths,
        news,
        news.stride(0),
        float(scale),
        q.stride(0),
        *keys.stride()[:3],
        *values.stride()[:3],
        out.stride(0),
        GROUP=group,
        GROUP_PAD=max(DOT_MIN, _pow2(group)),
        D=d,
        D_PAD=max(DOT_MIN, _pow2(d)),
        BLOCK_N=ATTENTION_KEYS,
    )
