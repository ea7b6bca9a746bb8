"""Dense retrieval latency (``specdraft datastore bench --dense``).

The queries are what a worker would send while reading the built-in suite's prompts: the target's
hidden state (final norm) at random positions of those prompts, reduced with the version's
statistics, each with the true next token of the prompt as the verified token. Timed per call:
the projection plus the search (in process) or the call through shard servers (gRPC).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from client.bench.timing import latency_ms
from datastore_svc.dense import DenseConfig, DenseStats
from datastore_svc.protocols import DenseRetriever
from specdraft.tokenizer import Tokenizer

if TYPE_CHECKING:
    from datastore_svc.store import DatastoreVersion
    from llm_worker.model.target import TargetModel


def other_model_reason(version: DatastoreVersion, target: TargetModel) -> str | None:
    """Why ``version``'s dense keys cannot serve ``target`` (another model's hidden states), or
    None when they can."""
    if version.dense_model and version.dense_model != target.info.weights_id:
        return f"{version.path}: dense keys of another model than {target.info.name}"
    return None


def dense_queries(
    model: Any, tokenizer: Tokenizer, count: int, seed: int = 0
) -> list[tuple[np.ndarray, int]]:
    """``count`` (hidden state, next token) pairs at random positions of the built-in suite's prompts."""
    import torch

    from client.bench.suite import builtin_suite

    texts = [t for q in builtin_suite() for t in q.turns]
    rng = np.random.default_rng(seed)
    pairs: list[tuple[np.ndarray, int]] = []
    streams = [np.array(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    streams = [s[:1024] for s in streams if len(s) > 2]
    per_stream = max(1, -(-count // len(streams)))
    with torch.inference_mode():
        for ids in streams:
            out = model.base_model(input_ids=torch.from_numpy(ids)[None])
            hidden = out.last_hidden_state[0].float().numpy()
            for p in rng.choice(len(ids) - 1, size=min(per_stream, len(ids) - 1), replace=False):
                pairs.append((hidden[p], int(ids[p + 1])))
    order = rng.permutation(len(pairs))[:count]
    return [pairs[i] for i in order]


def dense_latency(
    retriever: DenseRetriever, stats: DenseStats, queries: list[tuple[np.ndarray, int]], cfg: DenseConfig
) -> dict[str, float]:
    """Milliseconds per projection + ``retrieve_dense`` (p50, p99, mean), and the share with drafts."""
    times, drafted = [], 0
    for hidden, next_token in queries:
        t0 = time.perf_counter()
        result, _ = retriever.retrieve_dense(stats.project(hidden), next_token, cfg)
        times.append((time.perf_counter() - t0) * 1000.0)
        drafted += bool(result.candidates)
    return {**latency_ms(times), "drafted": round(drafted / max(len(times), 1), 3)}
