"""The typed boundary between drafters and datastores.

A drafter asks through one of two protocols; three implementations answer: the local store
(``store.LocalRetriever``, a version opened in the worker's process), one shard's state
(``shard.ShardState``, behind the gRPC server) and the remote fan-out (``fanout.RemoteDatastore``,
every shard over gRPC). Each answer names the version that answered, so a request can be pinned
to it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from datastore_svc.dense import DenseConfig, DenseRetrieval, DenseStats
from datastore_svc.retrieval import Retrieval, RetrievalConfig


class SparseAnswer(NamedTuple):
    retrieval: Retrieval
    version: str
    """The datastore version that answered ("" when no datastore answered)."""


class DenseAnswer(NamedTuple):
    retrieval: DenseRetrieval
    version: str


class DenseDescription(NamedTuple):
    stats: DenseStats | None
    """z-score + PCA statistics that turn a hidden state into a query; None: no dense index."""
    model: str
    """Fingerprint of the model whose hidden states the keys are ("" if unknown)."""


class SparseRetriever(Protocol):
    """Continuations of the longest suffix of a context found in the corpus (REST)."""

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> SparseAnswer:
        """``context``: the last context tokens; ``version``: the pinned version, "" = the current one."""
        ...


class DenseRetriever(Protocol):
    """Continuations of the keys nearest a query embedding (DReSD)."""

    def current_version(self) -> str:
        """The version served now ("" when none answers)."""
        ...

    def dense_stats(self, version: str) -> DenseDescription:
        """What turns a hidden state into a query for ``version``'s keys."""
        ...

    def retrieve_dense(
        self, query: np.ndarray, next_token: int, cfg: DenseConfig, version: str = ""
    ) -> DenseAnswer:
        """``query``: the reduced embedding; candidates start with ``next_token``."""
        ...


class Datastore(SparseRetriever, DenseRetriever, Protocol):
    """What a worker drafts from: both kinds of retrieval (a version without a dense index
    describes itself with ``DenseDescription(None, "")``)."""
