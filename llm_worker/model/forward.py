"""The fast forward written once against ``ops.Ops``: weights fused for the GEMMs it runs, the
KV caches (``kv_pool``), each call's rows and positions, the layer loop and its outputs.

A subclass (``fast_llama.FastLlamaTarget``) loads a model into the attributes ``Forward``
documents and picks the operations; the loop here is the same for every implementation.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from llm_worker.model.artifacts import ARTIFACTS, Recording, Tap, TapSink
from llm_worker.model.kernels import Linear
from llm_worker.model.kv_pool import GROW, KVPool, KVState
from llm_worker.model.ops import CallRows, Ops
from llm_worker.model.target import (
    ForwardCall,
    ForwardOutput,
    KVBuffers,
    SequenceState,
    TargetInfo,
    TargetModel,
)
from llm_worker.types import ArtifactKey, ArtifactNeeds
from llm_worker.verify.tree import TreeBuffers

if TYPE_CHECKING:
    from llm_worker.model.graphs import StepGraphs


@dataclass
class Layer:
    ln_attn: torch.Tensor  # [hidden]
    qkv: Linear  # [hidden] → [(heads + 2 * kv_heads) * head_dim]
    o: Linear  # [heads * head_dim] → [hidden]
    ln_mlp: torch.Tensor  # [hidden]
    gate_up: Linear  # [hidden] → [2 * intermediate]
    down: Linear  # [intermediate] → [hidden]


def fuse(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate Linear weights along the output dim; the modules then view the fused matrix."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


def fuse_bias(linears: Sequence[torch.nn.Linear]) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    parts = [
        lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
        for lin in linears
    ]
    return torch.cat(parts).contiguous()


class Forward(TargetModel):
    """A Llama-shaped forward over a pool of KV caches, on ``ops``. Subclasses set the attributes
    below before the first call (``fast_llama.FastLlamaTarget``)."""

    info: TargetInfo
    device: torch.device
    ops: Ops
    eps: float
    embed: torch.nn.Module  # token ids → [n, hidden]
    layers: list[Layer]
    norm: torch.Tensor  # the final RMSNorm's weight
    lm_head: Linear
    cos: torch.Tensor  # [max_context, head_dim] every position's RoPE cos
    sin_signed: torch.Tensor  # [max_context, head_dim] its sin, the rotated half's sign folded in
    min_rows: int  # rows a forward is padded to (the GEMM kernels' smallest minimum)
    graphs: StepGraphs | None = None  # captured steps (``graphs``; CUDA, the Triton operations)
    own_threads: bool  # every GEMM runs on the fused kernels' pool (``Ops.scope``)
    _lock: threading.RLock  # forwards, commits and new states: the pool may move when it grows
    _pool: KVPool

    # -- KV state ---------------------------------------------------------------------------

    def start(self) -> SequenceState:
        with self._lock:
            slot = self._pool.acquire()
            if slot is not None:
                return KVState(self._pool, slot)
            keys, values = self._buffers(1, GROW)
            return KVState(None, -1, keys, values)

    def _buffers(self, slots: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [layers, slots, kv, capacity, d]; values [layers, slots, kv, capacity, d + 1] whose
        last column is 1 (the torch attention's softmax denominator, see ``TorchOps._attention``)."""
        i = self.info
        shape = (i.num_layers, slots, i.num_kv_heads, capacity, i.head_dim)
        kv_dtype = self.ops.kv_dtype
        values = torch.zeros((*shape[:-1], i.head_dim + 1), dtype=kv_dtype, device=self.device)
        values[..., -1] = 1
        return torch.zeros(shape, dtype=kv_dtype, device=self.device), values

    def _reserve(self, state: KVState, needed: int) -> None:
        """Capacity for ``needed`` positions, rounded up to a multiple of ``GROW`` (which the
        torch attention's key chunk divides)."""
        capacity = state.keys.shape[3]
        if needed <= capacity:
            return
        wanted = max(needed, min(capacity * 2, self.info.max_context + GROW))
        new_capacity = -(-wanted // GROW) * GROW
        if state.pool is not None:
            state.pool.reserve(new_capacity)
            return
        keys, values = self._buffers(1, new_capacity)
        keys[:, :, :, : state.length] = state.keys[:, :, :, : state.length]
        values[:, :, :, : state.length] = state.values[:, :, :, : state.length]
        state.set_buffers(keys, values)

    def branching_rows_limit(self, state: SequenceState) -> int | None:
        return self.ops.branching_rows_limit(state.length)

    def kv(self, state: SequenceState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(state, KVState)
        d = self.info.head_dim
        return state.keys[layer, 0, :, : state.length], state.values[layer, 0, :, : state.length, :d]

    def kv_buffers(self, state: SequenceState, layer: int) -> KVBuffers | None:
        assert isinstance(state, KVState)
        if state.pool is not None:
            return KVBuffers(state.pool.keys[layer], state.pool.values[layer], state.slot)
        return KVBuffers(state.keys[layer], state.values[layer], 0)

    def commit(self, state: SequenceState, rows: Sequence[int]) -> None:
        assert isinstance(state, KVState)
        rows = list(rows)
        start = state.length
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.device) + start
            dest = slice(start, start + len(rows))
            with self._lock:  # the pool must not move while the rows are copied
                keys, values = state.keys, state.values
                keys[:, :, :, dest] = keys.index_select(3, index)
                values[:, :, :, dest] = values.index_select(3, index)
        state.length = start + len(rows)

    @property
    def prefix_reuse(self) -> bool:
        return True  # every operation is row-invariant (``fast_llama``'s docstring)

    def export_kv(self, state: SequenceState, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(state, KVState)
        if not 0 <= start <= stop <= state.length:
            raise ValueError(f"positions {start}..{stop} are not committed (length {state.length})")
        with self._lock:  # the pool must not move while the rows are copied
            return (
                state.keys[:, 0, :, start:stop].clone(),
                state.values[:, 0, :, start:stop].clone(),
            )

    def import_kv(self, state: SequenceState, keys: torch.Tensor, values: torch.Tensor) -> None:
        assert isinstance(state, KVState)
        n = int(keys.shape[2])
        start = state.length
        if start + n > self.info.max_context:
            raise ValueError(f"{start + n} positions exceed the model's limit of {self.info.max_context}")
        with self._lock:
            self._reserve(state, start + n)
            state.keys[:, 0, :, start : start + n] = keys
            state.values[:, 0, :, start : start + n] = values
        state.length = start + n

    # -- forward ----------------------------------------------------------------------------

    def forward(
        self,
        state: SequenceState,
        tokens: torch.Tensor,
        tree: TreeBuffers | None,
        needs: ArtifactNeeds,
        last_logits_only: bool = False,
    ) -> ForwardOutput:
        return self.forward_many([ForwardCall(state, tokens, tree, needs, last_logits_only)])[0]

    def forward_many(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        """One forward over every call's rows: embeddings, norms, RoPE and the GEMMs run on all
        rows at once (each row-invariant, so a row's numbers do not depend on its neighbours);
        attention as the operations lay it out (``Ops.layout``), each row over its own cache."""
        with self._lock, self.ops.scope(self.own_threads):
            return self._forward_many(calls)

    def _place(self, calls: Sequence[ForwardCall]) -> list[CallRows]:
        """Check every call against the context limit, make room in its cache, and place its rows."""
        placed: list[CallRows] = []
        row = 0
        for call in calls:
            state = call.state
            assert isinstance(state, KVState)
            n = int(call.tokens.shape[0])
            tree = call.tree
            offsets = tree.position_offsets if tree is not None else torch.arange(n)
            start = state.length
            last_position = start + int(offsets.max())
            if last_position >= self.info.max_context:
                raise ValueError(
                    f"context of {last_position + 1} tokens exceeds the model's limit of "
                    f"{self.info.max_context}"
                )
            self._reserve(state, start + n)
            placed.append(CallRows(state, row, n, start, tree, offsets + start))
            row += n
        return placed

    def _forward_many(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        ops = self.ops
        placed = self._place(calls)
        total = placed[-1].row + placed[-1].n
        if self.graphs is not None:
            captured = self.graphs.run(calls, placed, total)
            if captured is not None:
                return captured
        # Fewer rows than the GEMM kernels' smallest minimum: zero rows are added to the embeddings
        # once here rather than in every GEMM (nothing reads their results). A GEMM whose kernel
        # needs more rows still pads its own input (``Linear``).
        pad = max(0, self.min_rows - total)
        layout = ops.layout(placed, total, pad)
        positions = torch.cat([p.positions for p in placed]).to(self.device)  # [total]
        cos, sin = self.cos[positions], self.sin_signed[positions]  # [total, d] each
        h = self.embed(step_tokens(calls).to(self.device))  # [total, hidden]
        if pad:
            h = F.pad(h, (0, 0, 0, pad))  # [total + pad, hidden]
        outs = Outputs(calls, [p.rows for p in placed], self)
        x = self.layer_loop(h, layout, cos, sin, outs.tap, total)
        return outs.with_logits(ops, self.lm_head, x)

    def layer_loop(
        self, h: torch.Tensor, layout: Any, cos: torch.Tensor, sin: torch.Tensor, tap: TapSink, total: int
    ) -> torch.Tensor:
        """The layers over the embedded rows h [rows, hidden] (``layout``: the operations' own,
        ``Ops.layout``), each tap's value handed to ``tap``; returns the final-normed states of
        the first ``total`` rows (the rest are padding). The eager forward and a captured step
        (``graphs``) run this same loop."""
        ops, eps = self.ops, self.eps
        tap("hidden", 0, h)  # the residual stream entering layer 0 is its hidden state
        tap("residual", 0, h)
        h, x = ops.norm(h, None, self.layers[0].ln_attn, eps)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            q = ops.rope_store(layout, index, layer.qkv(x), cos, sin)  # [total, heads, d]
            tap("query", index, q)
            h, x = ops.norm(h, layer.o(ops.attention(layout, index, q)), layer.ln_mlp, eps)
            down = layer.down(ops.activation(layer.gate_up(x)))
            if index < last:
                h, x = ops.norm(h, down, self.layers[index + 1].ln_attn, eps)
                tap("hidden", index + 1, h)
                tap("residual", index + 1, h)
            else:  # the final norm over the real rows (each row's numbers are its own)
                h, x = ops.norm(h[:total], down[:total], self.norm, eps)
        tap("residual", len(self.layers), h)  # the last layer's output before the final norm
        tap("hidden", len(self.layers), x)  # and after it
        return x

    @cached_property
    def taps(self) -> frozenset[Tap]:
        top = len(self.layers)
        states = {(name, i) for name in ("hidden", "residual") for i in range(top + 1)}
        return frozenset(states | {("query", i) for i in range(top)})


def step_tokens(calls: Sequence[ForwardCall]) -> torch.Tensor:
    """Every call's token ids in one forward's row order (the eager and the captured step's)."""
    return torch.cat([c.tokens for c in calls]) if len(calls) > 1 else calls[0].tokens


class Outputs:
    """The outputs of a forward over several calls (``spans``: each call's rows), filled in as the
    layers run: the artifacts each call's needs record, taken at the forward's taps
    (``llm_worker.model.artifacts``), then logits."""

    def __init__(
        self, calls: Sequence[ForwardCall], spans: Sequence[slice], target: Forward, logit_rows: bool = True
    ) -> None:
        """``logit_rows`` False: the caller picks each call's logits itself (a captured step)."""
        self.calls, self.spans = calls, spans
        self.logit_rows: torch.Tensor | None = None
        """[rows with logits] on the target's device: the rows the LM head reads in a forward over
        several calls (each call's rows, or its last). Copied there before the layers run: on a
        GPU a copy made after them would wait for every layer before the LM head could start."""
        if len(calls) > 1 and logit_rows:
            rows = [
                r
                for c, s in zip(calls, spans, strict=True)
                for r in range(s.stop - 1 if c.last_logits_only else s.start, s.stop)
            ]
            self.logit_rows = torch.tensor(rows, dtype=torch.long, device=target.device)
        self.outs = [ForwardOutput(logits=torch.empty(0)) for _ in calls]
        self.wanted: dict[Tap, list[tuple[Recording, slice, dict[ArtifactKey[Any], torch.Tensor]]]] = {}
        """tap -> what each call records there: how, its rows, where it goes."""
        for call, span, out in zip(calls, spans, self.outs, strict=True):
            for rec in ARTIFACTS.published(target, call.needs):
                self.wanted.setdefault(rec.tap, []).append((rec, span, out.artifacts))

    def tap(self, name: str, layer: int, value: torch.Tensor) -> None:
        """value [rows, ...]: the forward at tap (``name``, ``layer``), for the calls recording it."""
        if not self.wanted:
            return
        for rec, span, artifacts in self.wanted.get((name, layer), ()):
            artifacts[rec.key] = rec.select(rec.key, value, span)

    def with_logits(self, ops: Ops, lm_head: Linear, h: torch.Tensor) -> list[ForwardOutput]:
        """Logits of h [rows, hidden] (final-normed) for every row of a call, or its last row only
        (a prefill chunk needs no more)."""
        calls, spans = self.calls, self.spans
        if self.logit_rows is None:  # one call
            chosen = h[-1:] if calls[0].last_logits_only else h
        else:
            chosen = h[self.logit_rows]
        logits = ops.logits(lm_head, chosen)
        row = 0
        for call, span, out in zip(calls, spans, self.outs, strict=True):
            count = 1 if call.last_logits_only else span.stop - span.start
            out.logits = logits[row : row + count]
            row += count
        return self.outs
