"""Intrinsic evaluation of a dense datastore (``specdraft datastore eval``).

For held-out corpus positions q (text the datastore was not built from) the target's hidden
state at q is reduced with the version's statistics and searched. A retrieved key at corpus
position p is *relevant* when the n tokens it stored next, ``tokens[p + 1 : p + 1 + n]``, equal the
true next n tokens after q — the key would have drafted the right continuation. Reported:

- MRR@k: the mean over positions of 1 / rank of the first relevant key among the top k (0 if
  none), for continuations of 1 and of ``n`` tokens;
- hit@k: how often any of the top k is relevant;
- recall@k of the approximate index: the share of the exact top k (an exhaustive inner-product
  search over the same stored keys) that the index returned.

Example: relevance [False, True, True] → reciprocal rank 1/2; [False, False] → 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from datastore_svc.dense import exact_search, recall_at
from specdraft.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llm_worker.model.target import TargetModel


def reciprocal_ranks(relevant: np.ndarray) -> np.ndarray:
    """[n, k] bool → [n]: 1 / (1 + index of the first True), 0 where a row has none."""
    relevant = np.asarray(relevant, dtype=bool)
    if relevant.shape[1] == 0:
        return np.zeros(len(relevant))
    first = relevant.argmax(axis=1)
    return np.where(relevant.any(axis=1), 1.0 / (first + 1), 0.0)


def relevance(tokens: np.ndarray, separator: int, positions: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """[n, k] whether the key at ``positions[i, j]`` stored ``truth[i]`` ([n, m]) as its next m tokens."""
    m = truth.shape[1]
    idx = positions[:, :, None] + 1 + np.arange(m)[None, None, :]  # [n, k, m]
    valid = (positions[:, :, None] >= 0) & (idx < len(tokens))
    stored = np.asarray(tokens[np.clip(idx, 0, len(tokens) - 1)], dtype=np.int64)
    stored = np.where(valid, stored, -1)
    stored = np.where(stored >= separator, -1, stored)
    return (stored == truth[:, None, :]).all(axis=2)


@dataclass(frozen=True)
class EvalReport:
    queries: int
    k: tuple[int, ...]
    mrr: dict[str, dict[int, float]]  # continuation length label → k → MRR@k
    hit: dict[str, dict[int, float]]
    recall: dict[int, float]  # k → recall@k of the index vs exact search

    def as_dict(self) -> dict[str, Any]:
        return {
            "queries": self.queries,
            "mrr": {n: {str(k): round(v, 4) for k, v in by_k.items()} for n, by_k in self.mrr.items()},
            "hit": {n: {str(k): round(v, 4) for k, v in by_k.items()} for n, by_k in self.hit.items()},
            "recall_vs_exact": {str(k): round(v, 4) for k, v in self.recall.items()},
        }


def sample_positions(
    docs: Sequence[np.ndarray], count: int, need: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Up to ``count`` (document, position) pairs with ``need`` true next tokens inside the document."""
    pairs = [(d, p) for d, doc in enumerate(docs) for p in range(max(0, len(doc) - need))]
    rng = np.random.default_rng(seed)
    if len(pairs) > count:
        pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), size=count, replace=False))]
    return pairs


def evaluate(
    version: Any,
    hidden: Sequence[np.ndarray],
    docs: Sequence[np.ndarray],
    ks: Sequence[int],
    n: int = 4,
    count: int = 2000,
    seed: int = 0,
) -> EvalReport:
    """MRR / hit / recall of ``version``'s dense index for held-out ``docs`` and their ``hidden`` states."""
    stats = version.dense_stats
    if stats is None:
        raise ValueError(f"version {version.version} has no dense index")
    pairs = sample_positions(docs, count, n, seed)
    if not pairs:
        raise ValueError(f"no held-out position has {n} tokens after it")
    states = np.stack([np.asarray(hidden[d][p], dtype=np.float32) for d, p in pairs])
    truth = np.stack([np.asarray(docs[d][p + 1 : p + 1 + n], dtype=np.int64) for d, p in pairs])
    queries = stats.project(states)
    kmax = max(ks)
    scores: list[np.ndarray] = []
    rel1: list[np.ndarray] = []
    reln: list[np.ndarray] = []
    recalls: dict[int, list[float]] = {k: [] for k in ks}
    for shard in version.shards:
        dense = shard.dense
        if dense is None or dense.index.ntotal == 0:
            continue
        s, rows = dense.index.search(queries, kmax)  # rows -1 where the shard has fewer keys
        pos = np.where(rows >= 0, dense.positions[np.maximum(rows, 0)], -1)
        scores.append(np.where(rows >= 0, s, -np.inf))
        rel1.append(relevance(shard.tokens, shard.separator, pos, truth[:, :1]))
        reln.append(relevance(shard.tokens, shard.separator, pos, truth))
        _, exact_rows = exact_search(dense.keys(), queries, kmax)
        for k in ks:
            recalls[k].append(recall_at(rows[:, :k], exact_rows[:, :k]) * len(queries))
    if not scores:
        raise ValueError(f"version {version.version} has no dense keys")
    order = np.argsort(-np.concatenate(scores, axis=1), axis=1, kind="stable")[
        :, :kmax
    ]  # merge shards by score
    merged1 = np.take_along_axis(np.concatenate(rel1, axis=1), order, axis=1)
    mergedn = np.take_along_axis(np.concatenate(reln, axis=1), order, axis=1)
    mrr: dict[str, dict[int, float]] = {"1": {}, str(n): {}}
    hit: dict[str, dict[int, float]] = {"1": {}, str(n): {}}
    for label, rel in (("1", merged1), (str(n), mergedn)):
        for k in ks:
            mrr[label][k] = float(reciprocal_ranks(rel[:, :k]).mean())
            hit[label][k] = float(rel[:, :k].any(axis=1).mean())
    shards = len(scores)
    recall = {k: float(sum(v) / (len(queries) * shards)) for k, v in recalls.items()}
    return EvalReport(len(pairs), tuple(ks), mrr, hit, recall)


def evaluate_versions(
    target: TargetModel,
    tokenizer: Tokenizer,
    versions: Sequence[str],
    corpus: str,
    ks: Sequence[int],
    n: int,
    positions: int,
    seed: int,
    window: int,
    hidden_cache: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """``evaluate`` for each dense version on the held-out ``corpus`` (its hidden states computed
    once, through ``target``'s transformers model): version name → its dims and report."""
    from client.bench.dense import other_model_reason
    from datastore_svc.corpus import read_documents
    from datastore_svc.dense_build import DenseBuildConfig, HiddenStates, default_overlap
    from datastore_svc.store import DatastoreVersion, tokenize_documents, tokenizer_identity
    from llm_worker.encoders import ModelEncoder

    fingerprint = tokenizer_identity(tokenizer)["fingerprint"]
    cfg = DenseBuildConfig(window=window, overlap=default_overlap(window), cache_dir=hidden_cache)
    states = HiddenStates(ModelEncoder(target.model), target.info.weights_id, cfg)
    docs = tokenize_documents(read_documents(corpus, tokenizer), tokenizer)
    if not docs:
        raise ValueError(f"{corpus}: no documents")
    hidden = [states.chunk([d])[0] for d in docs]
    reports: dict[str, dict[str, Any]] = {}
    for path in versions:
        version = DatastoreVersion(path, tokenizer_fingerprint=fingerprint)
        reason = other_model_reason(version, target)
        if reason:
            raise ValueError(reason)
        report = evaluate(version, hidden, docs, ks, n=n, count=positions, seed=seed)
        reports[version.version] = {"dims": version.dense_stats.dims if version.dense_stats else 0}
        reports[version.version].update(report.as_dict())
    return reports
