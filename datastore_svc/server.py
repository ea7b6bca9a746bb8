"""A datastore shard as gRPC servers: thin ``grpc.aio`` servicers over ``ShardState``.

- The data port serves ``Datastore`` — Retrieve (sparse or dense: the request's query says
  which), GetShardInfo (with the dense statistics on request) — the standard health service and
  server reflection.
- The admin port serves ``DatastoreAdmin`` — LoadVersion (a version *name* under the versions
  root), SwapVersion (compare-and-swap) — for the admin identity only (``specdraft.guard``).
- Retrievals run in a bounded thread pool: at most ``max_pending`` wait or run; beyond that,
  RESOURCE_EXHAUSTED at once. A request whose deadline passed before its turn is dropped without
  computing (counted). The event loop never computes, so health answers stay fast.
- Bad input gets INVALID_ARGUMENT (a version name that cannot be one too), an unknown version
  NOT_FOUND, a version that cannot be loaded (or has no dense index) FAILED_PRECONDITION — and the
  shard keeps serving its current version. Error texts quote at most the start of what a request
  sent (``specdraft.common.shorten``). Prometheus metrics on an HTTP port. With a Redis URL, the
  shard publishes each loaded version's dense statistics there.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from datastore_svc.cache import StatsCache, link_for
from datastore_svc.dense import DenseConfig, DenseRetrieval, DenseSource
from datastore_svc.retrieval import Retrieval, RetrievalConfig, Source
from datastore_svc.shard import (
    BadVersionName,
    ShardState,
    UnexpectedVersion,
    VersionMissing,
    VersionNotLoaded,
)
from datastore_svc.store import DatastoreError
from specdraft.common import MAX_ERROR_CHARS, shorten
from specdraft.guard import Guard, refusals_counter
from specdraft.security import (
    ServerSecurity,
    connection_options,
    health_only_server,
    listen,
    serve_metrics,
)
from specdraft.stubs import datastore_pb2, datastore_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVICE_NAME = datastore_pb2.DESCRIPTOR.services_by_name["Datastore"].full_name
ADMIN_SERVICE_NAME = datastore_pb2.DESCRIPTOR.services_by_name["DatastoreAdmin"].full_name
MAX_CONTEXT = 1024
MAX_LENGTH = 256
MAX_CANDIDATES = 1024
MAX_OCCURRENCES = 100_000
MAX_TOP_K = 4096


@dataclass(frozen=True)
class ShardServerConfig:
    host: str = "127.0.0.1"
    port: int = 50061  # 0 = a free port
    admin_port: int | None = 50062
    """The DatastoreAdmin service's own port (0 = a free one; None = no admin service)."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS, mutual TLS, tokens and the admin identity (``specdraft.security``)."""
    health_port: int | None = None
    """A plaintext port serving only the health service, for probes that cannot speak TLS."""
    max_connection_age_seconds: float = 300.0
    """Close client connections (gracefully) after this long, so clients behind a Service spread
    over new pods (0 = never); keepalive pings find dead peers."""
    retrieve_threads: int = 2
    """Threads that compute retrievals."""
    max_pending: int = 16
    """Retrievals waiting or running at once; more get RESOURCE_EXHAUSTED."""
    metrics_port: int | None = None
    grace_seconds: float = 10.0
    defaults: RetrievalConfig = field(default_factory=RetrievalConfig)
    """N and max_nodes when a request leaves them 0."""
    dense_defaults: DenseConfig = field(default_factory=DenseConfig)
    """top_k, D and L of dense retrieval when a request leaves them 0."""
    redis_url: str | None = None
    """Publish each loaded version's dense statistics here (a cache: Redis down is harmless)."""


@dataclass
class ShardMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "specdraft_datastore_requests",
            "Datastore calls by method and status",
            ["method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "specdraft_datastore_retrieve_seconds",
            "Retrieve latency inside the shard",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
            registry=r,
        )
        self.candidates = Histogram(
            "specdraft_datastore_candidates",
            "Candidates returned",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.tokens = Gauge("specdraft_datastore_tokens", "Tokens in the current version's shard", registry=r)
        self.swaps = Counter("specdraft_datastore_swaps", "Version swaps", registry=r)
        self.expired = Counter(
            "specdraft_datastore_expired",
            "Retrievals dropped without computing: their deadline passed before their turn",
            registry=r,
        )
        self.pending = Gauge("specdraft_datastore_pending", "Retrievals waiting or running", registry=r)
        self.auth_refusals = refusals_counter(r)


def sparse_config_from(msg: datastore_pb2.RetrieveRequest, defaults: RetrievalConfig) -> RetrievalConfig:
    """The sparse request's retrieval shape, checked; ValueError names the bad field."""
    query = msg.sparse
    if not query.context:
        raise ValueError("context is empty (sparse retrieval needs the last context tokens)")
    if len(query.context) > MAX_CONTEXT:
        raise ValueError(f"context has {len(query.context)} tokens; at most {MAX_CONTEXT}")
    if msg.max_length > MAX_LENGTH or msg.max_candidates > MAX_CANDIDATES or query.max_nodes > MAX_CANDIDATES:
        raise ValueError(f"max_length ≤ {MAX_LENGTH}, max_candidates and max_nodes ≤ {MAX_CANDIDATES}")
    if query.max_occurrences > MAX_OCCURRENCES:
        raise ValueError(f"max_occurrences ≤ {MAX_OCCURRENCES}")
    c_min = max(1, query.min_match)
    if c_min > len(query.context):
        raise ValueError(f"min_match {c_min} exceeds the context length {len(query.context)}")
    return RetrievalConfig(
        c_min=c_min,
        c_max=len(query.context),
        max_occurrences=query.max_occurrences or defaults.max_occurrences,
        max_length=msg.max_length or defaults.max_length,
        max_nodes=query.max_nodes or defaults.max_nodes,
        max_candidates=msg.max_candidates or defaults.max_candidates,
    )


def dense_config_from(msg: datastore_pb2.RetrieveRequest, defaults: DenseConfig, dims: int) -> DenseConfig:
    """The dense request's retrieval shape, checked; ValueError names the bad field."""
    query = msg.dense
    if len(query.embedding) != dims:
        raise ValueError(f"embedding has {len(query.embedding)} dimensions; this version's keys have {dims}")
    if query.top_k > MAX_TOP_K or msg.max_length > MAX_LENGTH or msg.max_candidates > MAX_CANDIDATES:
        raise ValueError(f"top_k ≤ {MAX_TOP_K}, max_length ≤ {MAX_LENGTH}, max_candidates ≤ {MAX_CANDIDATES}")
    return DenseConfig(
        top_k=query.top_k or defaults.top_k,
        max_candidates=msg.max_candidates or defaults.max_candidates,
        max_length=msg.max_length or defaults.max_length,
    )


def dense_response(result: DenseRetrieval, version: str) -> datastore_pb2.RetrieveResponse:
    resp = datastore_pb2.RetrieveResponse(
        version=version, dense=datastore_pb2.DenseDetail(matched=result.matched, searched=result.searched)
    )
    for cand in result.candidates:
        msg = resp.candidates.add(tokens=cand.tokens, count=cand.count, score=cand.score)
        _fill_source(msg, cand.source)
    return resp


def _fill_source(msg: datastore_pb2.Candidate, source: Source | DenseSource | None) -> None:
    """The candidate message's source (shard, document, offset), if the candidate has one."""
    if source is not None:
        msg.source.shard = source.shard
        msg.source.document = source.document
        msg.source.offset = source.offset


def sparse_response(result: Retrieval, version: str) -> datastore_pb2.RetrieveResponse:
    detail = datastore_pb2.SparseDetail(
        match_length=result.match_length, occurrences=result.occurrences, sampled=result.sampled
    )
    resp = datastore_pb2.RetrieveResponse(version=version, sparse=detail)
    for cand in result.candidates:
        msg = resp.candidates.add(tokens=cand.tokens, count=cand.count, prefix_counts=cand.counts)
        msg.score = cand.count / max(result.sampled, 1)
        _fill_source(msg, cand.source)
    return resp


class Expired(Exception):
    """The request's deadline passed before its retrieval started."""


class _Counted:
    """A servicer whose ended calls are counted by method and status."""

    metrics: ShardMetrics

    async def _abort(
        self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, message: str
    ) -> None:
        self.metrics.requests.labels(method, code.name).inc()
        await context.abort(code, shorten(message, MAX_ERROR_CHARS))


class DatastoreServicer(_Counted, datastore_pb2_grpc.DatastoreServicer):
    def __init__(self, state: ShardState, cfg: ShardServerConfig, metrics: ShardMetrics) -> None:
        self.state = state
        self.cfg = cfg
        self.metrics = metrics
        self.draining = False
        self.pending = 0
        self.executor = ThreadPoolExecutor(max_workers=cfg.retrieve_threads, thread_name_prefix="retrieve")

    async def _compute(self, context: grpc.aio.ServicerContext, work: Callable[[], T]) -> T:
        """Run ``work`` in the retrieval pool: refused beyond ``max_pending``, dropped if the
        caller's deadline passes before it starts."""
        if self.pending >= self.cfg.max_pending:
            message = f"the shard has {self.cfg.max_pending} retrievals pending; retry later"
            await self._abort(context, "Retrieve", grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining

        def run() -> T:
            if deadline is not None and time.monotonic() >= deadline:
                raise Expired
            return work()

        self.pending += 1
        self.metrics.pending.set(self.pending)
        job = self.executor.submit(run)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:  # the caller left (deadline, cancel): drop the job if queued
            if job.cancel():
                self.metrics.expired.inc()
            raise
        except Expired:
            self.metrics.expired.inc()
            message = "deadline passed before the retrieval"
            await self._abort(context, "Retrieve", grpc.StatusCode.DEADLINE_EXCEEDED, message)
            raise  # not reached: abort raises
        finally:
            self.pending -= 1
            self.metrics.pending.set(self.pending)

    async def Retrieve(
        self, request: datastore_pb2.RetrieveRequest, context: grpc.aio.ServicerContext
    ) -> datastore_pb2.RetrieveResponse:
        t0 = time.perf_counter()
        if self.draining:
            await self._abort(context, "Retrieve", grpc.StatusCode.UNAVAILABLE, "the shard is shutting down")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            self.metrics.expired.inc()
            await self._abort(
                context, "Retrieve", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline already passed"
            )
        kind = request.WhichOneof("query")
        if kind == "dense":
            return await self._retrieve_dense(request, context, t0)
        if kind != "sparse":
            message = "RetrieveRequest needs a query: sparse (context tokens) or dense (an embedding)"
            await self._abort(context, "Retrieve", grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            cfg = sparse_config_from(request, self.cfg.defaults)
            store = self.state.version(request.version)
        except ValueError as exc:
            await self._abort(context, "Retrieve", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except VersionNotLoaded as exc:
            await self._abort(context, "Retrieve", grpc.StatusCode.NOT_FOUND, str(exc))
        tokens = np.asarray(request.sparse.context, dtype=np.int64)
        separator = int(store.manifest["separator"])
        if tokens.min() < 0 or tokens.max() >= separator:
            message = f"context token ids must lie in [0, {separator})"
            await self._abort(context, "Retrieve", grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            result, version = await self._compute(
                context, lambda: self.state.retrieve(tokens, cfg, store.version)
            )
        except VersionNotLoaded as exc:  # released between the lookup and now
            await self._abort(context, "Retrieve", grpc.StatusCode.NOT_FOUND, str(exc))
        self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.candidates.observe(len(result.candidates))
        self.metrics.requests.labels("Retrieve", "OK").inc()
        return sparse_response(result, version)

    async def _retrieve_dense(
        self, request: datastore_pb2.RetrieveRequest, context: grpc.aio.ServicerContext, t0: float
    ) -> datastore_pb2.RetrieveResponse:
        try:
            store = self.state.version(request.version)
        except BadVersionName as exc:
            await self._abort(context, "Retrieve", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except VersionNotLoaded as exc:
            await self._abort(context, "Retrieve", grpc.StatusCode.NOT_FOUND, str(exc))
        stats = store.dense_stats
        if stats is None:
            message = f"version {store.version} has no dense index (build it with --dense)"
            await self._abort(context, "Retrieve", grpc.StatusCode.FAILED_PRECONDITION, message)
            return datastore_pb2.RetrieveResponse()  # not reached: abort raises
        separator = int(store.manifest["separator"])
        dense = request.dense
        query = np.asarray(dense.embedding, dtype=np.float32)
        try:
            cfg = dense_config_from(request, self.cfg.dense_defaults, stats.dims)
            if not np.isfinite(query).all():
                raise ValueError("embedding has non-finite values")
            if not 0 <= dense.next_token < separator:
                raise ValueError(f"next_token must lie in [0, {separator})")
        except ValueError as exc:
            await self._abort(context, "Retrieve", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result, version = await self._compute(
                context,
                lambda: self.state.retrieve_dense(query, int(dense.next_token), cfg, store.version),
            )
        except VersionNotLoaded as exc:
            await self._abort(context, "Retrieve", grpc.StatusCode.NOT_FOUND, str(exc))
        self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.candidates.observe(len(result.candidates))
        self.metrics.requests.labels("Retrieve", "OK").inc()
        return dense_response(result, version)

    async def GetShardInfo(
        self, request: datastore_pb2.ShardInfoRequest, context: grpc.aio.ServicerContext
    ) -> datastore_pb2.ShardInfo:
        try:
            store = self.state.version(request.version)
        except BadVersionName as exc:
            await self._abort(context, "GetShardInfo", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except VersionNotLoaded as exc:
            await self._abort(context, "GetShardInfo", grpc.StatusCode.NOT_FOUND, str(exc))
        self.metrics.requests.labels("GetShardInfo", "OK").inc()
        info = datastore_pb2.ShardInfo(
            shard=self.state.index,
            shards=store.num_shards,
            version=store.version,
            tokenizer=str(store.manifest["tokenizer"].get("fingerprint", "")),
            model=str(store.manifest.get("model", "")),
            tokens=store.tokens,
            loaded_versions=self.state.loaded_versions(),
        )
        stats = store.dense_stats
        if stats is not None:
            dense = store.manifest["dense"]
            info.dense.dims = stats.dims
            info.dense.keys = sum(s.dense.index.ntotal for s in store.shards if s.dense is not None)
            info.dense.index = str(dense.get("index", ""))
            info.dense.model_fingerprint = store.dense_model
            info.dense.stats_digest = stats.digest()
            if request.include_stats:
                info.dense.stats = stats.to_bytes()
        return info


class AdminServicer(_Counted, datastore_pb2_grpc.DatastoreAdminServicer):
    """Load and swap versions; the guard lets only the admin identity call these."""

    def __init__(self, state: ShardState, cfg: ShardServerConfig, metrics: ShardMetrics) -> None:
        self.state = state
        self.metrics = metrics
        self.stats_cache = StatsCache(link_for(cfg.redis_url)) if cfg.redis_url else None

    def _quiet(self, text: str) -> str:
        """An error text without the versions root's place on disk."""
        return text.replace(f"{self.state.versions_root.resolve()}/", "").replace(
            f"{self.state.versions_root}/", ""
        )

    async def LoadVersion(
        self, request: datastore_pb2.LoadVersionRequest, context: grpc.aio.ServicerContext
    ) -> datastore_pb2.LoadVersionResponse:
        try:
            name = await asyncio.to_thread(self.state.load, request.version)
        except BadVersionName as exc:
            await self._abort(context, "LoadVersion", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except VersionMissing as exc:
            await self._abort(context, "LoadVersion", grpc.StatusCode.NOT_FOUND, str(exc))
        except (DatastoreError, OSError, RuntimeError) as exc:  # also unreadable files, loops, faiss
            message = f"version {request.version!r} cannot be loaded: {self._quiet(str(exc))}"
            await self._abort(context, "LoadVersion", grpc.StatusCode.FAILED_PRECONDITION, message)
        log.info("shard %d loaded version %s", self.state.index, name)
        await asyncio.to_thread(self.publish_stats, name)
        self.metrics.requests.labels("LoadVersion", "OK").inc()
        return datastore_pb2.LoadVersionResponse(version=name, current=self.state.current_version())

    async def SwapVersion(
        self, request: datastore_pb2.SwapVersionRequest, context: grpc.aio.ServicerContext
    ) -> datastore_pb2.SwapVersionResponse:
        try:
            previous, current = self.state.swap(request.version, request.expected_previous)
        except BadVersionName as exc:
            await self._abort(context, "SwapVersion", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (VersionNotLoaded, UnexpectedVersion) as exc:
            await self._abort(context, "SwapVersion", grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info("shard %d swapped %s -> %s", self.state.index, previous, current)
        self.metrics.swaps.inc()
        self.metrics.tokens.set(self.state.current.tokens)
        self.metrics.requests.labels("SwapVersion", "OK").inc()
        return datastore_pb2.SwapVersionResponse(previous=previous, current=current)

    def publish_stats(self, name: str = "") -> None:
        """Put the version's dense statistics in Redis for workers (no-op without Redis or stats)."""
        store = self.state.version(name)
        stats = store.dense_stats
        if (
            self.stats_cache is not None
            and stats is not None
            and self.stats_cache.publish(store.version, stats)
        ):
            log.info("published the dense statistics of %s to redis", store.version)


def _health_and_reflection(
    server: grpc.aio.Server, services: tuple[str, ...], health: health_aio.HealthServicer | None = None
) -> health_aio.HealthServicer:
    """Health (``health``, or a new servicer) and reflection of ``services`` on ``server``."""
    health = health or health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health


class ShardServer:
    def __init__(
        self, state: ShardState, cfg: ShardServerConfig, metrics: ShardMetrics | None = None
    ) -> None:
        self.state = state
        self.cfg = cfg
        self.metrics = metrics or ShardMetrics()
        self.metrics.tokens.set(state.current.tokens)
        roles = {SERVICE_NAME: "client", ADMIN_SERVICE_NAME: "admin"}

        def observe(method: str, code: str) -> None:
            self.metrics.requests.labels(method, code).inc()

        guard = Guard(cfg.security, roles, observe, self.metrics.auth_refusals)  # type: ignore[arg-type]
        options = [("grpc.so_reuseport", 0), *connection_options(cfg.max_connection_age_seconds)]
        self.server = grpc.aio.server(options=options, interceptors=[guard])
        self.servicer = DatastoreServicer(state, cfg, self.metrics)
        datastore_pb2_grpc.add_DatastoreServicer_to_server(self.servicer, self.server)
        self.health = _health_and_reflection(self.server, (SERVICE_NAME,))
        self.admin = AdminServicer(state, cfg, self.metrics)
        self.admin_server: grpc.aio.Server | None = None
        if cfg.admin_port is not None:
            self.admin_server = grpc.aio.server(options=options, interceptors=[guard])
            datastore_pb2_grpc.add_DatastoreAdminServicer_to_server(self.admin, self.admin_server)
            # the data port's health: the admin port says what the shard says (NOT_SERVING while
            # starting or draining), not SERVING from construction to the end
            _health_and_reflection(self.admin_server, (ADMIN_SERVICE_NAME,), self.health)
        self.port = 0
        self.admin_port: int | None = None
        self.metrics_port: int | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None

    async def start(self) -> int:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = listen(self.server, self.cfg.host, self.cfg.port, self.cfg.security)
        if self.admin_server is not None:
            assert self.cfg.admin_port is not None
            self.admin_port = listen(self.admin_server, self.cfg.host, self.cfg.admin_port, self.cfg.security)
            await self.admin_server.start()
        if self.cfg.health_port is not None:
            self.health_server, self.health_port = health_only_server(
                self.cfg.host, self.cfg.health_port, self.health, self.cfg.security
            )
            await self.health_server.start()
        await self.server.start()
        await asyncio.to_thread(self.admin.publish_stats)
        if self.cfg.metrics_port is not None:
            self.metrics_port = serve_metrics(
                self.metrics.registry, self.cfg.host, self.cfg.metrics_port, self.cfg.security
            )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        grace = self.cfg.grace_seconds if grace is None else grace
        if self.admin_server is not None:
            await self.admin_server.stop(grace)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        self.servicer.executor.shutdown(wait=False, cancel_futures=True)


def serve_shard(
    state: ShardState, cfg: ShardServerConfig, ready: Callable[[ShardServer], None] | None = None
) -> None:
    """Run until SIGTERM / SIGINT, then drain."""

    async def main() -> None:
        server = ShardServer(state, cfg)
        await server.start()
        if ready is not None:
            ready(server)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
