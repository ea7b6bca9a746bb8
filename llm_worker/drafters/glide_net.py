"""The GLIDE draft network: a small decoder that glimpses the target's KV cache.

Each draft layer does, on the residual stream of the draft tokens' (frozen, shared) target
embeddings:

1. causal self-attention over the draft's own earlier tokens (its own small KV cache);
2. cross-attention into the target's cached K/V of one of its last layers — the keys exactly as
   the target cached them (after RoPE), grouped-query heads as in the target: the draft's query
   gets RoPE at its own position, so query and key rotate as in the target's own attention;
3. the MLP; then the final norm and a head over a reduced draft vocabulary (``d2t`` maps a
   draft id to a target id, so a draft can never name a token outside the target vocabulary).

The *stale cache*: at inference the target's cache ends before the root (the root's K/V come
with the next verify), so a draft token at depth k sees the target's K/V only up to k positions
before it. Training reproduces this with a block-wise cross mask (GLIDE): positions fall in
blocks of ``block_size``; a position sees the target's K/V of earlier blocks only. A row that
would see nothing (the first block) sees position 0, in training and at inference alike.

``cross_attention=False`` is the ablation ("vanilla"): the same network without step 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GlideConfig:
    """The draft network's shape; the attention shapes are the target's."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab: int
    """V: rows of the draft head (the reduced vocabulary)."""
    target_layer: int
    """Whose cached K/V the cross-attention reads (0-based decoder layer of the target)."""
    num_layers: int = 1
    block_size: int = 5
    """Training's cross mask: a position sees the target's K/V of earlier blocks only."""
    cross_attention: bool = True
    rms_eps: float = 1e-5

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> GlideConfig:
        known = set(GlideConfig.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown GLIDE config fields {sorted(unknown)}")
        return GlideConfig(**data)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as in transformers' Llama: x [..., L, d] with cos/sin [..., L, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: q [B, heads, Lq, d], k/v [B, kv, Lk, d], allowed [B|1, 1, Lq, Lk]
    bool (every row must allow at least one key) → [B, heads, Lq, d]."""
    b, heads, lq, d = q.shape
    if q.is_cuda:
        # CUDA's fused attention kernels read whole 16-byte rows: a view of the target's value
        # cache (head_dim + 1 columns a row) ends in a misaligned address there; a copy does not
        k, v = k.contiguous(), v.contiguous()
    group = heads // k.shape[1]
    if group > 1:  # query heads of one KV head side by side as rows: K/V are read in place
        q = q.reshape(b, k.shape[1], group * lq, d)
        allowed = allowed.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return out.reshape(b, heads, lq, d)


def cross_allowed(query_pos: torch.Tensor, key_count: int, limit: torch.Tensor) -> torch.Tensor:
    """[B, 1, Lq, key_count] bool: query i sees target positions < max(limit[b, i], 1).

    ``limit``: [B, Lq] the first target position a query may not see (training: its block's
    start; inference: ``min(position, cached)``)."""
    keys = torch.arange(key_count, device=query_pos.device)
    return (keys[None, None, :] < limit.clamp(min=1)[..., None])[:, None]


def block_limit(positions: torch.Tensor, block_size: int, shift: int = 0) -> torch.Tensor:
    """Training's block mask: the start of each position's block (blocks begin at ``shift``
    modulo ``block_size``). ``positions`` [B, L] → [B, L]. Example: block 5, position 7 → 5."""
    return positions - (positions - shift) % block_size


class GlideLayer(nn.Module):
    def __init__(self, cfg: GlideConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.ln_self = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.q = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.cross_attention:
            self.ln_cross = nn.RMSNorm(h, eps=cfg.rms_eps)
            self.cq = nn.Linear(h, cfg.num_heads * d, bias=False)
            self.co = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.ln_mlp = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, n, self.cfg.head_dim).transpose(1, 2)  # [B, n, L, d]

    def forward(
        self,
        x: torch.Tensor,  # [B, L, hidden]
        cos: torch.Tensor,  # [B, 1, L, d]
        sin: torch.Tensor,  # [B, 1, L, d]
        past: tuple[torch.Tensor, torch.Tensor] | None,  # own K/V [B, kv, P, d] before these rows
        self_allowed: torch.Tensor,  # [B|1, 1, L, P + L]
        target_kv: tuple[torch.Tensor, torch.Tensor] | None,  # [B, kv, S, d] each
        cross_mask: torch.Tensor | None,  # [B|1, 1, L, S]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        b, length, _ = x.shape
        a = self.ln_self(x)
        q = rotate(self._heads(self.q(a), cfg.num_heads), cos, sin)
        k = rotate(self._heads(self.k(a), cfg.num_kv_heads), cos, sin)
        v = self._heads(self.v(a), cfg.num_kv_heads)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        out = attend(q, k, v, self_allowed)
        x = x + self.o(out.transpose(1, 2).reshape(b, length, -1))
        if cfg.cross_attention:
            assert target_kv is not None and cross_mask is not None
            cq = rotate(self._heads(self.cq(self.ln_cross(x)), cfg.num_heads), cos, sin)
            out = attend(cq, target_kv[0].to(cq.dtype), target_kv[1].to(cq.dtype), cross_mask)
            x = x + self.co(out.transpose(1, 2).reshape(b, length, -1))
        m = self.ln_mlp(x)
        x = x + self.down(F.silu(self.gate(m)) * self.up(m))
        return x, (k, v)


class GlideNet(nn.Module):
    """Layers, final norm and the reduced-vocabulary head. The token embeddings are the
    target's (frozen, not parameters here): callers pass embedded tokens in."""

    def __init__(self, cfg: GlideConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(GlideLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, L, hidden] embedded tokens
        cos: torch.Tensor,  # [B, L, d] RoPE of each row's position
        sin: torch.Tensor,  # [B, L, d]
        self_allowed: torch.Tensor,  # [B|1, 1, L, P + L] bool
        target_kv: tuple[torch.Tensor, torch.Tensor] | None,  # the target's cached K/V [B, kv, S, d]
        cross_mask: torch.Tensor | None,  # [B|1, 1, L, S] bool
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,  # per layer [B, kv, P, d]
        rows: torch.Tensor | None = None,  # [B, L] bool: the rows whose logits are wanted
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits over the draft vocabulary and each layer's K/V (past + these rows). Logits are
        [B, L, V], or [m, V] for the m rows of ``rows`` (in order): the head, the network's
        largest matrix, then runs on those rows only."""
        cos, sin = cos[:, None], sin[:, None]
        present = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, past[i] if past else None, self_allowed, target_kv, cross_mask)
            present.append(kv)
        if rows is not None:
            x = x[rows]
        return self.head(self.norm(x)), present


def init_from_target(net: GlideNet, model: Any, d2t: torch.Tensor, layer_index: int) -> None:
    """Warm start: every draft layer's self-attention and MLP from the target's decoder layer
    ``layer_index``, its cross-attention from the attention of the layer it reads (whose cached
    keys its query must match), the final norm from the target's, and the head from the target's
    output rows of the draft vocabulary ``d2t`` [V]."""
    source = model.model.layers[layer_index]
    attn, mlp = source.self_attn, source.mlp
    read = model.model.layers[net.cfg.target_layer]
    with torch.no_grad():
        for layer in net.layers:
            assert isinstance(layer, GlideLayer)
            layer.ln_self.weight.copy_(source.input_layernorm.weight.float())
            for mine, theirs in ((layer.q, attn.q_proj), (layer.k, attn.k_proj), (layer.v, attn.v_proj)):
                mine.weight.copy_(theirs.weight.float())
            layer.o.weight.copy_(attn.o_proj.weight.float())
            if net.cfg.cross_attention:
                layer.ln_cross.weight.copy_(read.input_layernorm.weight.float())
                layer.cq.weight.copy_(read.self_attn.q_proj.weight.float())
                layer.co.weight.copy_(read.self_attn.o_proj.weight.float())
            layer.ln_mlp.weight.copy_(source.post_attention_layernorm.weight.float())
            layer.gate.weight.copy_(mlp.gate_proj.weight.float())
            layer.up.weight.copy_(mlp.up_proj.weight.float())
            layer.down.weight.copy_(mlp.down_proj.weight.float())
        net.norm.weight.copy_(model.model.norm.weight.float())
        net.head.weight.copy_(model.lm_head.weight.float()[d2t.to(model.lm_head.weight.device)])


def target_shape(model: Any) -> dict[str, Any]:
    """A Llama-family target's layer shape, as a one-layer drafter copies it: hidden size, MLP
    width, attention heads, KV heads, head size, the norm's epsilon."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    return dict(
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
    )


def glide_config_for(model: Any, draft_vocab: int, **overrides: Any) -> GlideConfig:
    """The draft's shape for a Llama-family target (``target_shape``); the cross-attention reads
    the target's last layer unless ``target_layer`` says otherwise."""
    last = int(model.config.num_hidden_layers) - 1
    fields = {**target_shape(model), "draft_vocab": int(draft_vocab), "target_layer": last, **overrides}
    return GlideConfig(**fields)


def rope_tables(model: Any, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] from the target's own rotary embedding (its scaling,
    its theta), float32."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        raise ValueError("GLIDE needs a target with rotary position embeddings (a Llama-family model)")
    device = next(iter(rotary.buffers()), torch.empty(0)).device  # where the target lives
    positions = torch.arange(max_positions, device=device)[None]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rotary(probe, positions)
    return cos[0].float().cpu(), sin[0].float().cpu()
