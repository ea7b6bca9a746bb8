"""The fast forward's operations on CUDA in row-invariant Triton kernels (``triton_kernels``):
``ops.Ops`` with every GEMM, RMSNorm, RoPE + the cache write, attention and SiLU·up in kernels
whose tiling and reduction order never depend on the number of rows, so a token's logits are
bit-identical alone, in a draft tree or chain, in a prefill chunk and beside other requests
(``fast_llama``'s batch invariance), in float32, bfloat16 and float16. The default on a CUDA
device (``--ops auto``); ``--ops torch`` runs cuBLAS and torch's attention instead: faster on
large batches, and *not* batch-invariant (cuBLAS picks its kernel by the row count).

Attention has no key grid tied to cache positions: each query row reduces its visible keys as one
list (the committed prefix, then the tree ancestors it sees, by depth) in chunks of
``triton_kernels.ATTENTION_KEYS`` from the list's start, so a tree may have any number of rows
(``branching_rows_limit``). The KV cache holds the weights' dtype; attention widens keys and
values to float32 as it reads them, and the rotated queries stay float32.

Weights: the GEMMs read the model's dense weights in the compute dtype. The default model's
GGUF Q4_1 blocks are dequantized once when the checkpoint is converted (``loading``), so this
backend multiplies the dequantized values (there is no packed 4-bit path on CUDA).

Runs on CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1``): the CPU tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from llm_worker.model import triton_kernels
from llm_worker.model.kernels import ROLES, Kernel, KernelChoice, Linear, Weights
from llm_worker.model.kv_pool import KVState
from llm_worker.model.ops import CallRows, OpsContext, by_buffer, register
from llm_worker.types import causal_mask

KERNEL = Kernel("triton", 1)
"""The GEMM kernel of every role: ``triton_kernels.linear`` (row-invariant, no padding)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonLinear(Linear):
    """y = x W^T + b through ``triton_kernels.linear``: one tile configuration per weight."""

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return triton_kernels.linear(x, self.weight, self.bias)


@dataclass
class _Group:
    """The rows of a forward whose caches live in one buffer (the pool, or one request's own),
    as ``triton_kernels.rope_store`` and ``attention`` take them."""

    state: KVState  # a member: its ``layer_buffers`` are the group's
    rows: torch.Tensor  # [m] int32 the rows in the forward
    slots: torch.Tensor  # [m] each row's slot in the buffer (0 for own buffers)
    cache: torch.Tensor  # [m] its own cache position: its call's start + its row in the call
    starts: torch.Tensor  # [m] its call's committed length
    lengths: torch.Tensor  # [m] how many keys it sees: start + how many of its call's new rows
    news: torch.Tensor  # [m, w] those new rows (offsets from start), in order


@dataclass
class _Layout:
    groups: list[_Group]
    total: int
    pad: int


def visible_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new rows each row sees, in order, from a [n, n] bool mask: (rows [n, n] whose first
    counts[i] entries are row i's, counts [n]). Example: the tree root → a, root → b
    (mask [[1,0,0],[1,1,0],[1,0,1]]) → rows [[0,·,·],[0,1,·],[0,2,·]], counts [1, 2, 2]."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # seen rows first, ascending
    return order, mask.sum(1)


def call_layout(c: CallRows) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's rows as the kernels take them: meta [5, n] int32 (each row's row in the
    forward, slot, cache position, the call's committed length, how many keys it sees) and the
    new rows each sees, in order ([n, n], ``visible_rows``)."""
    mask = c.tree.mask if c.tree is not None else causal_mask(c.n)
    order, seen = visible_rows(mask)
    meta = torch.empty(5, c.n, dtype=torch.int32)
    meta[0] = torch.arange(c.row, c.row + c.n)
    meta[1] = max(c.state.slot, 0)
    meta[2] = torch.arange(c.start, c.start + c.n)
    meta[3] = c.start
    meta[4] = c.start + seen
    return meta, order


class TritonOps:
    """``ops.Ops`` in Triton kernels (see the module docstring)."""

    name = "triton"

    def __init__(self, ctx: OpsContext) -> None:
        self.ctx = ctx
        self.kv_dtype = ctx.dtype
        self.dtype = ctx.dtype
        self.scale = 1.0 / math.sqrt(ctx.info.head_dim)

    # -- what the forward asks ------------------------------------------------------------------

    def scope(self, own_threads: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def choose_kernels(self, weights: Weights, requested: str) -> KernelChoice:
        """Its own GEMM for every role ("auto" or "triton:1"), nothing measured; or torch's call
        (``aten:N``: cuBLAS on CUDA, not row-invariant) for every role if asked (``--kernel``)."""
        if requested in ("auto", KERNEL.name):
            return dict.fromkeys(ROLES, KERNEL), None
        kernel = Kernel.parse(requested)
        if kernel.library != "aten":
            raise ValueError(f"kernel {requested!r}: the triton operations run triton:1 or aten GEMMs")
        return dict.fromkeys(ROLES, kernel), None

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> Linear:
        if kernel.library == KERNEL.library:
            return TritonLinear(weight.contiguous(), bias, kernel)
        return Linear(weight, bias, kernel)

    def norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_kernels.rms_norm(h, delta, weight, eps)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_kernels.silu_mul(gate_up)

    def logits(self, head: Linear, h: torch.Tensor) -> torch.Tensor:
        """float32 logits from the GEMM's float32 accumulator (rounded once)."""
        if isinstance(head, TritonLinear):
            return triton_kernels.linear(h, head.weight, head.bias, out_dtype=torch.float32)
        return head(h).float()

    def branching_rows_limit(self, length: int) -> int | None:
        """None: a query reduces its visible keys as one list, wherever the tree put them."""
        return None

    def variant(self) -> str:
        return f"-triton-k{triton_kernels.ATTENTION_KEYS}"

    def describe(self) -> dict[str, Any]:
        return {
            "ops": "triton",
            "fused_kernels": False,
            "attention_chunk": triton_kernels.ATTENTION_KEYS,
            "attention_min_rows": 1,
            "grouped_attention": False,
        }

    def layout(self, calls: Sequence[CallRows], total: int, pad: int) -> _Layout:
        """The rows by the buffer their cache lives in (the pool's slots, or a request's own),
        each with what it sees; moved to the device in one copy per group."""
        groups = []
        for parts in by_buffer(calls):
            width = max(c.n for c in parts)
            count = sum(c.n for c in parts)
            meta = torch.empty(5, count, dtype=torch.int32)  # rows, slots, cache, starts, lengths
            news = torch.zeros(count, width, dtype=torch.int32)
            at = 0
            for c in parts:
                meta[:, at : at + c.n], news[at : at + c.n, : c.n] = call_layout(c)
                at += c.n
            flat = torch.cat((meta.flatten(), news.flatten())).to(self.ctx.device)
            rows, slots, cache, starts, lengths = flat[: 5 * count].view(5, count)
            seen_rows = flat[5 * count :].view(count, width)
            groups.append(_Group(parts[0].state, rows, slots, cache, starts, lengths, seen_rows))
        return _Layout(groups, total, pad)

    def rope_store(
        self, layout: _Layout, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        info = self.ctx.info
        q = torch.empty(layout.total, info.num_heads, info.head_dim, dtype=torch.float32, device=qkv.device)
        for g in layout.groups:
            keys, values = g.state.layer_buffers(layer)
            triton_kernels.rope_store(qkv, cos, sin, q, keys, values, g.rows, g.slots, g.cache)
        return q

    def attention(self, layout: _Layout, layer: int, q: torch.Tensor) -> torch.Tensor:
        info = self.ctx.info
        rows = layout.total + layout.pad
        attn = (torch.zeros if layout.pad else torch.empty)(
            rows, info.num_heads * info.head_dim, dtype=self.dtype, device=q.device
        )
        for g in layout.groups:
            keys, values = g.state.layer_buffers(layer)
            triton_kernels.attention(
                q, keys, values, attn, g.rows, g.slots, g.starts, g.news, g.lengths, self.scale
            )
        return attn


@register("triton")
def triton_ops(ctx: OpsContext) -> TritonOps | None:
    """The Triton operations on a CUDA device (or on CPU under Triton's interpreter) where triton
    is installed, in float32, bfloat16 or float16; else None."""
    on_device = ctx.device.type == "cuda" or (ctx.device.type == "cpu" and triton_kernels.interpreted())
    if not (on_device and triton_kernels.available() and ctx.dtype in DTYPES):
        return None
    if ctx.info.head_dim % 2:
        return None
    return TritonOps(ctx)
