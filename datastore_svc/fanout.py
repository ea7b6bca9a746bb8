"""The worker's client of remote shards: fan out to every shard at once, merge, tolerate loss.

Each shard gets the same Retrieve call with its own deadline (default 20 ms). A shard that fails,
is slow or is down is treated as missing and the others' candidates are merged; with none, the
step drafts nothing. Nothing here can fail a generation.

Versions: a request's first retrieval is answered by whatever version the shards serve; the
version most of them answered with is returned and the caller pins later calls to it (during a
swap shards may briefly disagree — answers of another version are never mixed in; they are
counted per shard in ``off_version``, exported as a metric, and logged once per shard and version).

``swap_all`` changes the version of every shard in two phases with rollback (load everywhere,
then compare-and-swap everywhere; if one shard fails, the others return to their version).

Dense retrieval sends the reduced query embedding and the verified next token; the statistics
that make the embedding come from a shard's Info call (``dense_stats``; the caller caches them,
and Redis first — ``datastore_svc.cache``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

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
from datastore_svc.protocols import DenseAnswer, DenseDescription, RetrievalTimes, SparseAnswer
from datastore_svc.retrieval import Candidate, Retrieval, RetrievalConfig, Source, merge, well_formed
from specdraft.security import ClientSecurity, is_loopback, target_hosts
from specdraft.stubs import datastore_pb2, datastore_pb2_grpc

log = logging.getLogger(__name__)


def sparse_from_response(resp: datastore_pb2.RetrieveResponse, max_length: int) -> Retrieval:
    """A shard's sparse answer; candidates no well-behaved shard sends (empty, longer than
    ``max_length``, prefix counts not one per token) are dropped, not merged."""
    candidates = []
    for c in resp.candidates:
        counts = tuple(c.prefix_counts) or (c.count,) * len(c.tokens)
        source = Source(c.source.shard, c.source.document, c.source.offset) if c.HasField("source") else None
        candidates.append(Candidate(tuple(c.tokens), counts, source))
    d = resp.sparse
    return Retrieval(well_formed(candidates, max_length), d.match_length, d.occurrences, d.sampled)


def dense_from_response(resp: datastore_pb2.RetrieveResponse, max_length: int) -> DenseRetrieval:
    """A shard's dense answer; empty candidates and ones longer than ``max_length`` are dropped."""
    candidates = []
    for c in resp.candidates:
        if not c.tokens or len(c.tokens) > max_length:
            continue
        source = (
            DenseSource(c.source.shard, c.source.document, c.source.offset) if c.HasField("source") else None
        )
        candidates.append(DenseCandidate(tuple(c.tokens), float(c.score), int(c.count), source))
    return DenseRetrieval(tuple(candidates), searched=resp.dense.searched, matched=resp.dense.matched)


def _sparse_request(context: np.ndarray, cfg: RetrievalConfig, version: str) -> datastore_pb2.RetrieveRequest:
    return datastore_pb2.RetrieveRequest(
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


class PendingSparse:
    """A sparse fan-out in flight (``RemoteDatastore.prefetch``).

    ``take`` answers with the shards that have answered by then and cancels the others — it never
    waits, so a slow shard costs its candidates this step, not time: e.g. two shards, one answered
    in 3 ms and one still busy when the drafter takes the answer 12 ms after sending → the first
    one's candidates; the second is cancelled and counted in ``RemoteDatastore.late``. ``cancel``
    drops the whole fan-out (the request ended). The time from sending to the last answer is kept
    as the ``"prefetch"`` kind of ``RemoteDatastore.times``.
    """

    def __init__(
        self, remote: RemoteDatastore, calls: Sequence[grpc.Future], cfg: RetrievalConfig, version: str
    ) -> None:
        self.remote = remote
        self.calls = list(calls)
        self.cfg = cfg
        self.version = version
        self.sent = time.perf_counter()
        self.in_time = False
        """Every shard had answered when ``take`` took the answer."""
        self._answered_at: list[float] = []
        for call in self.calls:
            call.add_done_callback(self._answered)

    def _answered(self, call: grpc.Future) -> None:
        self._answered_at.append(time.perf_counter())  # list.append is atomic: safe from gRPC's thread

    def done(self) -> bool:
        return all(call.done() for call in self.calls)

    def take(self) -> SparseAnswer:
        remote = self.remote
        ready = []
        for address, call in zip(remote.addresses, self.calls, strict=True):
            if call.done():
                ready.append((address, call))
            else:
                call.cancel()
                remote.late[address] += 1
        self.in_time = len(ready) == len(self.calls)
        if self._answered_at:
            remote.times.add("prefetch", max(self._answered_at) - self.sent)
        return remote._sparse_answer(remote._answered(ready), self.cfg, self.version)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


class DatastoreUnavailable(RuntimeError):
    """No shard answered (the caller drafts without the datastore this step)."""


class RemoteDatastore:
    """``SparseRetriever`` and ``DenseRetriever`` over shard servers at ``addresses`` (one per shard)."""

    def __init__(
        self,
        addresses: Sequence[str],
        deadline_seconds: float = 0.02,
        security: ClientSecurity | None = None,
        tokenizer_fingerprint: str = "",
    ) -> None:
        """``tokenizer_fingerprint``: the worker's tokenizer (``tokenizer_identity``); a shard
        whose datastore was built with another is left out (its token ids mean other tokens)."""
        if not addresses:
            raise ValueError("no datastore shard address given")
        self.addresses = list(addresses)
        self.on_this_host = all(is_loopback(h) for a in self.addresses for h in target_hosts(a))
        """Every shard listens on a loopback address: it shares this host's cores."""
        self.deadline_seconds = deadline_seconds
        security = security or ClientSecurity()
        self._channels = [security.channel(a) for a in self.addresses]
        self._stubs = [datastore_pb2_grpc.DatastoreStub(c) for c in self._channels]
        self.failures: Counter[str] = Counter()  # per address: calls that failed or timed out
        self.off_version: Counter[str] = Counter()  # per address: answers from another version
        self.late: Counter[str] = Counter()  # per address: prefetched answers not there when taken
        self.times = RetrievalTimes("grpc")
        """How long each fan-out took as the worker waited (benchmarks report its percentiles)."""
        self._reported: set[tuple[str, str]] = set()  # (address, version) already logged
        self.info_timeout = 0.5
        self.recheck_seconds = 5.0
        self._stats_failed: dict[str, float] = {}  # version -> when no shard could describe it
        self._current = ""
        self._checked = -1e9  # when the shards were last asked for their version
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.foreign: dict[str, str] = {}  # address -> the other tokenizer its datastore was built with

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> SparseAnswer:
        request = _sparse_request(context, cfg, version)
        with self.times.timed("sparse"):
            return self._sparse_answer(self._gather(request), cfg, version)

    def prefetch(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> PendingSparse:
        """``retrieve``'s calls, sent now and answered later (``PendingSparse.take``, which never
        waits): a drafter asks for the next step's candidates before this step's verify forward,
        so the round trip runs while the target computes."""
        request = _sparse_request(context, cfg, version)
        calls = [stub.Retrieve.future(request, timeout=self.deadline_seconds) for stub in self._stubs]
        return PendingSparse(self, calls, cfg, version)

    def _sparse_answer(
        self, answers: list[tuple[str, datastore_pb2.RetrieveResponse]], cfg: RetrievalConfig, version: str
    ) -> SparseAnswer:
        """The shards' answers merged, from the version the request is pinned to (or most answered)."""
        if not answers:
            return SparseAnswer(Retrieval((), 0, 0, 0), version)
        chosen = self._chosen(answers, version)
        if not version:  # an unpinned answer says what the shards serve now
            self._current = chosen
        results = [sparse_from_response(a, cfg.max_length) for a in self._of_version(answers, chosen)]
        return SparseAnswer(merge(results, cfg.max_nodes, cfg.max_candidates), chosen)

    def _gather(
        self, request: datastore_pb2.RetrieveRequest
    ) -> list[tuple[str, datastore_pb2.RetrieveResponse]]:
        """(address, response) of every shard that answered in time."""
        calls = [stub.Retrieve.future(request, timeout=self.deadline_seconds) for stub in self._stubs]
        return self._answered(list(zip(self.addresses, calls, strict=True)))

    def _answered(
        self, calls: Sequence[tuple[str, grpc.Future]]
    ) -> list[tuple[str, datastore_pb2.RetrieveResponse]]:
        """(address, response) of every call that succeeded (each waited for until its deadline)."""
        answers = []
        for address, call in calls:
            try:
                answer = call.result()
            except grpc.RpcError as exc:
                self.failures[address] += 1
                log.debug("shard %s missing this step: %s", address, exc.code())
                continue
            if address not in self.foreign:
                answers.append((address, answer))
        return answers

    def _note_tokenizer(self, address: str, info: datastore_pb2.ShardInfo) -> None:
        """Leave the shard at ``address`` out while its datastore's tokenizer is not the worker's
        (a shard that does not say is trusted)."""
        theirs = info.tokenizer
        if not self.tokenizer_fingerprint or not theirs or theirs == self.tokenizer_fingerprint:
            if self.foreign.pop(address, None) is not None:
                log.warning("shard %s serves a datastore of this worker's tokenizer again", address)
            return
        if address not in self.foreign:
            log.error(
                "shard %s serves a datastore of another tokenizer (%s, this worker's is %s): left out",
                address,
                theirs,
                self.tokenizer_fingerprint,
            )
        self.foreign[address] = theirs

    def check_tokenizers(self, timeout: float = 2.0) -> tuple[list[str], list[str]]:
        """Ask every shard what it serves: (addresses whose datastore has another tokenizer,
        addresses that did not answer)."""
        request = datastore_pb2.ShardInfoRequest()
        calls = [stub.GetShardInfo.future(request, timeout=timeout) for stub in self._stubs]
        silent = []
        for address, call in zip(self.addresses, calls, strict=True):
            try:
                self._note_tokenizer(address, call.result())
            except grpc.RpcError:
                silent.append(address)
        return [a for a in self.addresses if a in self.foreign], silent

    @staticmethod
    def _chosen(answers: list[tuple[str, datastore_pb2.RetrieveResponse]], version: str) -> str:
        return version or Counter(a.version for _, a in answers).most_common(1)[0][0]

    def _of_version(
        self, answers: list[tuple[str, datastore_pb2.RetrieveResponse]], chosen: str
    ) -> Iterator[datastore_pb2.RetrieveResponse]:
        """The answers of version ``chosen``; the others are counted and reported, not merged."""
        for address, answer in answers:
            if answer.version == chosen:
                yield answer
                continue
            self.off_version[address] += 1
            if (address, answer.version) not in self._reported:
                self._reported.add((address, answer.version))
                log.warning(
                    "shard %s answers from version %s, the request from %s: its candidates are left out",
                    address,
                    answer.version,
                    chosen,
                )

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
        with self.times.timed("dense"):
            answers = self._gather(request)
            if not answers:
                return DenseAnswer(NO_DENSE, version)
            chosen = self._chosen(answers, version)
            results = [dense_from_response(a, cfg.max_length) for a in self._of_version(answers, chosen)]
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
        for address, call in zip(self.addresses, calls, strict=True):
            try:
                info = call.result()
            except grpc.RpcError:
                continue
            self._note_tokenizer(address, info)
            if address not in self.foreign:
                versions.append(info.version)
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
        # every shard at once (a blackholed one costs one timeout, not one each), the first in
        # address order that describes the version wins
        calls = [stub.GetShardInfo.future(request, timeout=self.info_timeout) for stub in self._stubs]
        for address, call in zip(self.addresses, calls, strict=True):
            try:
                info = call.result()
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


class ShardsCollector:
    """Prometheus view of a ``RemoteDatastore``: per shard, failed calls and answers left out
    because they came from another version (register on a worker's registry)."""

    def __init__(self, remote: RemoteDatastore) -> None:
        self.remote = remote

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        failed = CounterMetricFamily(
            "specdraft_shard_failures", "Shard calls that failed or missed their deadline", labels=["shard"]
        )
        off = CounterMetricFamily(
            "specdraft_shard_off_version",
            "Shard answers left out: another datastore version than the request's",
            labels=["shard"],
        )
        for address in self.remote.addresses:
            failed.add_metric([address], self.remote.failures[address])
            off.add_metric([address], self.remote.off_version[address])
        yield failed
        yield off


class SwapError(RuntimeError):
    """A swap across shards that did not happen; the text says which shard, why, and where the
    shards are now."""


def _admin_stubs(
    addresses: Sequence[str], security: ClientSecurity
) -> tuple[list[grpc.Channel], list[datastore_pb2_grpc.DatastoreAdminStub]]:
    channels = [security.channel(a) for a in addresses]
    return channels, [datastore_pb2_grpc.DatastoreAdminStub(c) for c in channels]


def load_all(
    addresses: Sequence[str], version: str, security: ClientSecurity | None = None, timeout: float = 600.0
) -> list[str]:
    """Phase one: load ``version`` on every shard (admin addresses); each shard's current version.
    If any shard cannot load it, SwapError says which and why (nothing was swapped)."""
    channels, stubs = _admin_stubs(addresses, security or ClientSecurity())
    try:
        request = datastore_pb2.LoadVersionRequest(version=version)
        calls = [s.LoadVersion.future(request, timeout=timeout) for s in stubs]
        currents = []
        for address, call in zip(addresses, calls, strict=True):
            try:
                currents.append(call.result().current)
            except grpc.RpcError as exc:
                raise SwapError(f"shard {address} refused version {version!r}: {exc.details()}") from None
        return currents
    finally:
        for channel in channels:
            channel.close()


def swap_loaded(
    addresses: Sequence[str],
    version: str,
    expected: Sequence[str],
    security: ClientSecurity | None = None,
    timeout: float = 30.0,
) -> list[tuple[str, str]]:
    """Phase two: on each shard in turn, make the loaded ``version`` current if it still serves
    ``expected[i]`` (compare-and-swap). If a shard fails, the shards already swapped return to
    their previous version and SwapError says what happened. (previous, current) per shard."""
    channels, stubs = _admin_stubs(addresses, security or ClientSecurity())
    done: list[tuple[str, datastore_pb2_grpc.DatastoreAdminStub, str]] = []  # (address, stub, previous)
    try:
        for address, stub, before in zip(addresses, stubs, expected, strict=True):
            request = datastore_pb2.SwapVersionRequest(version=version, expected_previous=before)
            try:
                resp = stub.SwapVersion(request, timeout=timeout)
            except grpc.RpcError as exc:
                undone = _roll_back(done, version, timeout)
                why = f"{exc.code().name}: {exc.details()}"
                if exc.code() in _UNKNOWN_OUTCOME:  # it may have swapped before its answer was lost
                    undone += "; " + _undo_unanswered(address, stub, before, version, timeout)
                raise SwapError(f"shard {address} did not swap to {version!r} ({why}); {undone}") from None
            done.append((address, stub, resp.previous))
        return [(previous, version) for _, _, previous in done]
    finally:
        for channel in channels:
            channel.close()


_UNKNOWN_OUTCOME = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
"""A swap call that failed with these may still have swapped on the shard."""


def _undo_unanswered(
    address: str, stub: datastore_pb2_grpc.DatastoreAdminStub, before: str, version: str, timeout: float
) -> str:
    """Return a shard whose swap call got no answer to ``before`` if it did swap (compare-and-swap
    from ``version``: a shard that never swapped refuses, which is the outcome wanted)."""
    request = datastore_pb2.SwapVersionRequest(version=before, expected_previous=version)
    try:
        stub.SwapVersion(request, timeout=timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            return f"{address} had not swapped"
        return f"{address} may still serve {version!r} ({exc.code().name}: {exc.details()})"
    return f"{address} had swapped without answering and was returned to {before!r}"


def _roll_back(
    done: list[tuple[str, datastore_pb2_grpc.DatastoreAdminStub, str]], version: str, timeout: float
) -> str:
    """Return the shards in ``done`` from ``version`` to their previous one; what happened."""
    if not done:
        return "no shard had swapped"
    failed = []
    for address, stub, previous in reversed(done):
        request = datastore_pb2.SwapVersionRequest(version=previous, expected_previous=version)
        try:
            stub.SwapVersion(request, timeout=timeout)
        except grpc.RpcError as exc:
            failed.append(f"{address} ({exc.code().name}: {exc.details()})")
    back = ", ".join(a for a, _, _ in done)
    if failed:
        return f"rolling back failed on {'; '.join(failed)}: those shards still serve {version!r}"
    return f"rolled back {back} to their previous version"


def swap_forward(
    addresses: Sequence[str],
    version: str,
    expected: Sequence[str],
    security: ClientSecurity | None = None,
    timeout: float = 600.0,
    attempts: int = 3,
) -> list[tuple[str, str]]:
    """Phase two when there is no going back (``datastore_svc.rebuild``: the shards' start link
    already names ``version``): make every shard serve ``version``, never return one. Each shard
    gets the compare-and-swap from ``expected[i]`` (what ``load_all`` reported); one that fails
    (the shard restarted or changed meanwhile, or the answer was lost) loads ``version`` again,
    which says what it serves now, and tries again, ``attempts`` times. A shard already on
    ``version`` is done. Every shard is tried; SwapError names those still behind.
    (previous, current) per shard, e.g. ``[("v1", "v2"), ("v2", "v2")]`` when shard 1 had
    restarted on v2."""
    channels, stubs = _admin_stubs(addresses, security or ClientSecurity())
    try:
        done: list[tuple[str, str]] = []
        behind: list[str] = []
        for address, stub, before in zip(addresses, stubs, expected, strict=True):
            try:
                done.append(_swap_forward(stub, version, before, timeout, attempts))
            except grpc.RpcError as exc:
                behind.append(f"{address} ({exc.code().name}: {exc.details()})")
        if behind:
            raise SwapError(f"shards still behind {version!r}: {'; '.join(behind)}; a rerun resumes")
        return done
    finally:
        for channel in channels:
            channel.close()


def _swap_forward(
    stub: datastore_pb2_grpc.DatastoreAdminStub, version: str, before: str, timeout: float, attempts: int
) -> tuple[str, str]:
    """One shard of ``swap_forward``: (previous, version); the last grpc.RpcError if it never got there."""
    failure = None
    for _ in range(attempts):
        if before == version:
            return before, version
        try:
            request = datastore_pb2.SwapVersionRequest(version=version, expected_previous=before)
            return stub.SwapVersion(request, timeout=min(timeout, 30.0)).previous, version
        except grpc.RpcError as exc:
            failure = exc
        before = stub.LoadVersion(datastore_pb2.LoadVersionRequest(version=version), timeout=timeout).current
    if before == version:
        return before, version
    assert failure is not None  # attempts >= 1
    raise failure


def swap_all(
    addresses: Sequence[str], version: str, security: ClientSecurity | None = None, timeout: float = 600.0
) -> list[tuple[str, str]]:
    """Make ``version`` current on every shard (admin addresses, one per shard): ``load_all``,
    then ``swap_loaded`` against the versions the shards reported. Either every shard swaps or
    every shard stays on (or returns to) its version; a concurrent swap makes one of the two fail
    its compare-and-swap. Returns (previous, current) per shard."""
    expected = load_all(addresses, version, security, timeout)
    return swap_loaded(addresses, version, expected, security, min(timeout, 30.0))
