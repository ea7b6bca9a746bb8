"""The worker's client of remote shards: fan out to every shard at once, merge, tolerate loss.

Each shard gets the same Retrieve call with its own deadline (default 20 ms). A shard that fails,
is slow or is down is treated as missing and the others' candidates are merged; with none, the
step drafts nothing. Nothing here can fail a generation.

Versions: a request's first retrieval is answered by whatever version the shards serve; the
version most of them answered with is returned and the caller pins later calls to it (during a
swap shards may briefly disagree — answers of another version are dropped, never mixed).

Dense retrieval sends the reduced query embedding and the verified next token; the statistics
that make the embedding come from a shard's Info call (``dense_stats``; the caller caches them,
and Redis first — ``datastore_svc.cache``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

import grpc
import numpy as np

from datastore_svc.dense import (
    NO_DENSE,
    DenseCandidate,
    DenseConfig,
    DenseError,
    DenseRetrieval,
    DenseSource,
    DenseStats,
    merge_dense,
)
from datastore_svc.protocols import DenseAnswer, DenseDescription, SparseAnswer
from datastore_svc.retrieval import Candidate, Retrieval, RetrievalConfig, Source, merge
from specdraft.stubs import datastore_pb2, datastore_pb2_grpc

log = logging.getLogger(__name__)


def sparse_from_response(resp: datastore_pb2.RetrieveResponse) -> Retrieval:
    candidates = []
    for c in resp.candidates:
        counts = tuple(c.prefix_counts) or (c.count,) * len(c.tokens)
        source = Source(c.source.shard, c.source.document, c.source.offset) if c.HasField("source") else None
        candidates.append(Candidate(tuple(c.tokens), counts, source))
    d = resp.sparse
    return Retrieval(tuple(candidates), d.match_length, d.occurrences, d.sampled)


def dense_from_response(resp: datastore_pb2.RetrieveResponse) -> DenseRetrieval:
    candidates = []
    for c in resp.candidates:
        source = (
            DenseSource(c.source.shard, c.source.document, c.source.offset) if c.HasField("source") else None
        )
        candidates.append(DenseCandidate(tuple(c.tokens), float(c.score), int(c.count), source))
    return DenseRetrieval(tuple(candidates), searched=resp.dense.searched, matched=resp.dense.matched)


class DatastoreUnavailable(RuntimeError):
    """No shard answered (the caller drafts without the datastore this step)."""


class RemoteDatastore:
    """``SparseRetriever`` and ``DenseRetriever`` over shard servers at ``addresses`` (one per shard)."""

    def __init__(self, addresses: Sequence[str], deadline_seconds: float = 0.02) -> None:
        if not addresses:
            raise ValueError("no datastore shard address given")
        self.addresses = list(addresses)
        self.deadline_seconds = deadline_seconds
        self._channels = [grpc.insecure_channel(a) for a in self.addresses]
        self._stubs = [datastore_pb2_grpc.DatastoreStub(c) for c in self._channels]
        self.failures: Counter[str] = Counter()  # per address: calls that failed or timed out
        self.info_timeout = 0.5
        self.recheck_seconds = 5.0
        self._stats_failed: dict[str, float] = {}  # version -> when no shard could describe it
        self._current = ""
        self._checked = -1e9  # when the shards were last asked for their version

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> SparseAnswer:
        request = datastore_pb2.RetrieveRequest(
            sparse=datastore_pb2.SparseQuery(
                context=[int(t) for t in context[-cfg.c_max :]],
                min_match=cfg.c_min,
                max_occurrences=cfg.max_occurrences,
                max_nodes=cfg.max_nodes,
            ),
            max_candidates=cfg.max_candidates,
            max_length=cfg.max_length,
            version=version,
        )
        answers = self._gather(request)
        if not answers:
            return SparseAnswer(Retrieval((), 0, 0, 0), version)
        chosen = version or Counter(a.version for a in answers).most_common(1)[0][0]
        if not version:  # an unpinned answer says what the shards serve now
            self._current = chosen
        results = [sparse_from_response(a) for a in answers if a.version == chosen]
        return SparseAnswer(merge(results, cfg.max_nodes, cfg.max_candidates), chosen)

    def _gather(self, request: datastore_pb2.RetrieveRequest) -> list[datastore_pb2.RetrieveResponse]:
        calls = [stub.Retrieve.future(request, timeout=self.deadline_seconds) for stub in self._stubs]
        answers = []
        for address, call in zip(self.addresses, calls, strict=True):
            try:
                answers.append(call.result())
            except grpc.RpcError as exc:
                self.failures[address] += 1
                log.debug("shard %s missing this step: %s", address, exc.code())
        return answers

    def retrieve_dense(
        self, query: np.ndarray, next_token: int, cfg: DenseConfig, version: str = ""
    ) -> DenseAnswer:
        request = datastore_pb2.RetrieveRequest(
            dense=datastore_pb2.DenseQuery(
                embedding=np.asarray(query, dtype=np.float32).tolist(),
                next_token=int(next_token),
                top_k=cfg.top_k,
            ),
            max_candidates=cfg.max_candidates,
            max_length=cfg.max_length,
            version=version,
        )
        answers = self._gather(request)
        if not answers:
            return DenseAnswer(NO_DENSE, version)
        chosen = version or Counter(a.version for a in answers).most_common(1)[0][0]
        results = [dense_from_response(a) for a in answers if a.version == chosen]
        return DenseAnswer(merge_dense(results, cfg.max_candidates), chosen)

    def current_version(self) -> str:
        """The version most shards serve (asked at most every ``recheck_seconds``; "" = none answers)."""
        now = time.monotonic()
        if now - self._checked < self.recheck_seconds:
            return self._current
        self._checked = now
        request = datastore_pb2.ShardInfoRequest()
        calls = [stub.GetShardInfo.future(request, timeout=self.info_timeout) for stub in self._stubs]
        versions = []
        for call in calls:
            try:
                versions.append(call.result().version)
            except grpc.RpcError:
                continue
        if versions:
            self._current = Counter(versions).most_common(1)[0][0]
        return self._current

    def dense_stats(self, version: str) -> DenseDescription:
        """(the dense statistics of ``version`` from the first shard that has it, its model fingerprint)."""
        failed = self._stats_failed.get(version)
        if failed is not None and time.monotonic() - failed < self.recheck_seconds:
            raise DatastoreUnavailable(f"no shard described version {version!r} (asked again shortly)")
        request = datastore_pb2.ShardInfoRequest(include_stats=True, version=version)
        errors = []
        for address, stub in zip(self.addresses, self._stubs, strict=True):
            try:
                info = stub.GetShardInfo(request, timeout=self.info_timeout)
            except grpc.RpcError as exc:
                errors.append(f"{address}: {exc.code().name}")
                continue
            if not info.HasField("dense") or not info.dense.stats:
                return DenseDescription(None, "")
            try:
                return DenseDescription(DenseStats.from_bytes(info.dense.stats), info.dense.model_fingerprint)
            except DenseError as exc:
                errors.append(f"{address}: {exc}")
        self._stats_failed[version] = time.monotonic()
        raise DatastoreUnavailable(f"no shard described version {version!r}: {'; '.join(errors)}")

    def info(self, timeout: float = 5.0) -> list[datastore_pb2.ShardInfo]:
        return [stub.GetShardInfo(datastore_pb2.ShardInfoRequest(), timeout=timeout) for stub in self._stubs]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def swap_all(addresses: Sequence[str], version: str, timeout: float = 600.0) -> list[tuple[str, str]]:
    """Two phases over every shard: load ``version`` everywhere, then make it current everywhere.

    If any shard cannot load it, nothing is swapped (the error says which shard and why).
    Returns (previous, current) per shard.
    """
    channels = [grpc.insecure_channel(a) for a in addresses]
    try:
        stubs = [datastore_pb2_grpc.DatastoreStub(c) for c in channels]
        loads = [
            s.LoadVersion.future(datastore_pb2.LoadVersionRequest(path=version), timeout=timeout)
            for s in stubs
        ]
        names = []
        for address, call in zip(addresses, loads, strict=True):
            try:
                names.append(call.result().version)
            except grpc.RpcError as exc:
                raise RuntimeError(f"shard {address} refused version {version!r}: {exc.details()}") from None
        if len(set(names)) != 1:
            raise RuntimeError(f"shards loaded different versions: {names}")
        swapped = []
        for stub in stubs:
            resp = stub.SwapVersion(datastore_pb2.SwapVersionRequest(version=names[0]), timeout=30)
            swapped.append((resp.previous, resp.current))
        return swapped
    finally:
        for channel in channels:
            channel.close()
