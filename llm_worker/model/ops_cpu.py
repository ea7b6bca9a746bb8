"""The fast forward's operations on the fused CPU kernels (``native``, ``csrc/``): ``ops.Ops``
in four kernel calls per layer between the GEMMs (residual add + RMSNorm, RoPE + the cache write,
attention, SiLU·up), each row-invariant by construction.

Attention has no key grid here: a query row sums its visible cached keys in cache order, so a
tree may have any number of rows (``branching_rows_limit``) and nothing is padded. The KV cache
holds the weights' dtype: bfloat16 keys and values are widened exactly as attention reads them
(half the bytes a decode step reads from the cache for the same float32 arithmetic; keys rounded
once, after RoPE, as a bfloat16 model's own cache holds them).

Learned drafters' fast paths run on the same kernels through ``rope_rows``, ``attend_rows``,
``norm``, ``activation`` and ``quantized_linear`` (``drafters/glide_fused``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from llm_worker.model import native, quant
from llm_worker.model.kernels import Kernel, KernelChoice, Linear, Weights, requested_kernels
from llm_worker.model.kv_pool import KVState
from llm_worker.model.ops import CallRows, OpsContext, by_buffer, register, shared_prefixes
from llm_worker.types import causal_mask


@dataclass
class _FusedGroup:
    """The rows of a fused forward whose caches live in one buffer: the pool, or one request's
    own buffers."""

    state: KVState  # a member: its ``layer_buffers`` are the group's
    rows: torch.Tensor  # [m] the rows in the forward
    slots: torch.Tensor  # [m] each row's slot in the buffer (0 for own buffers)
    starts: torch.Tensor  # [m] its call's committed length: it sees cache positions [0, start)
    cache: torch.Tensor  # [m] its own cache position: start + its row within its call
    visible: torch.Tensor  # [m, w] bool: it sees its call's new row i (cache position start + i)
    source: torch.Tensor | None = None  # [m] the slot it reads its shared prefix from (None: nothing shared)
    shared: torch.Tensor | None = None  # [m] that prefix's length (``ops.shared_prefixes``)


@dataclass
class _Layout:
    """``FusedCpuOps``'s layout of a forward: its rows by the buffer their caches live in."""

    groups: list[_FusedGroup]
    total: int
    pad: int


class FusedCpuOps:
    """``ops.Ops`` on the fused CPU kernels (see the module docstring)."""

    name = "cpu-fused"
    quant_block = quant.BLOCK
    """The inputs of a block of ``quantized_linear``'s weights: a GEMM's inputs must be a multiple."""

    def __init__(self, kernels: ModuleType, ctx: OpsContext) -> None:
        self.kernels = kernels
        self.ctx = ctx
        self.kv_dtype = ctx.dtype
        self.dtype = ctx.dtype
        self.scale = 1.0 / math.sqrt(ctx.info.head_dim)

    @staticmethod
    def runs(ctx: OpsContext) -> bool:
        """Whether the kernels take this model's shapes and dtype here (not whether they built)."""
        d = ctx.info.head_dim
        return (
            ctx.device.type == "cpu"
            and ctx.dtype in (torch.float32, torch.bfloat16)
            and d % 8 == 0
            and d <= 256
        )

    # -- what the forward asks ------------------------------------------------------------------

    @contextmanager
    def _scope(self, own_threads: bool) -> Iterator[None]:
        with native.serial_torch(own_threads):
            self.kernels.use_pool(own_threads)  # for this thread's kernels
            yield

    def scope(self, own_threads: bool) -> AbstractContextManager[None]:
        """torch's operations on this thread alone and the kernels' rows on their own pool while
        every GEMM is a packed one of theirs (``own_threads``); else both on torch's OpenMP
        threads (see ``native.serial_torch``)."""
        return self._scope(own_threads)

    def choose_kernels(self, weights: Weights, requested: str) -> KernelChoice:
        """Among ``kernels``' candidates for this device and dtype (torch's BLAS call, oneDNN's
        prepacked GEMM, the fused kernels' own), by measurement (``kernels.requested_kernels``)."""
        c = self.ctx
        return requested_kernels(requested, c.info.fingerprint, weights, c.device, c.dtype)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> Linear:
        return Linear(weight, bias, kernel)

    def quantized_linear(self, *weights: torch.Tensor) -> Linear:
        """A GEMM over ``weights`` concatenated along the outputs, rounded once to 8-bit blocks of
        32 (Q8_0: per block a float16 scale), on the packed GEMM."""
        fused = torch.cat([w.detach().float() for w in weights])
        return Linear(quant.round_to_eight_bit(fused), None, Kernel("quant", 1))

    def norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total, normed = self.kernels.add_rms_norm(h, delta, weight, eps)
        return total, normed

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.kernels.silu_mul(gate_up)
        return out

    def logits(self, head: Linear, h: torch.Tensor) -> torch.Tensor:
        return head(h).float()

    def branching_rows_limit(self, length: int) -> int | None:
        """The fused attention has no grid (a query sums its visible keys in order): no limit."""
        return None

    def variant(self) -> str:
        """The build's digest: changed kernels are measured again."""
        return f"-{native.build_name().removeprefix('specdraft_fused_')[:8]}"

    def describe(self) -> dict[str, Any]:
        return {
            "fused_kernels": True,
            "attention_chunk": None,
            "attention_min_rows": 1,
            "grouped_attention": False,
        }

    def layout(self, calls: Sequence[CallRows], total: int, pad: int) -> _Layout:
        """Lay the rows out by the buffer their cache lives in: the pool's slots (one group) or a
        request's own buffers (a group each). Pooled calls that share a committed prefix read it
        from one slot (``ops.shared_prefixes``): the same bytes, one copy in the caches."""
        groups = []
        for parts in by_buffer(calls):
            width = max(c.n for c in parts)
            count = sum(c.n for c in parts)
            visible = torch.zeros(count, width, dtype=torch.bool)
            rows: list[int] = []
            slots: list[int] = []
            starts: list[int] = []
            cache: list[int] = []
            sources: list[int] = []
            shared: list[int] = []
            pooled = parts[0].state.pool is not None and len(parts) > 1
            prefixes = shared_prefixes(parts) if pooled else [(0, 0)] * len(parts)
            at = 0
            for c, (source, length) in zip(parts, prefixes, strict=True):
                visible[at : at + c.n, : c.n] = c.tree.mask if c.tree is not None else causal_mask(c.n)
                rows.extend(range(c.row, c.row + c.n))
                slots.extend([max(c.state.slot, 0)] * c.n)
                starts.extend([c.start] * c.n)
                cache.extend(range(c.start, c.start + c.n))
                sources.extend([max(source, 0)] * c.n)
                shared.extend([length] * c.n)
                at += c.n

            def index(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.long)

            state = parts[0].state
            group = _FusedGroup(state, index(rows), index(slots), index(starts), index(cache), visible)
            if any(shared):
                group.source, group.shared = index(sources), index(shared)
            groups.append(group)
        return _Layout(groups, total, pad)

    def rope_store(
        self, layout: _Layout, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        info = self.ctx.info
        q = torch.empty(layout.total, info.num_heads, info.head_dim, dtype=torch.float32)
        for g in layout.groups:
            keys, values = g.state.layer_buffers(layer)
            self.kernels.rope_store(qkv, cos, sin, q, keys, values, g.rows, g.slots, g.cache)
        return q

    def attention(self, layout: _Layout, layer: int, q: torch.Tensor) -> torch.Tensor:
        info = self.ctx.info
        rows = layout.total + layout.pad
        attn = (torch.zeros if layout.pad else torch.empty)(
            rows, info.num_heads * info.head_dim, dtype=self.dtype
        )
        for g in layout.groups:
            keys, values = g.state.layer_buffers(layer)
            self.kernels.attention(
                q, keys, values, g.rows, g.slots, g.starts, g.visible, self.scale, attn, g.source, g.shared
            )
        return attn

    # -- for drafters' own networks: the kernels over caller-laid-out rows -----------------------

    def rope_rows(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
    ) -> None:
        """Rotated queries of qkv's ``rows`` into q; their rotated keys and values into the cache
        buffers keys/values [slots, kv, capacity, d] at ``slots``, positions ``cache``."""
        self.kernels.rope_store(qkv, cos, sin_signed, q, keys, values, rows, slots, cache)

    def attend_rows(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of q's ``rows`` over slot ``slots``' prefix [0, starts) and the new rows
        ``visible`` marks, into out (see ``csrc/attention.cpp``)."""
        self.kernels.attention(q, keys, values, rows, slots, starts, visible, scale, out)


@register("cpu-fused")
def fused_cpu_ops(ctx: OpsContext) -> FusedCpuOps | None:
    """The fused kernels where they run for this model and have built (else None)."""
    if not FusedCpuOps.runs(ctx):
        return None
    kernels = native.load()
    return FusedCpuOps(kernels, ctx) if kernels is not None else None
