"""The EDD draft network: one decoder layer of the target's architecture over a *soft prompt*.

EDD ("Faster Speculative Decoding via Effective Draft Decoder with Pruned Candidate Tree", ACL
2025). The draft's input sequence is two parts at the same positions:

1. the soft prompt: the target's hidden states of layer L (``prompt_layer``: 0 = embeddings,
   l = after decoder layer l) at the committed positions 0 .. T-2;
2. the draft block: the (frozen, shared) target embeddings of the root (position T-1, the last
   committed token, which has no hidden state yet) and of the draft tokens after it.

One decoder layer (RMSNorm, grouped-query self-attention with the target's RoPE, SwiGLU MLP),
a final RMSNorm and a head over a reduced draft vocabulary (``d2t``: draft id → target id). A
block row at position p predicts the token at p + 1. Because the network is one layer deep, a
soft-prompt position's K/V depend on its own hidden state only: the soft prompt is never a query,
and its K/V are computed once per committed position (``prompt_kv``) and kept per request.

The *dual-block mask* (training): positions fall in blocks of random lengths; a block row at p
in the block starting at s sees the soft prompt at positions < s and the block's token rows
s .. p — at inference the block starts at the root, so depth k of a chain reads a soft prompt k
positions stale, as in training. Example: blocks [0, 3), [3, 5): row 4 sees soft prompt 0 .. 2
and token rows 3, 4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llm_worker.drafters.glide_net import attend, rotate, target_shape


@dataclass(frozen=True)
class EddConfig:
    """The draft network's shape (the target's attention and MLP shapes) and its soft prompt."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab: int
    """V: rows of the draft head (the reduced vocabulary)."""
    prompt_layer: int
    """L: the target hidden state read as the soft prompt (0 = embeddings, l = after layer l)."""
    min_block: int = 1
    max_block: int = 8
    """Training's dual-block mask: block lengths drawn uniformly from [min_block, max_block]."""
    rms_eps: float = 1e-5
    shared_head: bool = False
    """The head is the target's output rows of the draft vocabulary, frozen (the paper's
    setting): a checkpoint leaves it out and the loader takes it from the target."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> EddConfig:
        unknown = set(data) - set(EddConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown EDD config fields {sorted(unknown)}")
        return EddConfig(**data)


def dual_block_allowed(starts: torch.Tensor) -> torch.Tensor:
    """The dual-block mask: ``starts`` [B, N] the start of each position's block →
    [B, 1, N, 2N] bool over (soft prompt 0 .. N-1, token rows 0 .. N-1).

    Row p sees soft prompt j < starts[p] and token rows starts[p] <= j <= p. Example: starts
    [0, 0, 2] → row 2 sees soft prompt 0, 1 and token row 2 only."""
    n = starts.shape[-1]
    j = torch.arange(n, device=starts.device)
    p = j[:, None]  # [N, 1] the row's own position
    s = starts[..., None]  # [B, N, 1]
    prompt = j[None, None, :] < s  # [B, N, N]
    tokens = (j[None, None, :] >= s) & (j[None, None, :] <= p[None])
    return torch.cat((prompt, tokens), dim=-1)[:, None]


def random_block_starts(length: int, lo: int, hi: int, generator: torch.Generator) -> torch.Tensor:
    """[length] the start of each position's block, blocks of lengths drawn from [lo, hi].
    Example: lengths 3, 2 → [0, 0, 0, 3, 3]."""
    starts = torch.empty(length, dtype=torch.long)
    at = 0
    while at < length:
        size = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        starts[at : at + size] = at
        at += size
    return starts


class EddNet(nn.Module):
    """The layer, final norm and the reduced-vocabulary head. Token embeddings are the target's
    (not parameters here): callers pass embedded tokens and hidden states in."""

    def __init__(self, cfg: EddConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.ln_prompt = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.ln_in = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.q = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.ln_mlp = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.head = nn.Linear(h, cfg.draft_vocab, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, n, self.cfg.head_dim).transpose(1, 2)  # [B, n, L, d]

    def prompt_kv(
        self,
        hidden: torch.Tensor,  # [B, P, hidden] the target's layer-L states
        cos: torch.Tensor,  # [B, P, d] RoPE of their positions
        sin: torch.Tensor,  # [B, P, d]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The soft prompt's keys (after RoPE) and values, each [B, kv, P, d]."""
        a = self.ln_prompt(hidden)
        k = rotate(self._heads(self.k(a), self.cfg.num_kv_heads), cos[:, None], sin[:, None])
        return k, self._heads(self.v(a), self.cfg.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,  # [B, L, hidden] embedded block tokens
        cos: torch.Tensor,  # [B, L, d] RoPE of each row's position
        sin: torch.Tensor,  # [B, L, d]
        past: tuple[torch.Tensor, torch.Tensor],  # K/V before these rows [B, kv, K, d] each
        allowed: torch.Tensor,  # [B|1, 1, L, K + L] bool
        rows: torch.Tensor | None = None,  # [B, L] bool: the rows whose logits are wanted
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Logits over the draft vocabulary ([B, L, V], or [m, V] for the m rows of ``rows``)
        and these rows' own K/V [B, kv, L, d] (for later rows of the block to read)."""
        cfg = self.cfg
        b, length, _ = x.shape
        cos, sin = cos[:, None], sin[:, None]
        a = self.ln_in(x)
        q = rotate(self._heads(self.q(a), cfg.num_heads), cos, sin)
        k = rotate(self._heads(self.k(a), cfg.num_kv_heads), cos, sin)
        v = self._heads(self.v(a), cfg.num_kv_heads)
        keys = torch.cat((past[0].expand(b, -1, -1, -1), k), dim=2)
        values = torch.cat((past[1].expand(b, -1, -1, -1), v), dim=2)
        out = attend(q, keys, values, allowed)
        x = x + self.o(out.transpose(1, 2).reshape(b, length, -1))
        m = self.ln_mlp(x)
        x = x + self.down(F.silu(self.gate(m)) * self.up(m))
        if rows is not None:
            x = x[rows]
        return self.head(self.norm(x)), (k, v)


def default_prompt_layer(num_layers: int) -> int:
    """The paper's soft prompt: the 4th hidden state from the last (at least layer 1):
    ``default_prompt_layer(32)`` → 28."""
    return max(num_layers - 4, 1)


def edd_config_for(model: Any, draft_vocab: int, **overrides: Any) -> EddConfig:
    """The draft's shape for a Llama-family target (``glide_net.target_shape``); the soft prompt
    is the 4th hidden state from the last unless ``prompt_layer`` says otherwise."""
    layer = default_prompt_layer(int(model.config.num_hidden_layers))
    fields = {**target_shape(model), "draft_vocab": int(draft_vocab), "prompt_layer": layer, **overrides}
    return EddConfig(**fields)


def init_from_target(net: EddNet, model: Any, d2t: torch.Tensor) -> None:
    """Warm start: the layer from the target's decoder layer that reads hidden state L (the
    last one where L is the last hidden state), its norms for both inputs, the final norm from
    the target's, and the head from the target's output rows of the draft vocabulary ``d2t`` [V]."""
    layers = model.model.layers
    source = layers[min(net.cfg.prompt_layer, len(layers) - 1)]
    attn, mlp = source.self_attn, source.mlp
    with torch.no_grad():
        net.ln_prompt.weight.copy_(source.input_layernorm.weight.float())
        net.ln_in.weight.copy_(source.input_layernorm.weight.float())
        for mine, theirs in (
            (net.q, attn.q_proj),
            (net.k, attn.k_proj),
            (net.v, attn.v_proj),
            (net.o, attn.o_proj),
            (net.gate, mlp.gate_proj),
            (net.up, mlp.up_proj),
            (net.down, mlp.down_proj),
        ):
            mine.weight.copy_(theirs.weight.float())
        net.ln_mlp.weight.copy_(source.post_attention_layernorm.weight.float())
        net.norm.weight.copy_(model.model.norm.weight.float())
        net.head.weight.copy_(target_head_rows(model, d2t))


def target_head_rows(model: Any, d2t: torch.Tensor) -> torch.Tensor:
    """The target's output rows of the draft vocabulary ``d2t`` [V]: [V, hidden], float32."""
    head = model.get_output_embeddings().weight
    return head.detach().float()[d2t.to(head.device)]
