"""EDD's draft network at inference on the fused CPU kernels, through the target's operations
(``llm_worker.model.ops_cpu.FusedCpuOps``), as ``glide_fused`` runs GLIDE's.

Through torch operations one draft forward of the one-layer network cost a third of a target
step on the 2-core reference CPU, for a few microseconds of arithmetic: a dozen small calls, each
paying torch's dispatch and its OpenMP threads spinning against the fused kernels' pool. Here:

- the GEMMs (the soft prompt's K/V, Q/K/V, O, gate·up, down, the head over the draft vocabulary)
  run through ``quant_linear`` with the draft's weights rounded once at load to 8-bit blocks of 32
  (Q8_0; the shared head's rows are the target's own Q8_0 rows, so for them the rounding changes
  nothing). The draft's guesses may differ from the float32 network's in a near-tie; the target's
  verification decides every token, so outputs cannot;
- residual add + RMSNorm and SiLU·up fused;
- one growing key/value buffer per request: the soft prompt's K/V at positions 0 .. P-1 (written
  once per committed position), then the current step's block rows after them (overwritten every
  step). A block row reads the whole soft prompt (the attention's committed prefix) and the block
  rows on its own path (the attention's ``visible`` rows), so a tree needs no mask over the prompt.

The soft prompt's keys are rotated in torch (a few hundred numbers a position); the block rows'
queries and keys in the fused ``rope_store``.
"""

from __future__ import annotations

import math

import torch

from llm_worker.drafters.edd_net import EddNet
from llm_worker.drafters.glide_fused import DraftKV, fits_fused, new_draft_kv, reserve
from llm_worker.drafters.glide_net import rotate
from llm_worker.model.ops_cpu import FusedCpuOps


class FusedEdd:
    """``EddNet``'s inference forward on the fused kernels (see the module docstring)."""

    def __init__(self, net: EddNet, ops: FusedCpuOps, cos: torch.Tensor, sin: torch.Tensor) -> None:
        cfg = net.cfg
        self.cfg, self.ops = cfg, ops
        linear = ops.quantized_linear

        def vector(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().float().contiguous()

        self.cos, self.sin = cos, sin  # [max_context, d] as EddNet's (transformers' convention)
        half = cfg.head_dim // 2  # the fused RoPE's sine: the rotated half's sign folded in
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=1).contiguous()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.ln_prompt, self.ln_in = vector(net.ln_prompt.weight), vector(net.ln_in.weight)
        self.ln_mlp, self.norm = vector(net.ln_mlp.weight), vector(net.norm.weight)
        self.prompt_kv = linear(net.k.weight, net.v.weight)
        self.qkv = linear(net.q.weight, net.k.weight, net.v.weight)
        self.o = linear(net.o.weight)
        self.gate_up = linear(net.gate.weight, net.up.weight)
        self.down = linear(net.down.weight)
        self.head = linear(net.head.weight)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this copy of the network holds."""
        held = [self.cos, self.sin, self.sin_signed, self.ln_prompt, self.ln_in, self.ln_mlp, self.norm]
        for linear in (self.prompt_kv, self.qkv, self.o, self.gate_up, self.down, self.head):
            held += linear.tensors()
        return held

    @staticmethod
    def supports(net: EddNet) -> bool:
        cfg = net.cfg
        return fits_fused(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size)

    def new_kv(self) -> DraftKV:
        return new_draft_kv(1, self.cfg.num_kv_heads, self.cfg.head_dim)

    def extend_prompt(self, kv: DraftKV, hidden: torch.Tensor) -> None:
        """The soft prompt's K/V of ``hidden`` [n, hidden] (the target's states at positions
        kv.length ..) written after the first kv.length positions."""
        cfg = self.cfg
        n, start, width = hidden.shape[0], kv.length, cfg.num_kv_heads * cfg.head_dim
        reserve(kv, start + n)
        _, a = self.ops.norm(hidden.float().contiguous(), None, self.ln_prompt, cfg.rms_eps)
        kv_rows = self.prompt_kv(a)  # [n, 2 kv d]
        positions = slice(start, start + n)
        k = kv_rows[:, :width].view(n, cfg.num_kv_heads, cfg.head_dim)
        k = rotate(k, self.cos[positions, None], self.sin[positions, None])
        kv.keys[0][0, :, positions] = k.transpose(0, 1)
        kv.values[0][0, :, positions] = (
            kv_rows[:, width:].view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        )
        kv.length = start + n

    def rows(
        self,
        kv: DraftKV,
        x: torch.Tensor,  # [m, hidden] float32 embedded block tokens
        positions: torch.Tensor,  # [m] long: their sequence positions
        block: int,  # block rows before these (at buffer positions kv.length ..)
        visible: torch.Tensor,  # [m, block + m] bool: the block rows each new row reads (itself included)
    ) -> torch.Tensor:
        """Draft logits [m, V] of m new block rows; their K/V written after the block's first
        ``block`` rows."""
        cfg, ops = self.cfg, self.ops
        m, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
        prompt = kv.length
        reserve(kv, prompt + block + m)
        keys, values = kv.keys[0], kv.values[0]
        rows, slots = torch.arange(m), torch.zeros(m, dtype=torch.long)
        h, a = ops.norm(x.contiguous(), None, self.ln_in, cfg.rms_eps)
        qkv = self.qkv(a)  # [m, (heads + 2 kv) d]
        q = torch.empty(m, heads, d)
        cache = torch.arange(prompt + block, prompt + block + m)
        ops.rope_rows(
            qkv, self.cos[positions], self.sin_signed[positions], q, keys, values, rows, slots, cache
        )
        out = torch.empty(m, heads * d)
        starts = torch.full((m,), prompt, dtype=torch.long)
        ops.attend_rows(q, keys, values, rows, slots, starts, visible, self.scale, out)
        h, normed = ops.norm(h, self.o(out), self.ln_mlp, cfg.rms_eps)
        down = self.down(ops.activation(self.gate_up(normed)))
        _, a = ops.norm(h, down, self.norm, cfg.rms_eps)
        return self.head(a)
