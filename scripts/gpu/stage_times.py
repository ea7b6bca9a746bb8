"""Where the training pipeline's time goes on a device, stage by stage, as one JSON line: the
feature stage split into tokenization, the target's forward and the host's share (copies, fp16,
safetensors), and an EDD training step split into building the batch on the host, moving it and
the forward + backward (synchronised around each part on CUDA).

    python scripts/gpu/stage_times.py --work /tmp/specdraft-train/data --device cuda

Reads the work directory's conversations; writes nothing but scratch files under /tmp.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from llm_worker.config import ModelConfig
from llm_worker.drafters.edd_net import default_prompt_layer, edd_config_for
from llm_worker.training import features as feats
from llm_worker.training.data import read_jsonl
from llm_worker.training.edd import EddTrainConfig, EddTrainer
from llm_worker.training.pipeline import load_model
from llm_worker.training.trainer import batches


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--conversations", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default=None)
    a = p.parse_args()
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = ModelConfig(path=a.model, backend="hf", dtype="float32", device=a.device)
    target, tok = load_model(cfg)
    layer = default_prompt_layer(target.info.num_layers)
    records = [r for r in read_jsonl(a.work / "conversations.jsonl")][: a.conversations]
    out: dict[str, Any] = {"device": a.device, "conversations": len(records)}
    if a.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()

    t = time.perf_counter()
    made = [feats.conversation_ids(tok, r["messages"]) for r in records]
    out["tokenize_s"] = round(time.perf_counter() - t, 3)
    seqs = [m[0][:1024] for m in made if m is not None]
    out["tokens"] = sum(len(s) for s in seqs)
    for _ in range(2):  # the second pass is the one reported: the first warms the kernels up
        _sync(a.device)
        t = time.perf_counter()
        feats._teacher_forced(target.model, seqs, None, (layer,))
        _sync(a.device)
        out["forward_and_copy_s"] = round(time.perf_counter() - t, 3)
    with tempfile.TemporaryDirectory() as tmp:
        conv = Path(tmp) / "c.jsonl"
        conv.write_text("".join(json.dumps(r) + "\n" for r in records))
        fcfg = feats.FeatureConfig(layer=None, hidden_layers=(layer,))
        t = time.perf_counter()
        feats.make_features(target.model, tok, conv, Path(tmp) / "f", fcfg, "profile")
        out["make_features_s"] = round(time.perf_counter() - t, 3)
        out["features_tokens_per_s"] = round(out["tokens"] / out["make_features_s"])
        train = list(feats.load_sequences(Path(tmp) / "f", "train"))
        held = list(itertools.islice(feats.load_sequences(Path(tmp) / "f", "heldout"), 4))
    d2t = torch.arange(min(32768, target.info.vocab_size))
    net = edd_config_for(target.model, len(d2t), prompt_layer=layer)
    trainer = EddTrainer(net, target.model, d2t, train, held or train[:2], EddTrainConfig(device=a.device))
    plan = batches(trainer.train, 8192, random.Random(0))
    gen = torch.Generator().manual_seed(0)
    host = move = compute = 0.0
    for step in range(a.steps):
        chosen = [trainer.train[i] for i in plan[step % len(plan)]]
        _sync(a.device)
        t0 = time.perf_counter()
        host_batch = trainer._host_batch(chosen, gen)
        t1 = time.perf_counter()
        batch = trainer._on_device(host_batch)
        _sync(a.device)
        t2 = time.perf_counter()
        loss = trainer.loss(batch)
        trainer.opt.zero_grad(set_to_none=True)
        loss.backward()
        trainer.opt.step()
        _sync(a.device)
        t3 = time.perf_counter()
        if step >= 2:  # the first steps warm up
            host, move, compute = host + t1 - t0, move + t2 - t1, compute + t3 - t2
    n = max(1, a.steps - 2)
    out["edd_step_ms"] = {
        "host_batch": round(host / n * 1000, 2),
        "to_device": round(move / n * 1000, 2),
        "forward_backward_step": round(compute / n * 1000, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
