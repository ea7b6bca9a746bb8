"""A hand-built 2-layer Llama whose only induction head is layer 1, head 1.

No training: every weight is written down so that the model implements the textbook induction
circuit (Olsson et al., 2022) and nothing else. Given ``... a b ... a`` it predicts ``b``: on a
repeated random sequence (``A B C D E ... A B C``) greedy decoding continues by copying.

Residual stream (hidden size 3 V + 1, or 3 V + 2 with a spare zero coordinate to make it even;
V = vocabulary size), one subspace per role:

- ``TOK``  [0, V): the token's one-hot, written by the embedding;
- ``CONST`` V: a constant 1 in every embedding row. Every row has the same norm, so after
  RMSNorm this coordinate is the same at every position: attention can read position from it
  only through RoPE;
- ``PREV`` [V + 1, 2 V + 1): the previous token's one-hot, written by layer 0;
- ``OUT`` [2 V + 1, 3 V + 1): the predicted token's one-hot, written by layer 1 and read by
  ``lm_head``.

The MLPs are zero and every RMSNorm weight is 1, so the only computation is attention:

- **Layer 0, head 0 — previous-token head.** q and k read only ``CONST``. In each of the
  highest-frequency rotary pairs k = (r, 0) and q = k rotated back by that pair's angle per
  position w_i, so after RoPE q_m · k_n = r² Σ_i cos((m - n - 1) w_i): a Dirichlet-like kernel
  that peaks at key n = m - 1 and is lower by at least ~0.8 r² at every other offset. r is set so
  that the peak beats the runner-up by ``PREV_GAP`` logits. V copies ``TOK`` and O writes it
  into ``PREV``. (At position 0 the head can only attend to itself, so ``PREV`` there holds
  the token itself; the induction key below discounts that.)
- **Layer 1, head 1 — induction head.** q reads ``TOK`` (the current token a), k reads
  ``PREV - TOK / 2``, so key n scores high exactly when the token before n is a: the query at
  t attends to the position right after an earlier occurrence of x_t, and V/O copy that
  position's token into ``OUT``. The ``- TOK / 2`` makes position 0 (whose ``PREV`` is its own
  token) only a half match. q and k sit in the lowest-frequency rotary pairs, where rope_theta
  = 1e6 barely rotates anything over ``seq_limit`` positions, so RoPE leaves the content match
  intact. One more rotary pair, reading ``CONST`` on both sides, adds a small term that falls
  with distance: among equal matches the most recent one wins (as ``copy_source`` ranks
  them), by a margin far above float32 rounding.
- Layer 0 head 1 and layer 1 head 0 are all zero.
- ``lm_head`` reads ``OUT`` (identity times a scale giving the copied token a ``OUT_LOGIT``
  lead), so greedy decoding copies.

Attention logits are q · k / sqrt(head_dim), as in transformers' Llama.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import transformers

HEAD_DIM = 64
ROPE_THETA = 1e6
PREV_PAIRS = 8  # highest-frequency rotary pairs used by the previous-token head
PREV_GAP = 30.0  # logits by which the previous-token head prefers position t - 1
MATCH_LOGIT = 40.0  # induction logit of a full content match (position 0 gets half)
RECENCY_LOGIT = 2.0  # amplitude of the induction head's distance term (it varies by < 1.4 logits)
RECENCY_PHASE = 0.3  # rad: keeps the distance term strictly decreasing from distance 0
OUT_LOGIT = 30.0  # logit of the copied token when the induction head attends to one place


def rotary_frequencies(head_dim: int = HEAD_DIM, theta: float = ROPE_THETA) -> np.ndarray:
    """[head_dim / 2] radians per position of rotary pair i (coordinates i and i + head_dim / 2)."""
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def induction_model(vocab: int = 16, seq_limit: int = 128) -> transformers.LlamaForCausalLM:
    """The hand-built induction model (float32, eval mode) for contexts up to ``seq_limit``."""
    half = HEAD_DIM // 2
    freqs = rotary_frequencies()
    # The distance pair: the fastest one that turns at most 1 rad over the whole context.
    recency_pair = int(np.flatnonzero(freqs * seq_limit <= 1.0)[0])
    content_pairs = list(range(half - 1, half - 1 - math.ceil(vocab / 2), -1))  # slowest first
    if not PREV_PAIRS <= recency_pair < content_pairs[-1]:
        raise ValueError(f"vocab {vocab} and seq_limit {seq_limit} do not fit head_dim {HEAD_DIM}")
    if freqs[content_pairs[-1]] * seq_limit > 0.05:
        raise ValueError(f"vocab {vocab}: content pairs would rotate too far over {seq_limit} positions")
    content_coords = [p + side * half for p in content_pairs for side in (0, 1)][:vocab]  # token a -> coord

    tok = torch.arange(vocab)
    const = vocab
    prev = vocab + 1 + tok
    out = 2 * vocab + 1 + tok
    hidden = 3 * vocab + 2 - vocab % 2  # 3 V + 1 rounded up to even (heads | hidden); a spare dim stays 0
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=seq_limit,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg)

    # RMSNorm scales each residual vector to norm sqrt(hidden); these are the resulting values of
    # a unit coordinate at layer 0 (token + const), layer 1 (+ prev) and the final norm (+ out).
    norm0, norm1, norm2 = (math.sqrt(hidden / n) for n in (2, 3, 4))
    scale = math.sqrt(HEAD_DIM)  # attention logits are q · k / scale

    embed = torch.zeros(vocab, hidden)
    embed[tok, tok] = 1.0
    embed[:, const] = 1.0

    # Layer 0, head 0 (rows / columns 0 .. HEAD_DIM-1): previous-token head.
    q0, k0, v0 = (torch.zeros(2 * HEAD_DIM, hidden) for _ in range(3))  # [2 * head_dim, hidden]
    o0 = torch.zeros(hidden, 2 * HEAD_DIM)
    offsets = np.arange(-1, seq_limit - 1)  # (query - key) - 1 over all causal pairs
    kernel = np.cos(np.outer(offsets, freqs[:PREV_PAIRS])).sum(axis=1)  # [seq_limit]
    gap = PREV_PAIRS - kernel[offsets != 0].max()
    r = math.sqrt(PREV_GAP * scale / gap)
    for i in range(PREV_PAIRS):
        k0[i, const] = r / norm0
        q0[i, const] = r * math.cos(freqs[i]) / norm0
        q0[i + half, const] = -r * math.sin(freqs[i]) / norm0
    v0[tok, tok] = 1.0 / norm0
    o0[prev, tok] = 1.0

    # Layer 1, head 1 (rows / columns HEAD_DIM .. 2 HEAD_DIM-1): induction head.
    q1, k1, v1 = (torch.zeros(2 * HEAD_DIM, hidden) for _ in range(3))
    o1 = torch.zeros(hidden, 2 * HEAD_DIM)
    s = math.sqrt(MATCH_LOGIT * scale) / norm1
    rows = HEAD_DIM + torch.tensor(content_coords)
    q1[rows, tok] = s
    k1[rows, prev] = s
    k1[rows, tok] = -s / 2
    # Distance term: RECENCY_LOGIT · cos(phase + distance · w), falling from distance 0 on.
    b = math.sqrt(RECENCY_LOGIT * scale) / norm1
    k1[HEAD_DIM + recency_pair, const] = b
    q1[HEAD_DIM + recency_pair, const] = b * math.cos(RECENCY_PHASE)
    q1[HEAD_DIM + recency_pair + half, const] = b * math.sin(RECENCY_PHASE)
    v1[HEAD_DIM + tok, tok] = 1.0 / norm1
    o1[out, HEAD_DIM + tok] = 1.0

    lm_head = torch.zeros(vocab, hidden)
    lm_head[tok, out] = OUT_LOGIT / norm2

    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
        for layer, (q, k, v, o) in zip(model.model.layers, ((q0, k0, v0, o0), (q1, k1, v1, o1)), strict=True):
            layer.self_attn.q_proj.weight.copy_(q)
            layer.self_attn.k_proj.weight.copy_(k)
            layer.self_attn.v_proj.weight.copy_(v)
            layer.self_attn.o_proj.weight.copy_(o)
    return model.float().eval().requires_grad_(False)
