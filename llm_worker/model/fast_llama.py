"""A lean forward for Llama-family checkpoints over a preallocated KV cache.

Same weights and the same arithmetic as transformers' forward (tests compare the two), with
what speculative decoding needs built in:

- the KV cache is one preallocated buffer per request: a commit moves at most the accepted
  rows, never re-concatenates the whole cache;
- any tree attention mask, position ids from tree depths;
- the hidden state of any layer and the post-RoPE query of any head, at no extra cost;
- a batch of D drafts as D rows of one forward over the shared cache, which is read in place,
  never copied per row (``forward_batch`` / ``commit_batch``).

q/k/v and gate/up projections are fused into one matrix each (the module weights become
views of the fused matrices, so no memory is duplicated).

Covers model types whose forward is the Llama one: llama, mistral (no sliding window inside
the context), qwen2 (q/k/v biases).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llm_worker.model.target import BatchForwardOutput, ForwardOutput, SequenceState, TargetInfo, TargetModel
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
        self.batch_keys: torch.Tensor | None = None  # [layers, D, kv_heads, 1 + L, head_dim] last batch
        self.batch_values: torch.Tensor | None = None  # [layers, D, kv_heads, 1 + L, head_dim]


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

    def commit_batch(self, state: SequenceState, row: int, count: int) -> None:
        """Copy columns 0 .. count - 1 of batch row ``row`` (root + accepted tokens) into the cache."""
        assert isinstance(state, _KVState)
        if state.batch_keys is None or state.batch_values is None:
            raise RuntimeError("commit_batch without a forward_batch before it")
        start = state.length
        self._reserve(state, start + count)
        state.keys[:, 0, :, start : start + count] = state.batch_keys[:, row, :, :count]
        state.values[:, 0, :, start : start + count] = state.batch_values[:, row, :, :count]
        state.length = start + count
        state.batch_keys = state.batch_values = None

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

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """h: [1, n, hidden] → h plus the layer's MLP output."""
        gate, up = layer.gate_up(self._rms(h, layer.ln_mlp)).chunk(2, dim=-1)
        return h + layer.down(F.silu(gate) * up)

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
            h = self._mlp(layer, h + layer.o(attn.transpose(1, 2).reshape(1, n, q_size)))
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

    @staticmethod
    def _shared_prefix_attention(
        q: torch.Tensor,  # [D, heads, M, head_dim] post-RoPE queries of the D rows, M = 1 + L
        cached_k: torch.Tensor,  # [kv_heads, T, head_dim] the committed prefix, read in place
        cached_v: torch.Tensor,  # [kv_heads, T, head_dim]
        k: torch.Tensor,  # [D, kv_heads, M, head_dim] the rows' own keys
        v: torch.Tensor,  # [D, kv_heads, M, head_dim]
        own_mask: torch.Tensor,  # [D, 1, 1, M, M] bool, True = the query column may see the key column
    ) -> torch.Tensor:
        """Attention of every row over the shared prefix and its own columns: [D, heads, M, head_dim].

        The prefix scores fold the batch into the query axis — [kv, D·group·M, d] @ [kv, d, T] —
        which broadcasts the one cached K/V over the D rows without materialising D copies. The
        rows' own scores are a small [D, kv, group, M, M] block; both join in one softmax.
        Query head h reads KV head h // group, as in transformers' ``repeat_kv``.
        """
        rows, heads, m, head_dim = q.shape
        kv = k.shape[1]
        group, t = heads // kv, cached_k.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        qg = q.view(rows, kv, group, m, head_dim)  # [D, kv, group, M, d]
        folded = qg.permute(1, 0, 2, 3, 4).reshape(kv, rows * group * m, head_dim)  # [kv, D·group·M, d]
        prefix = torch.bmm(folded, cached_k.transpose(1, 2)).view(
            kv, rows, group, m, t
        )  # [kv, D, group, M, T]
        own = torch.matmul(qg, k[:, :, None].transpose(-1, -2))  # [D, kv, group, M, M]
        own = own.masked_fill(~own_mask, float("-inf"))
        scores = (
            torch.cat((prefix.permute(1, 0, 2, 3, 4), own), dim=-1).float() * scale
        )  # [D, kv, group, M, T + M]
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        p_prefix = (
            probs[..., :t].permute(1, 0, 2, 3, 4).reshape(kv, rows * group * m, t)
        )  # [kv, D·group·M, T]
        out = torch.bmm(p_prefix, cached_v).view(kv, rows, group, m, head_dim).permute(1, 0, 2, 3, 4)
        out = out + torch.matmul(probs[..., t:], v[:, :, None])  # [D, kv, group, M, d]
        return out.reshape(rows, heads, m, head_dim)

    def forward_batch(
        self,
        state: SequenceState,
        tokens: torch.Tensor,
        lengths: Sequence[int],
        needs: ArtifactNeeds,
    ) -> BatchForwardOutput:
        """D drafts as the D rows of one forward over the shared cache (see ``TargetModel``).

        Input [D, M] (M = 1 + L: the root, then row r, right-padded). All D·M positions go through
        the projections and MLPs as one [1, D·M, hidden] activation; attention splits per row:
        the committed prefix, read in place by every row (``_shared_prefix_attention``), plus the
        row's own columns, causally. A padding key is masked too; with trailing padding the
        causal mask already hides it from every real column, and pad columns, which nobody
        reads, still see the root, so no query is left without a key.

        The rows' new K/V stay aside ([layers, D, kv, M, d]) until ``commit_batch`` copies the
        chosen row's accepted columns into the cache; a step that commits nothing costs no copy.
        """
        assert isinstance(state, _KVState)
        info = self.info
        rows, m = int(tokens.shape[0]), int(tokens.shape[1])
        start = state.length
        if start + m - 1 >= info.max_context:
            raise ValueError(f"context of {start + m} tokens exceeds the model's limit of {info.max_context}")
        heads, kv_heads, head_dim = info.num_heads, info.num_kv_heads, info.head_dim
        dev = self.device

        positions = (torch.arange(m) + start).to(dev)[None]  # [1, M]: column c at start + c
        h = self.embed(tokens.to(dev).reshape(1, rows * m))  # [1, D·M, hidden]
        cos, sin = self.rotary(h, positions)  # [1, M, head_dim]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, M, head_dim], the same for every row
        col = torch.arange(m, device=dev)
        real = col[None, :] <= torch.tensor(list(lengths), device=dev)[:, None]  # [D, M] root + draft
        own_mask = (col[:, None] >= col[None, :])[None] & real[:, None, :]  # [D, M (query), M (key)]
        own_mask = own_mask[:, None, None]  # [D, 1, 1, M, M]

        new_shape = (info.num_layers, rows, kv_heads, m, head_dim)
        new_keys = torch.empty(new_shape, dtype=self.dtype, device=dev)  # [layers, D, kv, M, d]
        new_values = torch.empty(new_shape, dtype=self.dtype, device=dev)  # [layers, D, kv, M, d]

        wanted_heads: dict[int, list[int]] = {}
        for layer_index, head in needs.query_heads:
            wanted_heads.setdefault(layer_index, []).append(head)
        out = BatchForwardOutput(logits=torch.empty(0))
        if 0 in needs.hidden_layers:
            out.hidden[0] = h[0].view(rows, m, -1)

        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._rms(h, layer.ln_attn))  # [1, D·M, (heads + 2 kv) * head_dim]
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = self._rotate(q.view(rows, m, heads, head_dim).transpose(1, 2), cos, sin)  # [D, heads, M, d]
            k = self._rotate(k.view(rows, m, kv_heads, head_dim).transpose(1, 2), cos, sin)  # [D, kv, M, d]
            v = v.view(rows, m, kv_heads, head_dim).transpose(1, 2)  # [D, kv, M, d]
            new_keys[index] = k
            new_values[index] = v
            for head in wanted_heads.get(index, ()):
                out.queries[(index, head)] = q[:, head]
            attn = self._shared_prefix_attention(
                q, state.keys[index, 0, :, :start], state.values[index, 0, :, :start], k, v, own_mask
            )  # [D, heads, M, d]
            h = self._mlp(layer, h + layer.o(attn.transpose(1, 2).reshape(1, rows * m, q_size)))
            if index + 1 in needs.hidden_layers and index + 1 < len(self.layers):
                out.hidden[index + 1] = h[0].view(rows, m, -1)
        h = self._rms(h, self.norm)
        if len(self.layers) in needs.hidden_layers:
            out.hidden[len(self.layers)] = h[0].view(rows, m, -1)
        out.logits = self.lm_head(h)[0].float().view(rows, m, -1)  # [D, M, vocab]
        state.batch_keys, state.batch_values = new_keys, new_values
        return out
