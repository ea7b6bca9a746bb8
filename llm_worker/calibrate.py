"""The calibration run that finds a model's induction heads (see ``drafters.heads``).

Greedy decoding of the calibration prompts; at each generated token with a copy source, every
head whose attention from the predicting query peaks at that source scores a hit. Attention is
computed from the cached keys and each head's query — no eager attention over the whole model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from llm_worker.drafters.heads import HeadsFile, copy_source, rank_heads
from llm_worker.model.target import SequenceState, TargetModel
from llm_worker.types import ArtifactNeeds
from specdraft.tokenizer import Tokenizer


def attention_argmax(
    target: TargetModel, state: SequenceState, queries: dict[tuple[int, int], torch.Tensor]
) -> np.ndarray:
    """[layers, heads]: the key position each head attends to most from the last cached position.

    queries: (layer, head) -> [head_dim] the query at that position.
    """
    info = target.info
    group = info.num_heads // info.num_kv_heads
    scale = 1.0 / math.sqrt(info.head_dim)
    out = np.zeros((info.num_layers, info.num_heads), dtype=np.int64)
    kv_of_head = torch.arange(info.num_heads) // group
    for layer in range(info.num_layers):
        keys = target.keys(state, layer).float()  # [kv_heads, length, head_dim]
        q = torch.stack([queries[(layer, h)] for h in range(info.num_heads)]).float()  # [heads, head_dim]
        scores = torch.einsum("hd,hld->hl", q, keys[kv_of_head]) * scale
        out[layer] = scores.argmax(dim=-1).numpy()
    return out


def calibrate_heads(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    progress: Callable[[int, int], None] | None = None,
) -> HeadsFile:
    info = target.info
    if not target.supports_queries:
        raise ValueError(f"calibration reads per-head queries; the {info.backend} backend has none")
    needs = ArtifactNeeds(
        query_heads=tuple((ly, h) for ly in range(info.num_layers) for h in range(info.num_heads))
    )
    eos = set(info.eos_token_ids)
    hits = np.zeros((info.num_layers, info.num_heads), dtype=np.int64)
    events = 0
    with torch.inference_mode():
        for index, prompt in enumerate(prompts):
            state = target.start()
            tokens = np.array(prompt, dtype=np.int64)
            out = target.forward(state, torch.tensor(tokens), None, needs)
            target.commit(state, range(len(tokens)))
            for _ in range(max_new_tokens):
                if len(tokens) + 1 > info.max_context:
                    break
                queries = {key: q[-1] for key, q in out.queries.items()}
                nxt = int(out.logits[-1].argmax())
                tokens = np.append(tokens, nxt)
                source = copy_source(tokens, len(tokens) - 1)
                if source is not None:
                    events += 1
                    hits += attention_argmax(target, state, queries) == source
                if nxt in eos:
                    break
                out = target.forward(state, torch.tensor([nxt]), None, needs)
                target.commit(state, [0])
            if progress is not None:
                progress(index + 1, len(prompts))
    return HeadsFile(info.name, info.fingerprint, tuple(rank_heads(hits, events)), events, len(prompts))


def calibrate_to_file(
    target: TargetModel,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    max_new_tokens: int,
    out: Path | None = None,
    ship: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[HeadsFile, Path]:
    """Calibrate on ``texts`` (each one user turn of the chat template) and save the heads: to
    ``out``; with ``ship``, into the package data (one file for every dtype of these weights);
    else into the user cache, where ``pld+a`` looks first."""
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.drafters.heads import save_heads, shipped_heads_path, user_heads_dir

    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    heads = calibrate_heads(target, prompts, max_new_tokens, progress=progress)
    if out is None:
        out = (
            shipped_heads_path(target.info.weights_id)
            if ship
            else user_heads_dir() / f"{target.info.fingerprint}.json"
        )
    return heads, save_heads(heads, out)


def read_prompt_texts(path: Path) -> list[str]:
    """Calibration prompts: one per non-empty line, plain text or JSON with a ``prompt`` field."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
