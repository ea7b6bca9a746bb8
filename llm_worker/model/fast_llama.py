"""A lean forward for Llama-family checkpoints over a preallocated KV cache.

Same weights and the same arithmetic as transformers' forward (tests compare the two), with
what speculative decoding needs built in:

- the KV cache is one preallocated buffer per request: a commit moves at most the accepted
  rows, never re-concatenates the whole cache;
- any tree attention mask, position ids from tree depths;
- the hidden state of any layer and the post-RoPE query of any head, at no extra cost.

q/k/v and gate/up projections are fused into one matrix each (the module weights become
views of the fused matrices, so no memory is duplicated).

Covers model types whose forward is the Llama one: llama, mistral (no sliding window inside
the context), qwen2 (q/k/v biases).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llm_worker.model.target import ForwardOutput, SequenceState, TargetInfo, TargetModel
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import TreeBuffers

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
_GROW = 512  # KV capacity grows in steps of this many positions


def unsupported_reason(model: Any) -> str | None:
    """Why the fast path cannot run ``model`` (None if it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model type {cfg.model_type!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases are not supported"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return "sliding-window attention is not supported"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 is not supported"
    return None


def packed_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class _Linear:
    """y = x W^T + b, with a second, oneDNN-prepacked copy of W for forwards of many rows."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packed_rows: tuple[int, int] | None
    ) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out]
        self.lo, self.hi = packed_rows or (1, 0)
        self.packed = None
        if packed_rows is not None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [1, n, in] → [1, n, out]."""
        if self.packed is not None and self.lo <= x.shape[-2] <= self.hi:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    ln_attn: torch.Tensor  # [hidden]
    qkv: _Linear  # [hidden] → [(heads + 2 * kv_heads) * head_dim]
    o: _Linear  # [heads * head_dim] → [hidden]
    ln_mlp: torch.Tensor  # [hidden]
    gate_up: _Linear  # [hidden] → [2 * intermediate]
    down: _Linear  # [intermediate] → [hidden]


class _KVState(SequenceState):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.length = 0
        self.keys = keys  # [layers, 1, kv_heads, capacity, head_dim]
        self.values = values  # [layers, 1, kv_heads, capacity, head_dim]


def _fuse(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate Linear weights along the output dim; the modules then view the fused matrix."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


def _fuse_bias(linears: Sequence[torch.nn.Linear]) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    parts = [
        lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
        for lin in linears
    ]
    return torch.cat(parts).contiguous()


class FastLlamaTarget(TargetModel):
    def __init__(self, model: Any, info: TargetInfo, packed_gemm_rows: tuple[int, int] | None = None) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast backend: {reason}")
        self.model = model
        self.info = info
        self.device = torch.device(info.device)
        cfg = model.config
        self.eps = float(cfg.rms_norm_eps)
        self.dtype = model.get_input_embeddings().weight.dtype
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight.detach()
        rows = packed_gemm_rows if packed_gemm_available(self.device, self.dtype) else None
        self.packed_gemm_rows = rows
        head = model.lm_head
        self.lm_head = _Linear(head.weight.detach(), head.bias, rows)
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            o_bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
            self.layers.append(
                _Layer(
                    ln_attn=layer.input_layernorm.weight.detach(),
                    qkv=_Linear(_fuse(qkv), _fuse_bias(qkv), rows),
                    o=_Linear(attn.o_proj.weight.detach(), o_bias, rows),
                    ln_mlp=layer.post_attention_layernorm.weight.detach(),
                    gate_up=_Linear(_fuse([mlp.gate_proj, mlp.up_proj]), None, rows),
                    down=_Linear(mlp.down_proj.weight.detach(), None, rows),
                )
            )

    @property
    def supports_queries(self) -> bool:
        return True

    @property
    def kernel_variant(self) -> str:
        rows = self.packed_gemm_rows
        return "" if rows is None else f"-packed{rows[0]}to{rows[1]}"

    # -- KV state ---------------------------------------------------------------------------

    def start(self) -> SequenceState:
        return _KVState(*self._buffers(_GROW))

    def _buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.info
        shape = (i.num_layers, 1, i.num_kv_heads, capacity, i.head_dim)
        return (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    def _reserve(self, state: _KVState, needed: int) -> None:
        capacity = state.keys.shape[3]
        if needed <= capacity:
            return
        wanted = max(needed, min(capacity * 2, self.info.max_context + _GROW))
        new_capacity = -(-wanted // _GROW) * _GROW
        keys, values = self._buffers(new_capacity)
        keys[:, :, :, : state.length] = state.keys[:, :, :, : state.length]
        values[:, :, :, : state.length] = state.values[:, :, :, : state.length]
        state.keys, state.values = keys, values

    def keys(self, state: SequenceState, layer: int) -> torch.Tensor:
        assert isinstance(state, _KVState)
        return state.keys[layer, 0, :, : state.length]

    def commit(self, state: SequenceState, rows: Sequence[int]) -> None:
        assert isinstance(state, _KVState)
        rows = list(rows)
        start = state.length
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.device) + start
            dest = slice(start, start + len(rows))
            state.keys[:, :, :, dest] = state.keys.index_select(3, index)
            state.values[:, :, :, dest] = state.values.index_select(3, index)
        state.length = start + len(rows)

    # -- forward ----------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        state: SequenceState,
        tokens: torch.Tensor,
        tree: TreeBuffers | None,
        needs: ArtifactNeeds,
        last_logits_only: bool = False,
    ) -> ForwardOutput:
        assert isinstance(state, _KVState)
        info = self.info
        n = int(tokens.shape[0])
        start = state.length
        end = start + n  # KV rows written; positions only reach start + the deepest row
        offsets = tree.position_offsets if tree is not None else torch.arange(n)
        last_position = start + int(offsets[-1] if tree is None else offsets.max())
        if last_position >= info.max_context:
            raise ValueError(
                f"context of {last_position + 1} tokens exceeds the model's limit of {info.max_context}"
            )
        self._reserve(state, end)
        heads, kv_heads, head_dim = info.num_heads, info.num_kv_heads, info.head_dim

        positions = (offsets + start).to(self.device)[None]  # [1, n]
        h = self.embed(tokens.to(self.device)[None])  # [1, n, hidden]
        cos, sin = self.rotary(h, positions)  # [1, n, head_dim]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, n, head_dim]

        mask = None  # n == 1: the single row sees the whole cache
        causal = n > 1 and start == 0 and tree is None  # a first prefill: plain causal attention
        if n > 1 and not causal:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device)
            if tree is not None:
                mask[:, start:] = tree.mask.to(self.device)
            else:
                mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()

        wanted_heads: dict[int, list[int]] = {}
        for layer_index, head in needs.query_heads:
            wanted_heads.setdefault(layer_index, []).append(head)
        out = ForwardOutput(logits=torch.empty(0))
        if 0 in needs.hidden_layers:
            out.hidden[0] = h[0]

        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln_attn)
            qkv = layer.qkv(x)  # [1, n, (heads + 2 kv) * head_dim]
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = self._rotate(q.view(1, n, heads, head_dim).transpose(1, 2), cos, sin)  # [1, heads, n, d]
            k = self._rotate(k.view(1, n, kv_heads, head_dim).transpose(1, 2), cos, sin)  # [1, kv, n, d]
            v = v.view(1, n, kv_heads, head_dim).transpose(1, 2)
            state.keys[index, :, :, start:end] = k
            state.values[index, :, :, start:end] = v
            for head in wanted_heads.get(index, ()):
                out.queries[(index, head)] = q[0, head]
            attn = F.scaled_dot_product_attention(
                q,
                state.keys[index, :, :, :end],
                state.values[index, :, :, :end],
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=heads != kv_heads,
            )  # [1, heads, n, d]
            h = h + layer.o(attn.transpose(1, 2).reshape(1, n, q_size))
            gate, up = layer.gate_up(self._rms(h, layer.ln_mlp)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
            if index + 1 in needs.hidden_layers and index + 1 < len(self.layers):
                out.hidden[index + 1] = h[0]
        h = self._rms(h, self.norm)
        if (
            len(self.layers) in needs.hidden_layers
        ):  # the last layer's state after the final norm, as in transformers
            out.hidden[len(self.layers)] = h[0]
        if last_logits_only:
            h = h[:, -1:]
        out.logits = self.lm_head(h)[0].float()
        return out
