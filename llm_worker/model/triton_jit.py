"""The Triton kernels of ``triton_kernels`` (which imports this module, and so triton, only when a
kernel first runs). Each is row-invariant by construction: a program computes whole rows (or a
fixed tile of rows) with the same instructions whatever the number of rows, its constexpr sizes
depend on the model's shapes only, and every reduction runs in one fixed order.

Written in the subset that Triton 3.6 compiles for CUDA and Triton 3.9 interprets on CPU
(``TRITON_INTERPRET=1``, set before triton is imported): masked ``tl.load``/``tl.store``,
``tl.dot``, ``tl.sum``/``tl.max``, loops over ``range(0, n)`` of runtime ints; no block pointers,
descriptors or autotuning.
"""

from __future__ import annotations

import triton
import triton.language as tl


# The row count m is no specialisation key: Triton would otherwise compile other code for 1 row or
# a multiple of 16 rows.
@triton.jit(do_not_specialize=["m"])
def linear_kernel(
    x_ptr,  # [m, k]
    w_ptr,  # [n, k]
    b_ptr,  # [n] (read only when HAS_BIAS)
    y_ptr,  # [m, n]
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for float32 (no TF32), else None
    BY_SUM: tl.constexpr,  # the tile product as products and a sum over K (Triton's interpreter)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[i, j] = Σ_k x[i, k] w[j, k] (+ b[j]) for a BM × BN tile, K in steps of BK from 0 with a
    float32 accumulator: every tile runs the same steps whatever ``m``, and on CUDA the tensor
    cores compute each element of a tile alike, whatever its row's place in the tile.

    BY_SUM (Triton's interpreter only): the interpreter's tl.dot is numpy's BLAS matmul, whose sum
    for a row depends on the row's place in the tile (and which multiplies bfloat16 tiles as raw
    16-bit integers); there each step is float32 products summed over K in order instead."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(0, tl.cdiv(k, BK)):
        kk = step * BK + ks
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + kk[None, :],
            mask=(rows[:, None] < m) & (kk[None, :] < k),
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + kk[:, None],
            mask=(cols[None, :] < n) & (kk[:, None] < k),
            other=0.0,
        )
        if BY_SUM:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < m) & (cols[None, :] < n),
    )


@triton.jit
def rms_norm_kernel(
    h_ptr,  # [rows, width]
    delta_ptr,  # [rows, width] (read only when HAS_DELTA)
    w_ptr,  # [width]
    sum_ptr,  # [rows, width] h + delta (written only when HAS_DELTA)
    out_ptr,  # [rows, width]
    width,
    eps,
    stride_h,
    stride_delta,
    stride_sum,
    stride_out,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: s = h + delta rounded to the activations' dtype (as torch adds), then
    w · round(s · rsqrt(mean(s²) + eps)) as transformers' LlamaRMSNorm (float32 inside)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    h = tl.load(h_ptr + row * stride_h + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=inside, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, h, mask=inside)
    x = h.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / width
    normed = (x * (1.0 / tl.sqrt(mean_square + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(
        out_ptr + row * stride_out + cols,
        (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=inside,
    )


@triton.jit
def silu_mul_kernel(
    gu_ptr,  # [rows, 2 · width]: gate, then up
    out_ptr,  # [rows, width]
    width,
    stride_gu,
    stride_out,
    BLOCK: tl.constexpr,
):
    """SiLU(gate) · up, elementwise; SiLU rounded to the dtype first, as torch's two operations."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + width + cols, mask=inside, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def rope_store_kernel(
    qkv_ptr,  # [rows, (heads + 2 kv) · d]
    cos_ptr,  # [rows, d]
    sin_ptr,  # [rows, d] sign-folded: the first half negated
    q_ptr,  # [rows, heads, d] float32
    k_ptr,  # [slots, kv, capacity, d]
    v_ptr,  # [slots, kv, capacity, d + 1]
    rows_ptr,  # [m] each program's row of the forward
    slots_ptr,  # [m] its cache's slot
    cache_ptr,  # [m] its cache position
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_q,
    stride_k_slot,
    stride_k_head,
    stride_k_pos,
    stride_v_slot,
    stride_v_head,
    stride_v_pos,
    HEADS: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,  # d / 2
    HEADS_PAD: tl.constexpr,  # powers of two ≥ heads, kv, d / 2 and d
    KV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Program i: row rows[i]'s query heads rotated into q, its key heads rotated into the cache at
    (slots[i], cache[i]) and its values copied beside them. Rotation (float32, as ``TorchOps``):
    (x1, x2) → (x1 cos1 + x2 sin1, x2 cos2 + x1 sin2) with sin1 = −sin (folded into the table)."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    pos = tl.load(cache_ptr + i).to(tl.int64)
    half = tl.arange(0, HALF_PAD)
    cols = half[None, :]
    inside = half < HALF
    cos1 = tl.load(cos_ptr + row * stride_cos + half, mask=inside, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + row * stride_cos + HALF + half, mask=inside, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + row * stride_sin + half, mask=inside, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + row * stride_sin + HALF + half, mask=inside, other=0.0).to(tl.float32)[None, :]
    src = qkv_ptr + row * stride_qkv

    heads = tl.arange(0, HEADS_PAD)[:, None]
    q_mask = (heads < HEADS) & (cols < HALF)
    x1 = tl.load(src + heads * D + cols, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + heads * D + HALF + cols, mask=q_mask, other=0.0).to(tl.float32)
    dst = q_ptr + row * stride_q + heads * D + cols
    tl.store(dst, x1 * cos1 + x2 * sin1, mask=q_mask)
    tl.store(dst + HALF, x2 * cos2 + x1 * sin2, mask=q_mask)

    kv_heads = tl.arange(0, KV_PAD)[:, None]
    k_mask = (kv_heads < KV) & (cols < HALF)
    x1 = tl.load(src + (HEADS + kv_heads) * D + cols, mask=k_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + (HEADS + kv_heads) * D + HALF + cols, mask=k_mask, other=0.0).to(tl.float32)
    key = k_ptr + slot * stride_k_slot + kv_heads * stride_k_head + pos * stride_k_pos + cols
    tl.store(key, (x1 * cos1 + x2 * sin1).to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(key + HALF, (x2 * cos2 + x1 * sin2).to(k_ptr.dtype.element_ty), mask=k_mask)

    dims = tl.arange(0, D_PAD)[None, :]
    v_mask = (kv_heads < KV) & (dims < D)
    v = tl.load(src + (HEADS + KV + kv_heads) * D + dims, mask=v_mask, other=0.0)
    value = v_ptr + slot * stride_v_slot + kv_heads * stride_v_head + pos * stride_v_pos + dims
    tl.store(value, v.to(v_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def attention_kernel(
    q_ptr,  # [rows, heads, d] float32
    k_ptr,  # [slots, kv, capacity, d]
    v_ptr,  # [slots, kv, capacity, d + 1]
    out_ptr,  # [rows, heads · d]
    rows_ptr,  # [m] each program's row of the forward
    slots_ptr,  # [m] its cache's slot
    starts_ptr,  # [m] its call's committed length
    lengths_ptr,  # [m] how many keys it sees: start + its visible new rows
    news_ptr,  # [m, width] its visible new rows (offsets from start), in order
    stride_news,
    scale,
    stride_q,
    stride_k_slot,
    stride_k_head,
    stride_k_pos,
    stride_v_slot,
    stride_v_head,
    stride_v_pos,
    stride_out,
    GROUP: tl.constexpr,  # query heads per key head
    GROUP_PAD: tl.constexpr,  # ≥ 16 and ≥ GROUP: tl.dot's rows
    D: tl.constexpr,
    D_PAD: tl.constexpr,  # a power of two ≥ max(d, 16)
    BLOCK_N: tl.constexpr,  # keys per chunk of the online softmax
):
    """Program (i, kv_head): the GROUP query heads of row rows[i] over their visible keys.

    The visible keys are taken as one list: cache positions 0 .. start − 1, then the call's new
    rows the mask lets it see, in order (a tree node's ancestors by depth, then itself) — the same
    list, key for key, as the token decoded alone after its accepted ancestors, whatever cache
    positions the tree put them at. The list is reduced in chunks of BLOCK_N from its first key with
    an online softmax (running max, rescaled sum and numerator, float32), so a row's result
    depends on its own keys only: not on the other rows, nor on where its keys sit in the cache."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    start = tl.load(starts_ptr + i)
    length = tl.load(lengths_ptr + i)
    g = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    q_mask = (g[:, None] < GROUP) & (dims[None, :] < D)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_q + heads[:, None] * D + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale
    best = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    denominator = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), dtype=tl.float32)
    k_base = k_ptr + slot * stride_k_slot + kv_head * stride_k_head
    v_base = v_ptr + slot * stride_v_slot + kv_head * stride_v_head
    for chunk in range(0, tl.cdiv(length, BLOCK_N)):
        j = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        seen = j < length
        new = j >= start
        offset = tl.load(news_ptr + i * stride_news + (j - start), mask=seen & new, other=0)
        pos = tl.where(new, start + offset, j).to(tl.int64)
        kv_mask = seen[:, None] & (dims[None, :] < D)
        keys = tl.load(k_base + pos[:, None] * stride_k_pos + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        denominator = denominator * rescale + tl.sum(weights, axis=1)
        values = tl.load(v_base + pos[:, None] * stride_v_pos + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights, values.to(tl.float32), input_precision="ieee")
        best = new_best
    out = acc / denominator[:, None]
    tl.store(
        out_ptr + row * stride_out + heads[:, None] * D + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


INTERPRETED = type(linear_kernel).__name__ == "InterpretedFunction"
"""Whether these kernels were made for Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
