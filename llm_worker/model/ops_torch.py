"""The fast forward's operations in torch (``ops.Ops``), on any device: the path the forward
takes with ``--no-fused`` or where the fused CPU kernels cannot run.

Each operation is row-invariant: RMSNorm, RoPE (a table of every position's cos/sin, computed
once), SiLU·up and residuals work row by row; attention sums over keys in a fixed grid of
``chunk`` keys from position 0 (``_attention``), so more queries never change how one query's
keys are reduced, and its batched GEMMs are padded to the row count from which they are
invariant on this machine (``kernels.attention_min_rows``). Pooled requests' decode steps and
trees run their attention as one batched GEMM chain over their slots (``_grouped``) where that is
bitwise the same as each alone on this machine (``_grouped_exact``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llm_worker.model.attention_kernels import attention_min_rows, pad_rows_bmm
from llm_worker.model.kernels import Kernel, KernelChoice, Linear, Weights, requested_kernels
from llm_worker.model.kv_pool import KVPool, KVState
from llm_worker.model.ops import CallRows, OpsContext, register
from llm_worker.types import causal_mask
from llm_worker.verify.tree import TreeBuffers

_PREFILL_ROWS = 1024  # the largest forward whose attention invariance is checked (prefill chunks: 256)
GROUPED_MAX_ROWS = 32  # calls of up to this many rows run their attention grouped (decode steps, trees)


@dataclass
class _Part:
    """One call's place in a forward over several, with its attention mask."""

    state: KVState
    row: int  # its first row in the forward
    n: int  # its rows
    start: int  # its committed length: the cache slot of its first row
    mask: torch.Tensor  # [n, T] its attention mask (``_bias``)
    bias: torch.Tensor | None = None  # [group · n, T] the mask repeated per query head of a group

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.n)

    @property
    def pooled(self) -> bool:
        return self.state.pool is not None and self.n <= GROUPED_MAX_ROWS


@dataclass
class _Group:
    """Pooled calls whose attention runs as one batched GEMM chain over the pool's slots lo..hi
    (``TorchOps._grouped``); slots in between that are not members compute zero queries whose
    results are dropped."""

    lo: int
    hi: int
    n_max: int  # query tokens per slot: every member's rows, padded with zero queries
    rows: torch.Tensor  # [m] the members' rows in the forward
    slots: torch.Tensor  # [m] each row's slot
    cache: torch.Tensor  # [m] each row's cache position (its call's start + its row)
    dest: torch.Tensor  # [m] each row's place among the group's queries: (slot − lo) · n_max + row
    bias: torch.Tensor  # [slots, rows, T] masks, query rows laid out as ``_grouped``'s (``_query_rows``)


@dataclass
class _Layout:
    """``TorchOps``'s layout of a forward: each call's mask, the pooled calls' group."""

    parts: list[_Part]
    grouped: _Group | None
    total: int
    pad: int

    @property
    def pool(self) -> KVPool:
        """The pool of the grouped calls."""
        assert self.grouped is not None
        pool = next(p.state.pool for p in self.parts if p.bias is None)
        assert pool is not None
        return pool


class TorchOps:
    """``ops.Ops`` in torch operations (see the module docstring)."""

    name = "torch"

    def __init__(self, ctx: OpsContext) -> None:
        self.ctx = ctx
        info = ctx.info
        self.device, self.attn_dtype, self.dtype, self.chunk = (
            ctx.device,
            ctx.attn_dtype,
            ctx.dtype,
            ctx.chunk,
        )
        self.kv_dtype = ctx.attn_dtype
        self.group = info.num_heads // info.num_kv_heads
        self.attention_rows = attention_min_rows(
            info.num_kv_heads, self.group, info.head_dim, ctx.chunk, _PREFILL_ROWS, ctx.device, ctx.attn_dtype
        )  # query rows attention's batched GEMMs are padded to (measured here: invariant from it)
        self.grouped_attention = self._grouped_exact()
        """Whether pooled requests' attention runs grouped (``_grouped``): checked bitwise against
        ``_attention`` on this machine (batched GEMMs whose rows do not depend on the batch)."""

    # -- what the forward asks ------------------------------------------------------------------

    def scope(self, own_threads: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def choose_kernels(self, weights: Weights, requested: str) -> KernelChoice:
        """Among ``kernels``' candidates for this device and dtype (torch's BLAS call, oneDNN's
        prepacked GEMM, the fused kernels' own), by measurement (``kernels.requested_kernels``)."""
        c = self.ctx
        return requested_kernels(requested, c.info.fingerprint, weights, c.device, c.dtype)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> Linear:
        return Linear(weight, bias, kernel)

    def norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add, then RMSNorm of each row (one fused kernel, float32 inside)."""
        if delta is not None:
            h = h + delta
        return h, F.rms_norm(h, weight.shape, weight, eps)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def logits(self, head: Linear, h: torch.Tensor) -> torch.Tensor:
        return head(h).float()

    def branching_rows_limit(self, length: int) -> int | None:
        """Rows up to the next key-chunk boundary. A tree node's key sits at slot start + row of
        the cache, where decoding it alone puts it at start + depth; inside one chunk that only
        moves it past zeros of its siblings (no-ops of the chunk's sequential reduction), but a
        node whose key crossed into the next chunk would be summed in another chunk than alone."""
        return self.chunk - length % self.chunk

    def variant(self) -> str:
        return f"-c{self.chunk}-a{self.attention_rows}"

    def describe(self) -> dict[str, Any]:
        return {
            "fused_kernels": False,
            "attention_chunk": self.chunk,
            "attention_min_rows": self.attention_rows,
            "grouped_attention": self.grouped_attention,
        }

    def layout(self, calls: Sequence[CallRows], total: int, pad: int) -> _Layout:
        parts: list[_Part] = []
        for call in calls:
            part = _Part(call.state, call.row, call.n, call.start, self._bias(call.start, call.n, call.tree))
            if not (self.grouped_attention and part.pooled):
                part.bias = part.mask.repeat(self.group, 1)  # [group · n, T], rows as in _attention's qg
            parts.append(part)
        return _Layout(parts, self._group(parts), total, pad)

    def rope_store(
        self, layout: _Layout, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        info, total = self.ctx.info, layout.total
        heads, kv_heads, head_dim = info.num_heads, info.num_kv_heads, info.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv = qkv[:total].to(self.attn_dtype)  # [total, (q + 2 kv) d]
        qk_rows = qkv[:, : q_size + kv_size].view(total, heads + kv_heads, head_dim)
        qk = self._rotate(qk_rows, cos[:, None], sin[:, None])
        q, k = qk[:, :heads], qk[:, heads:]  # [total, heads, d], [total, kv, d]
        v = qkv[:, q_size + kv_size :].view(total, kv_heads, head_dim)
        grouped = layout.grouped
        if grouped is not None:
            pool = layout.pool
            pool.keys[layer][grouped.slots, :, grouped.cache] = k[grouped.rows]
            pool.values[layer][grouped.slots, :, grouped.cache, :head_dim] = v[grouped.rows]
        for part in layout.parts:
            if part.bias is None:
                continue  # grouped above
            start, end, rows = part.start, part.start + part.n, part.rows
            keys, values = part.state.keys[layer, 0], part.state.values[layer, 0]  # [kv, capacity, d]
            keys[:, start:end] = k[rows].transpose(0, 1)
            values[:, start:end, :head_dim] = v[rows].transpose(0, 1)
        return q

    def attention(self, layout: _Layout, layer: int, q: torch.Tensor) -> torch.Tensor:
        info = self.ctx.info
        attn = q.new_empty(layout.total, info.num_heads * info.head_dim)
        grouped = layout.grouped
        if grouped is not None:
            pool = layout.pool
            span = slice(grouped.lo, grouped.hi)
            attn[grouped.rows] = self._grouped(
                q[grouped.rows],
                pool.keys[layer][span],
                pool.values[layer][span],
                grouped.bias,
                grouped.dest,
                grouped.n_max,
            )
        for part in layout.parts:
            if part.bias is None:
                continue  # grouped above
            keys, values = part.state.keys[layer, 0], part.state.values[layer, 0]
            attn[part.rows] = self._attention(q[part.rows], keys, values, part.bias)  # [n, heads · d]
        attn = attn.to(self.dtype)
        return F.pad(attn, (0, 0, 0, layout.pad)) if layout.pad else attn

    # -- attention ------------------------------------------------------------------------

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """RoPE of x [n, heads, d] with cos and sign-folded sin [n, 1, d] (``cos``, ``sin_signed``):
        x·cos + (x2, x1)·(−sin1, sin2) = transformers' x·cos + (−x2, x1)·sin, the negation moved
        into the table (exact)."""
        n, heads, d = x.shape
        swapped = x.view(n, heads, 2, d // 2).flip(2).view(n, heads, d)  # (x2, x1)
        return x * cos + swapped * sin_signed

    def _attention(
        self,
        q: torch.Tensor,  # [n, heads, d] post-RoPE queries
        keys: torch.Tensor,  # [kv, capacity, d] this layer's cache, the new rows written
        values: torch.Tensor,  # [kv, capacity, d + 1] values, then a column of ones
        bias: torch.Tensor,  # [group · n, T] 0 where the query row may see the key, −inf elsewhere
    ) -> torch.Tensor:
        """Attention over the first T = chunks · C cached keys, row by row invariant: [n, heads · d].

        Scores are one GEMM over the head dimension, then scaled and the mask added;
        exp(score − row max) is elementwise (the max is exact in any order); then one GEMM per key
        chunk of C keys multiplies the weights by the values *and* by the ones column, so the
        numerator and the softmax denominator come out of the same sequential reduction over the
        chunk's keys, in which a blocked key (weight exactly 0) is a no-op wherever it sits. The
        chunks accumulate in order and the numerator is divided by the denominator. A query's
        result depends only on its own visible keys and the chunk each falls in: more rows in the
        forward add blocked keys and all-zero chunks only. Query head h reads KV head h // group
        (transformers' ``repeat_kv``).
        """
        n, heads, d = q.shape
        kv = keys.shape[0]
        group, t = heads // kv, bias.shape[1]
        c = self.chunk
        qg = q.view(n, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * n, d)  # [kv, group·n, d]
        pad = self.attention_rows
        scores = (
            pad_rows_bmm(qg, keys[:, :t].transpose(1, 2), pad).mul_(1.0 / math.sqrt(d)).add_(bias)
        )  # [kv, g·n, T]
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # [kv, group·n, T]
        total = pad_rows_bmm(weights[:, :, :c], values[:, :c], pad)  # [kv, group·n, d + 1]
        for start in range(c, t, c):  # (a plain bmm and an add: baddbmm was 2x slower at these shapes)
            total += pad_rows_bmm(weights[:, :, start : start + c], values[:, start : start + c], pad)
        out = total[..., :d] / total[..., d:]
        return out.view(kv, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)

    def _grouped(
        self,
        q: torch.Tensor,  # [m, heads, d] post-RoPE queries of every member's rows
        keys: torch.Tensor,  # [slots, kv, capacity, d] the pool's slots lo..hi, new rows written
        values: torch.Tensor,  # [slots, kv, capacity, d + 1]
        bias: torch.Tensor,  # [slots, group · n_max, T] (``_Group.bias``)
        dest: torch.Tensor,  # [m] each row's place among the slots' queries (``_Group.dest``)
        n_max: int,
    ) -> torch.Tensor:
        """``_attention`` of several requests at once: [m, heads · d], each row bit-identical to
        its request's own ``_attention``. The queries of slot s are laid out [kv, n_max · group, d]
        (a zero query where a slot has fewer rows; zero rows up to ``attention_rows``), the slots
        stacked along the batch dimension of
        the same two batched GEMMs (scores over T keys, then weights · values chunk by chunk), so
        a request's rows see its own keys and mask in the same reduction grid as alone: a row's
        GEMM results do not depend on the batch or the row count (``_grouped_exact`` checks it on
        this machine), a key beyond the request's own T is blocked (its weight exactly 0) and so
        are all-zero trailing chunks (x + 0 = x)."""
        _, heads, d = q.shape
        slots, kv = keys.shape[0], keys.shape[1]
        group, t, c = heads // kv, bias.shape[2], self.chunk
        used, rows = n_max * group, bias.shape[1]  # query rows, and padded to the GEMMs' minimum
        queries = q.new_zeros(slots * n_max, heads, d).index_copy_(0, dest, q)
        qg = queries.view(slots, n_max, kv, group, d).permute(0, 2, 1, 3, 4).reshape(slots * kv, used, d)
        if rows > used:
            qg = F.pad(qg, (0, 0, 0, rows - used))
        k = keys[:, :, :t].reshape(slots * kv, t, d)
        v = values[:, :, :t].reshape(slots * kv, t, d + 1)
        scores = torch.bmm(qg, k.transpose(1, 2)).mul_(1.0 / math.sqrt(d))  # [slots · kv, rows, T]
        scores.view(slots, kv, rows, t).add_(bias[:, None])
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        total = torch.bmm(weights[:, :, :c], v[:, :c])  # [slots · kv, rows, d + 1]
        for start in range(c, t, c):
            total += torch.bmm(weights[:, :, start : start + c], v[:, start : start + c])
        out = total[:, :used, :d] / total[:, :used, d:]
        out = out.view(slots, kv, n_max, group, d).permute(0, 2, 1, 3, 4).reshape(slots * n_max, heads * d)
        return out.index_select(0, dest)

    def _grouped_exact(self) -> bool:
        """Whether ``_grouped`` gives every row bitwise what ``_attention`` gives its request alone,
        on random caches of mixed lengths, row counts and group sizes, on this machine."""
        i = self.ctx.info
        gen = torch.Generator().manual_seed(0)
        c, kv, d, group = self.chunk, i.num_kv_heads, i.head_dim, i.num_heads // i.num_kv_heads
        capacity = 3 * c
        keys = torch.randn(4, kv, capacity, d, generator=gen).to(self.device, self.attn_dtype)
        values = torch.randn(4, kv, capacity, d + 1, generator=gen).to(self.device, self.attn_dtype)
        values[..., -1] = 1
        calls = [(c - 1, 1), (2 * c + 5, 3), (0, 1), (3 * c - 7, 2)]  # (start, rows) per slot
        for members in ([0], [1], [0, 1], [0, 1, 2, 3], [1, 3]):
            n_max = max(calls[s][1] for s in members)
            starts_ends = [(calls[s][0], calls[s][0] + calls[s][1]) for s in members]
            t = max(-(-end // c) * c for _, end in starts_ends)
            lo, hi = min(members), max(members) + 1
            bias = torch.zeros(hi - lo, n_max, t, dtype=self.attn_dtype, device=self.device)
            queries: list[torch.Tensor] = []
            dest: list[int] = []
            alone: list[torch.Tensor] = []
            for s, (start, end) in zip(members, starts_ends, strict=True):
                n = end - start
                mask = self._bias(start, n, None)
                bias[s - lo, :n, : mask.shape[1]] = mask
                bias[s - lo, :n, mask.shape[1] :] = float("-inf")
                q = torch.randn(n, i.num_heads, d, generator=gen).to(self.device, self.attn_dtype)
                queries.append(q)
                dest.extend((s - lo) * n_max + r for r in range(n))
                alone.append(self._attention(q, keys[s], values[s], mask.repeat(group, 1)))
            together = self._grouped(
                torch.cat(queries),
                keys[lo:hi],
                values[lo:hi],
                self._query_rows(bias),
                torch.tensor(dest, device=self.device),
                n_max,
            )
            if not torch.equal(together, torch.cat(alone)):
                return False
        return True

    def _bias(self, start: int, n: int, tree: TreeBuffers | None) -> torch.Tensor:
        """[n, T] additive mask: 0 where row i may look, −inf elsewhere.

        Row i sees the committed prefix and, among the new rows, its tree ancestors and itself
        (a chain: rows 0..i). T is the end of the new rows rounded up to whole key chunks."""
        end = start + n
        t = -(-end // self.chunk) * self.chunk
        allowed = torch.zeros(n, t, dtype=torch.bool, device=self.device)
        allowed[:, :start] = True
        if tree is not None:
            allowed[:, start:end] = tree.mask.to(self.device)
        else:
            allowed[:, start:end] = causal_mask(n).to(self.device)
        bias = torch.zeros(n, t, dtype=self.attn_dtype, device=self.device)
        return bias.masked_fill_(~allowed, float("-inf"))

    def _group(self, parts: Sequence[_Part]) -> _Group | None:
        """Lay out the pooled calls' grouped attention (``_grouped``), or None if there are fewer
        than two."""
        members = [p for p in parts if p.bias is None]
        if len(members) < 2:  # one request: its own attention is the same, with fewer operations
            for p in members:
                p.bias = p.mask.repeat(self.ctx.info.num_heads // self.ctx.info.num_kv_heads, 1)
            return None
        lo = min(p.state.slot for p in members)
        hi = max(p.state.slot for p in members) + 1
        n_max = max(p.n for p in members)
        t = max(p.mask.shape[1] for p in members)
        bias = torch.zeros(hi - lo, n_max, t, dtype=self.attn_dtype, device=self.device)
        rows: list[int] = []
        slots: list[int] = []
        cache: list[int] = []
        dest: list[int] = []
        for p in members:
            slot = p.state.slot
            bias[slot - lo, : p.n, : p.mask.shape[1]] = p.mask
            bias[slot - lo, : p.n, p.mask.shape[1] :] = float("-inf")
            rows.extend(range(p.row, p.row + p.n))
            slots.extend([slot] * p.n)
            cache.extend(range(p.start, p.start + p.n))
            dest.extend(range((slot - lo) * n_max, (slot - lo) * n_max + p.n))

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return _Group(
            lo,
            hi,
            n_max,
            index(rows),
            index(slots),
            index(cache),
            index(dest),
            self._query_rows(bias),
        )

    def _query_rows(self, bias: torch.Tensor) -> torch.Tensor:
        """[slots, n_max, T] token masks → [slots, rows, T], a row per query head of a group and
        zero rows (which see every key) up to ``attention_rows``: ``_grouped``'s layout."""
        group = self.ctx.info.num_heads // self.ctx.info.num_kv_heads
        rows = bias.repeat_interleave(group, dim=1)
        extra = self.attention_rows - rows.shape[1]
        return F.pad(rows, (0, 0, 0, extra)) if extra > 0 else rows


@register("torch")
def torch_ops(ctx: OpsContext) -> TorchOps:
    return TorchOps(ctx)
