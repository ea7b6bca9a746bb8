"""Tiny datastore versions (sparse and dense) of a model's own continuations, and engines that
draft from them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from datastore_svc.dense_build import DenseBuildConfig, dense_step
from datastore_svc.store import DatastoreVersion, LocalRetriever, write_version
from helpers.models import FLAT_CURVE, engine_for, prompts, tiny_model
from helpers.stats import VOCAB
from llm_worker.config import EngineConfig, ModelConfig, PlannerConfig, SamplingParams
from llm_worker.drafters import DraftResources
from llm_worker.encoders import ModelEncoder
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.model.target import TargetModel
from llm_worker.planner import CostCurve


def tiny_identity(vocab: int, name: str = "tiny") -> dict[str, Any]:
    """The tokenizer identity a tiny version records (name, vocabulary size, fingerprint)."""
    return {"name": name, "vocab_size": vocab, "fingerprint": name}


def own_continuations(
    target: TargetModel, n_prompts: int = 4, new: int = 48, stop_at_eos: bool = False
) -> list[np.ndarray]:
    """The model's own greedy continuations of the first ``n_prompts`` test prompts (in
    distribution: drafts often right), then 8 random documents."""
    vocab = target.info.vocab_size
    engine = engine_for(target, FLAT_CURVE)
    docs = []
    for prompt in prompts(vocab)[:n_prompts]:
        res = engine.generate(GenerationRequest(tuple(prompt), new, "ar", stop_at_eos=stop_at_eos))
        docs.append(np.array(prompt + res.token_ids, dtype=np.int32))
    rng = np.random.default_rng(1)
    docs += [rng.integers(0, vocab, size=40).astype(np.int32) for _ in range(8)]
    return docs


def own_samples(
    target: TargetModel, prompt: list[int], params: SamplingParams, count: int = 40, new: int = 6
) -> list[np.ndarray]:
    """``count`` of the model's own sampled continuations of ``prompt`` (seeds 10 000 on), each
    with the prompt: drafts often right, shared prefixes and siblings common."""
    ar = Engine(target, curve=FLAT_CURVE)
    docs = []
    for seed in range(count):
        sp = replace(params, seed=10_000 + seed)
        res = ar.generate(GenerationRequest(tuple(prompt), new, "ar", sp, stop_at_eos=False))
        docs.append(np.array(prompt + res.token_ids, dtype=np.int32))
    return docs


def datastore_for(target: TargetModel, path: Path, shards: int = 2) -> LocalRetriever:
    """A sparse version at ``path``: the model's own greedy continuations (up to end-of-sequence)
    of 4 test prompts plus random documents."""
    vocab = target.info.vocab_size
    docs = own_continuations(target, 4, 48, stop_at_eos=True)
    write_version(docs, path, vocab, tiny_identity(vocab), shards=shards)
    return LocalRetriever(DatastoreVersion(path))


def dense_version(
    model: Any, target: TargetModel, path: Path, docs: list[np.ndarray], shards: int = 2, **cfg: Any
) -> DatastoreVersion:
    """A version at ``path`` of ``docs`` with a dense index of ``model``'s hidden states (16 PCA
    dimensions, windows of 32; ``cfg`` overrides ``DenseBuildConfig`` fields). Hidden states are
    cached beside ``path``, in ``hidden``."""
    options: dict[str, Any] = {
        "dims": 16,
        "window": 32,
        "overlap": 8,
        "chunk_tokens": 120,
        "cache_dir": path.parent / "hidden",
    }
    build_cfg = DenseBuildConfig(**{**options, **cfg})
    extend = dense_step(ModelEncoder(model), "tiny", target.info.weights_id, build_cfg, progress=False)
    vocab = target.info.vocab_size
    write_version(docs, path, vocab, tiny_identity(vocab), shards=shards, extend=extend)
    return DatastoreVersion(path)


def datastore_engine(
    target: TargetModel, retriever: Any, curve: CostCurve = FLAT_CURVE, **resources: Any
) -> Engine:
    """An engine whose drafters may read ``retriever`` (local or remote) and the dense caches in
    ``resources`` (``DraftResources`` fields)."""
    return Engine(
        target,
        EngineConfig(planner=PlannerConfig()),
        curve=curve,
        resources=DraftResources(retriever, **resources),
    )


def own_samples_engine(tmp_path: Path, params: SamplingParams) -> tuple[Any, Engine, list[int]]:
    """A tiny model (vocabulary ``VOCAB``), an engine whose datastore holds 40 of the model's own
    sampled continuations of the prompt (drafts often right, with shared prefixes), the prompt."""
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    docs = own_samples(target, prompt, params)
    write_version(docs, tmp_path / "v", VOCAB, tiny_identity(VOCAB, "t"))
    return model, datastore_engine(target, LocalRetriever(DatastoreVersion(tmp_path / "v"))), prompt


def key_positions(tokens: np.ndarray, separator: int) -> np.ndarray:
    """The positions the dense build gives a key (``dense_build``): every token whose next token
    is in the same document."""
    t = np.asarray(tokens)
    if len(t) < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero((t[:-1] < separator) & (t[1:] < separator)).astype(np.int64)
