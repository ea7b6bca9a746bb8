"""``dresd`` / ``dresd-batch``: drafts retrieved by meaning from a dense datastore (DReSD).

The engine keeps the target's last hidden state (after the final norm) of every verified token.
At each step the drafter reduces the state of the last verified token with the datastore
version's statistics (``DenseStats.project``: z-score, PCA, L2), and asks the datastore for the
nearest keys whose stored next token is the root (the token the target just verified); the
drafts are what followed those keys in the corpus. ``dresd`` merges them into a token tree,
``dresd-batch`` verifies them as the rows of one batched forward. Draft shape: D drafts of up to
L tokens (``d``, ``l``; the paper uses 3×20 greedy, 10×10 sampling), then the planner trims the
draft to what pays on this machine's verify cost curve.

Statistics come from the in-process cache, then Redis, then the datastore itself (manifest or a
shard's Info call); query results are cached in Redis by version and context (``QueryCache``).
A request is pinned to the version of its first retrieval. Any datastore or cache problem costs
drafts, never the generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from datastore_svc.cache import QueryCache, StatsCache
from datastore_svc.dense import DenseConfig, DenseRetrieval, DenseStats
from datastore_svc.protocols import DenseRetriever
from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DraftResources,
    ModeUnavailableError,
    bucket,
    int_option,
)
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds, Draft, DraftBatch, DraftTree

log = logging.getLogger(__name__)


def dense_features(result: DenseRetrieval) -> list[list[str]]:
    """Per candidate, per token: ``dresd:s<similarity>:r<rank>`` (the planner learns their acceptance)."""
    feats = []
    for rank, cand in enumerate(result.candidates):
        score = bucket(cand.score, (0.5, 0.7, 0.8, 0.9, 0.95))
        feats.append([f"dresd:s{score}:r{min(rank, 3)}:d{min(d, 4)}" for d in range(len(cand.tokens))])
    return feats


def dense_tree(result: DenseRetrieval) -> DraftTree:
    if not result.candidates:
        return DraftTree.empty()
    return DraftTree.from_sequences([c.tokens for c in result.candidates], features=dense_features(result))


def dense_batch(result: DenseRetrieval) -> DraftBatch:
    if not result.candidates:
        return DraftBatch.empty()
    return DraftBatch(
        tuple(c.tokens for c in result.candidates), features=tuple(tuple(f) for f in dense_features(result))
    )


class DresdDrafter(Drafter):
    gated = True
    """A dense retrieval (the projection, then every shard's search with its drafts, compiled)
    costs about 0.08 of a target step before the planner sees a draft, twice a sparse one; on
    prompts a chat corpus does not know (editing a given text) it drafted at 0.95-0.98x ``ar``
    ungated (2-core Xeon, 2026-11-28 logs): the gate learns where it pays."""

    def __init__(
        self,
        retriever: DenseRetriever,
        layer: int,
        fingerprint: str,
        cfg: DenseConfig,
        shape: Callable[[DenseRetrieval], Draft] = dense_tree,
        stats: StatsCache | None = None,
        queries: QueryCache | None = None,
    ) -> None:
        self.retriever = retriever
        self.layer = layer
        self.fingerprint = fingerprint
        self.cfg = cfg
        self.shape = shape
        self.stats = stats or StatsCache(None)
        self.queries = queries
        self.needs = ArtifactNeeds(hidden_layers=frozenset({layer}))
        self._refused: set[str] = set()

    def _fetch_stats(self, version: str) -> DenseStats | None:
        stats, model = self.retriever.dense_stats(version)
        if stats is not None and model and model != self.fingerprint:
            if version not in self._refused:
                log.warning(
                    "datastore %s: dense keys of another model (%s, this is %s)",
                    version,
                    model,
                    self.fingerprint,
                )
                self._refused.add(version)
            return None
        return stats

    def retrieve(self, ctx: DraftContext) -> DenseRetrieval | None:
        pinned = ctx.request_state.datastore_version
        version = pinned or self.retriever.current_version()
        if not version or version in self._refused:
            return None
        key = self.queries.key(version, self.cfg, ctx.tokens) if self.queries is not None else ""
        if self.queries is not None:
            hit = self.queries.get(key)
            if hit is not None:
                ctx.request_state.datastore_version = version
                return hit
        t0 = time.perf_counter()
        stats = self.stats.get(version, self._fetch_stats)
        if stats is None:
            return None
        hidden = ctx.hidden(self.layer)[-1].float().cpu().numpy()
        query = stats.project(hidden)
        result, answered = self.retriever.retrieve_dense(query, int(ctx.tokens[-1]), self.cfg, version)
        if answered and answered != version:  # swapped between the statistics and the search
            return None
        ctx.request_state.datastore_version = version
        if self.queries is not None:
            self.queries.put(key, query, result, time.perf_counter() - t0)
        return result

    def propose(self, ctx: DraftContext) -> Draft:
        try:
            result = self.retrieve(ctx)
        except Exception as exc:  # a datastore problem costs drafts, never the generation
            log.warning("dense retrieval failed, drafting nothing this step: %s", exc)
            return DraftTree.empty()
        return self.shape(result) if result is not None else DraftTree.empty()


def dense_config(options: dict[str, str], d: int, length: int) -> DenseConfig:
    return DenseConfig(
        top_k=int_option(options, "k", 64, 1, 4096),
        max_candidates=int_option(options, "d", d, 1, 256),
        max_length=int_option(options, "l", length, 1, 128),
    )


DRESD_OPTIONS = ("k", "d", "l")


def _make(
    target: TargetModel,
    options: dict[str, str],
    resources: DraftResources,
    shape: Callable[[DenseRetrieval], Draft],
) -> Drafter:
    retriever = resources.datastore
    if retriever is None:
        raise ModeUnavailableError(
            "needs a datastore with a dense index (--datastore DIR or --datastore-addr)"
        )
    drafter = DresdDrafter(
        retriever,
        target.info.num_layers,
        target.info.weights_id,
        dense_config(options, 3, 10),
        shape,
        resources.dense_stats,
        resources.dense_queries,
    )
    try:
        version = retriever.current_version()
        stats, model = retriever.dense_stats(version) if version else (None, "")
    except Exception as exc:  # a remote datastore that does not answer now: checked again every step
        log.info("dense datastore not reachable now (%s); dresd will try per step", exc)
        return drafter
    if version and stats is None:
        raise ModeUnavailableError(f"datastore {version} has no dense index (build it with --dense)")
    if model and model != target.info.weights_id:
        raise ModeUnavailableError(
            f"datastore {version} holds hidden states of another model ({model}; this one is "
            f"{target.info.weights_id})"
        )
    if stats is not None:  # checked here: the first step need not fetch them again
        drafter.stats.remember(version, stats)
    return drafter


@DRAFTERS.register(
    "dresd",
    "DReSD: continuations of the nearest hidden states in a dense datastore, as a token tree",
    DRESD_OPTIONS,
)
def _make_dresd(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return _make(target, options, resources, dense_tree)


@DRAFTERS.register(
    "dresd-batch",
    "DReSD drafts verified as a batch: the D nearest drafts as rows of one forward",
    DRESD_OPTIONS,
)
def _make_dresd_batch(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return _make(target, options, resources, dense_batch)
