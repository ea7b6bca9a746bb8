"""A GLIDE drafter trained in seconds for a tiny model: on the model's own greedy continuations
of random prompts, through the real trainer (``llm_worker.training``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from llm_worker.drafters.glide_net import glide_config_for
from llm_worker.training.features import Sequence_, _teacher_forced
from llm_worker.training.trainer import GlideTrainer, TrainConfig

TARGET_RECORD_KEYS = ("weights_id", "name", "vocab_size")


def own_sequences(model: Any, count: int, seed: int, prompt_len: int = 12, new: int = 48) -> list[Sequence_]:
    """``count`` random prompts continued greedily by ``model``; the loss covers the continuation."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    layer = model.config.num_hidden_layers - 1
    out = []
    for _ in range(count):
        prompt = torch.tensor([rng.integers(1, vocab - 1, size=prompt_len).tolist()])
        with torch.inference_mode():
            ids = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)[0].tolist()
        forced = _teacher_forced(model, [ids], layer)[0]
        assert forced.keys is not None and forced.values is not None
        k, v, h = forced.keys, forced.values, forced.final
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[prompt_len - 1 : -1] = True
        labelled = torch.ones(len(ids), dtype=torch.bool)
        labelled[-1] = False  # the last position has no next token
        out.append(Sequence_(torch.tensor(ids), mask, k.half(), v.half(), h[labelled].half(), labelled))
    return out


def train_tiny_glide(
    model: Any, info: Any, out_dir: Path, steps: int = 150, vanilla: bool = False, vocab: int | None = None
) -> tuple[Path, GlideTrainer]:
    """Train and export ``glide`` (or ``glide-vanilla``) for ``model`` into ``out_dir``."""
    train = own_sequences(model, 24, seed=1)
    heldout = own_sequences(model, 4, seed=2)
    size = vocab or model.config.vocab_size
    counts = torch.bincount(torch.cat([s.tokens for s in train]), minlength=model.config.vocab_size)
    d2t = torch.sort(torch.argsort(counts, descending=True)[:size]).values
    net_cfg = glide_config_for(model, len(d2t), cross_attention=not vanilla)
    trainer = GlideTrainer(
        net_cfg,
        model,
        d2t,
        train,
        heldout,
        TrainConfig(steps=steps, lr=2e-3, eval_every=50, tokens_per_batch=1024),
    )
    name = "glide-vanilla" if vanilla else "glide"
    trainer.fit(out_dir / f"{name}.train-state.pt")
    target = {
        "weights_id": info.weights_id or info.fingerprint,
        "name": info.name,
        "vocab_size": info.vocab_size,
    }
    return trainer.export(out_dir / name, target, "tests/helpers/glide.py", {}), trainer
