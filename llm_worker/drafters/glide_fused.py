"""GLIDE's draft network at inference on the fused CPU kernels, through the target's operations
(``llm_worker.model.ops_cpu.FusedCpuOps``).

Run through torch operations, one draft token cost about as much as a whole target token on the
2-core reference CPU (c ≈ 1.2, most of it OpenMP start-up and the threads of one library spinning
against the other's): a dozen small GEMMs and two attentions per token, each a few microseconds of
arithmetic. Here the same network runs on the kernels the target's fast forward uses:

- GEMMs through ``quant_linear`` on the fused kernels' own thread pool, the draft's weights rounded
  once at load to 8-bit blocks of 32 (Q8_0: per block a float16 scale, relative error below
  0.4 %; 1.1 bytes a weight instead of 4). The draft's guesses may differ from the float32
  network's in a near-tie; the target's verification decides every token, so outputs cannot;
- residual add + RMSNorm and SiLU·up fused;
- self-attention over the draft's own KV (a growing buffer per request, written in place instead
  of concatenated each step) and cross-attention straight on the target's cache buffers (no copy),
  both through the fused attention: a query row reads the committed prefix [0, start) of its
  slot, the self-attention also the new rows it may see.

RoPE and the cache write of the self-attention's queries and keys run in the fused ``rope_store``
as the target's do; the cross-attention's queries are rotated in torch (a few hundred numbers a
row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

import torch

from llm_worker.drafters.glide_net import GlideLayer, GlideNet, rope_tables, rotate
from llm_worker.model.forward import Forward
from llm_worker.model.kernels import Linear
from llm_worker.model.ops_cpu import FusedCpuOps
from llm_worker.model.target import KVBuffers, TargetModel
from llm_worker.types import causal_mask

_GROW = 256  # the draft's own KV grows in steps of this many positions


def fused_ops(target: TargetModel) -> FusedCpuOps | None:
    """The target's operations when they are the fused CPU kernels (else None: the draft network
    runs in torch)."""
    ops = target.ops if isinstance(target, Forward) else None
    return ops if isinstance(ops, FusedCpuOps) else None


@dataclass
class _Layer:
    ln_self: torch.Tensor
    qkv: Linear
    o: Linear
    ln_cross: torch.Tensor | None
    cq: Linear | None
    co: Linear | None
    ln_mlp: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class DraftKV:
    """The draft network's own keys and values of one request: per layer [1, kv, capacity, d]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0
    offset: int = 0  # the sequence position of entry 0 (a window that starts after the prompt's start)


class FusedCopy(Protocol):
    """A draft network's copy on the fused kernels (``FusedGlide``, ``edd_fused.FusedEdd``)."""

    def tensors(self) -> list[torch.Tensor]: ...


NetT = TypeVar("NetT", bound=torch.nn.Module)
FastT = TypeVar("FastT", bound=FusedCopy)


@dataclass(eq=False)
class DraftNetwork(Generic[NetT, FastT]):
    """What every drafter of one learned checkpoint and target shares, whatever its mode's
    options: the network, its draft vocabulary, the checkpoint's ``meta``, the RoPE tables and,
    on the fast backend's fused kernels, the network's 8-bit copy (``glide.GlideNetwork``,
    ``edd.EddNetwork``)."""

    target: TargetModel
    net: NetT
    d2t: torch.Tensor  # [V] target id of each draft id
    meta: dict[str, Any]
    cos: torch.Tensor  # [max_context, head_dim]
    sin: torch.Tensor  # [max_context, head_dim]
    fast: FastT | None
    """The network on the fused kernels; None where they are off (--no-fused) or do not fit."""

    FUSED: ClassVar[Any]
    """The fused copy's class (``FusedGlide``, ``edd_fused.FusedEdd``): built from (net, ops,
    cos, sin), its ``supports(net)`` says whether the network fits the kernels."""

    @classmethod
    def build(
        cls, target: TargetModel, net: NetT, d2t: torch.Tensor, meta: dict[str, Any] | None = None
    ) -> Self:
        """The network for ``target`` in eval mode on the target's device (where the target's
        hidden states and KV cache are), its RoPE tables there and its fused copy (where the
        fused kernels are on and it fits them). ``d2t`` stays on the host: it maps draft ids to
        token ids there (and indexes a device tensor as well)."""
        device = torch.device(target.info.device)
        net = net.eval().to(device)
        cos, sin = rope_tables(target.model, target.info.max_context)
        cos, sin = cos.to(device), sin.to(device)
        ops = fused_ops(target)
        fast = cls.FUSED(net, ops, cos, sin) if ops is not None and cls.FUSED.supports(net) else None
        return cls(target, net, d2t, meta or {}, cos, sin, fast)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held here (``base.storage_bytes`` of them: its memory)."""
        fused = self.fast.tensors() if self.fast is not None else []
        return [*self.net.parameters(), *self.net.buffers(), self.d2t, self.cos, self.sin, *fused]


def fits_fused(hidden: int, heads: int, head_dim: int, intermediate: int) -> bool:
    """Whether a draft layer of these shapes runs on the fused kernels: every GEMM has whole
    blocks of 32 inputs, and the attention's heads a multiple of 8 numbers."""
    widths = (hidden, heads * head_dim, intermediate)
    return all(w % FusedCpuOps.quant_block == 0 for w in widths) and head_dim % 8 == 0


def new_draft_kv(layers: int, kv_heads: int, head_dim: int) -> DraftKV:
    """Per-layer buffers of ``_GROW`` positions, uninitialised: attention reads only positions
    written before (filling them cost a 2-core step as much as the rest of a draft forward)."""
    shape = (1, kv_heads, _GROW, head_dim)
    return DraftKV([torch.empty(shape) for _ in range(layers)], [torch.empty(shape) for _ in range(layers)])


def reserve(kv: DraftKV, needed: int) -> None:
    """Room in ``kv``'s buffers for ``needed`` positions (grown to a multiple of ``_GROW``, at least
    doubled; the first ``kv.length`` entries kept)."""
    capacity = kv.keys[0].shape[2]
    if needed <= capacity:
        return
    grown = -(-max(needed, 2 * capacity) // _GROW) * _GROW
    for i in range(len(kv.keys)):
        for buffers in (kv.keys, kv.values):
            old = buffers[i]
            new = old.new_empty(1, old.shape[1], grown, old.shape[3])
            new[:, :, : kv.length] = old[:, :, : kv.length]
            buffers[i] = new


class FusedGlide:
    """``GlideNet``'s inference forward on the fused kernels (see the module docstring)."""

    def __init__(self, net: GlideNet, ops: FusedCpuOps, cos: torch.Tensor, sin: torch.Tensor) -> None:
        cfg = net.cfg
        self.cfg, self.ops = cfg, ops
        _linear = ops.quantized_linear
        self.cos, self.sin = cos, sin  # [max_context, d] as GlideNet's (transformers' convention)
        half = cfg.head_dim // 2  # the fused RoPE's sine: the rotated half's sign folded in
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=1).contiguous()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.layers: list[_Layer] = []
        for layer in net.layers:
            assert isinstance(layer, GlideLayer)
            cross = cfg.cross_attention
            self.layers.append(
                _Layer(
                    ln_self=layer.ln_self.weight.detach().float().contiguous(),
                    qkv=_linear(layer.q.weight, layer.k.weight, layer.v.weight),
                    o=_linear(layer.o.weight),
                    ln_cross=layer.ln_cross.weight.detach().float().contiguous() if cross else None,
                    cq=_linear(layer.cq.weight) if cross else None,
                    co=_linear(layer.co.weight) if cross else None,
                    ln_mlp=layer.ln_mlp.weight.detach().float().contiguous(),
                    gate_up=_linear(layer.gate.weight, layer.up.weight),
                    down=_linear(layer.down.weight),
                )
            )
        self.norm = net.norm.weight.detach().float().contiguous()
        self.head = _linear(net.head.weight)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this copy of the network holds."""
        held = [self.cos, self.sin, self.sin_signed, self.norm, *self.head.tensors()]
        for layer in self.layers:
            held += [layer.ln_self, layer.ln_mlp, *layer.qkv.tensors(), *layer.o.tensors()]
            held += [*layer.gate_up.tensors(), *layer.down.tensors()]
            if layer.ln_cross is not None and layer.cq is not None and layer.co is not None:
                held += [layer.ln_cross, *layer.cq.tensors(), *layer.co.tensors()]
        return held

    @staticmethod
    def supports(net: GlideNet) -> bool:
        cfg = net.cfg
        return fits_fused(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size)

    def new_kv(self) -> DraftKV:
        cfg = self.cfg
        return new_draft_kv(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden] float32 embedded tokens at positions kv.length ..
        kv: DraftKV,
        target: KVBuffers | None,  # the target's cache of the layer the draft reads
        limits: torch.Tensor | None,  # [n] long: row j sees target positions < limits[j] (≥ 1)
    ) -> torch.Tensor:
        """The last row's draft logits [V]; the rows' own K/V appended to ``kv``."""
        cfg, ops = self.cfg, self.ops
        n, past = x.shape[0], kv.length
        heads, d = cfg.num_heads, cfg.head_dim
        reserve(kv, past + n)
        positions = torch.arange(kv.offset + past, kv.offset + past + n)
        rows = torch.arange(n)
        self_slot, self_start = torch.zeros(n, dtype=torch.long), torch.full((n,), past, dtype=torch.long)
        causal = causal_mask(n)
        cos, sin, sin_signed = self.cos[positions], self.sin[positions], self.sin_signed[positions]  # [n, d]
        cache_positions = torch.arange(past, past + n)
        if target is not None:
            assert limits is not None
            cross_slot = torch.full((n,), target.slot, dtype=torch.long)
            no_new_rows = torch.zeros(n, 0, dtype=torch.bool)
        h, a = ops.norm(x.contiguous(), None, self.layers[0].ln_self, cfg.rms_eps)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(a)  # [n, (heads + 2 kv) d]
            keys, values = kv.keys[index], kv.values[index]
            q = torch.empty(n, heads, d)
            # rotated queries into q, rotated keys and the values into the draft's own cache
            ops.rope_rows(qkv, cos, sin_signed, q, keys, values, rows, self_slot, cache_positions)
            out = torch.empty(n, heads * d)
            ops.attend_rows(q, keys, values, rows, self_slot, self_start, causal, self.scale, out)
            if layer.cq is not None and layer.co is not None and layer.ln_cross is not None:
                assert target is not None and limits is not None
                h, c = ops.norm(h, layer.o(out), layer.ln_cross, cfg.rms_eps)
                cq = rotate(layer.cq(c).view(n, heads, d), cos[:, None], sin[:, None]).contiguous()
                out = torch.empty(n, heads * d)
                ops.attend_rows(
                    cq, target.keys, target.values, rows, cross_slot, limits, no_new_rows, self.scale, out
                )
                h, m = ops.norm(h, layer.co(out), layer.ln_mlp, cfg.rms_eps)
            else:
                h, m = ops.norm(h, layer.o(out), layer.ln_mlp, cfg.rms_eps)
            down = layer.down(ops.activation(layer.gate_up(m)))
            last = index + 1 == len(self.layers)
            following = self.norm if last else self.layers[index + 1].ln_self
            h, a = ops.norm(h, down, following, cfg.rms_eps)
        kv.length = past + n
        return self.head(a[-1:].contiguous())[0]
