"""The typed boundary between drafters and datastores.

A drafter asks through one of two protocols; three implementations answer: the local store
(``store.LocalRetriever``, a version opened in the worker's process), one shard's state
(``shard.ShardState``, behind the gRPC server) and the remote fan-out (``fanout.RemoteDatastore``,
every shard over gRPC). Each answer names the version that answered, so a request can be pinned
to it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from datastore_svc.dense import DenseConfig, DenseRetrieval, DenseStats
from datastore_svc.retrieval import Retrieval, RetrievalConfig
from specdraft.common import percentile


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


class PendingAnswer(Protocol):
    """A sparse retrieval in flight (``PrefetchingRetriever.prefetch``)."""

    in_time: bool
    """After ``take``: every shard had answered by then."""

    def take(self) -> SparseAnswer:
        """What has been answered by now, without waiting; the rest is dropped."""
        ...

    def cancel(self) -> None:
        """Drop the retrieval (its answer is no longer wanted)."""
        ...


@runtime_checkable
class PrefetchingRetriever(SparseRetriever, Protocol):
    """A retriever worth asking ahead: its answers take a round trip (remote shards)."""

    on_this_host: bool
    """It answers from this host's cores (every shard on loopback): asking ahead then competes
    with the forward it means to overlap."""

    def prefetch(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> PendingAnswer:
        """``retrieve``'s question, sent now, answered by ``PendingAnswer.take`` later."""
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


class RetrievalTimes:
    """Wall times of a datastore's retrievals as the worker waited for them, per kind
    (``"sparse"``, ``"dense"``): the last ``keep`` of each, for percentiles in benchmarks.
    ``where`` says how the worker reached the datastore: ``"in-process"``, or ``"grpc"``, where a
    time is the whole fan-out (every shard asked, the answers merged).

    Example: after ``with times.timed("sparse"): ...`` three times, ``times.summary()`` →
    ``{"where": "grpc", "sparse": {"calls": 3, "p50_ms": 0.21, "p90_ms": 0.4, "p99_ms": 0.52}}``.
    """

    def __init__(self, where: str, keep: int = 100_000) -> None:
        self.where = where
        self._seconds: dict[str, deque[float]] = {}
        self._calls: dict[str, int] = {}
        self._keep = keep
        self._lock = threading.Lock()

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - began)

    def add(self, kind: str, seconds: float) -> None:
        """One more call of ``kind`` that took ``seconds``."""
        with self._lock:
            self._seconds.setdefault(kind, deque(maxlen=self._keep)).append(seconds)
            self._calls[kind] = self._calls.get(kind, 0) + 1

    def summary(self) -> dict[str, Any]:
        """``where``, and per kind: calls made and the 50th, 90th and 99th percentiles of the kept
        times in ms (``specdraft.common.percentile``, the project's one definition)."""
        with self._lock:
            kept = {kind: [s * 1000 for s in seconds] for kind, seconds in self._seconds.items() if seconds}
            calls = dict(self._calls)
        out: dict[str, Any] = {"where": self.where}
        for kind, ms in sorted(kept.items()):
            out[kind] = {
                "calls": calls[kind],
                "p50_ms": round(percentile(ms, 0.5), 3),
                "p90_ms": round(percentile(ms, 0.9), 3),
                "p99_ms": round(percentile(ms, 0.99), 3),
            }
        return out
