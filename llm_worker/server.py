"""The worker's gRPC server: a thin ``grpc.aio`` servicer over ``Worker``.

- The engine is synchronous and CPU-bound: each decode step runs in a thread pool, so the event
  loop keeps answering health checks, new calls and cancellations. Between steps the servicer
  stops promptly when the client cancels or the deadline passes.
- Admission: at most ``max_concurrent`` generations at once (own counter, not
  ``maximum_concurrent_rpcs``); beyond it, RESOURCE_EXHAUSTED at once instead of a queue.
- Bad input → INVALID_ARGUMENT with a precise message, which quotes at most the start of what
  the request sent (``specdraft.common.shorten``; an error text is at most ``MAX_ERROR_CHARS``);
  oversized messages → RESOURCE_EXHAUSTED (gRPC's own receive limit); a prompt over
  ``max_prompt_bytes`` is refused before it is tokenized. Tokenizing, chat templating and
  building a mode's drafter run off the event loop. A generation runs at most
  ``max_generation_seconds`` (then DEADLINE_EXCEEDED, whatever the client's deadline). The
  server keeps serving.
- ``specdraft.guard`` in front: TLS / mutual TLS and bearer tokens (``ServerConfig.security``),
  malformed requests → INVALID_ARGUMENT, unexpected errors → INTERNAL with an opaque id.
- Standard health service (``grpc.health.v1``) and server reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from llm_worker import __version__
from llm_worker.config import DEFAULT_MODE, SamplingParams
from llm_worker.engine import StepOutput
from llm_worker.metrics import WorkerMetrics, kernels_label
from llm_worker.prefix_cache import PrefixCache
from llm_worker.registry import Registry, WorkerRecord
from llm_worker.results import GenerationResult, to_response
from llm_worker.stats import ThroughputWindow
from llm_worker.textstream import TextStream
from llm_worker.worker import BadRequest, Worker, WorkRequest
from specdraft.common import MAX_ERROR_CHARS, shorten
from specdraft.guard import Guard, bearer
from specdraft.security import (
    ServerSecurity,
    connection_options,
    health_only_server,
    listen,
    serve_metrics,
    tenant_namespace,
)
from specdraft.stubs import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port
    max_concurrent: int = 4
    """Generations running at once; more are refused with RESOURCE_EXHAUSTED."""
    max_message_bytes: int = 4 * 1024 * 1024
    grace_seconds: float = 30.0
    """On shutdown, requests in flight get this long to finish."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this HTTP port (0 = any free port); None = no endpoint."""
    advertise: str | None = None
    """host:port published in the registry; default: host and the bound port."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS, mutual TLS and bearer tokens (``specdraft.security``)."""
    health_port: int | None = None
    """A plaintext port serving only the health service, for probes that cannot speak TLS."""
    max_connection_age_seconds: float = 300.0
    """Close client connections (gracefully) after this long, so clients behind a Service spread
    over new pods (0 = never); keepalive pings find dead peers."""
    max_prompt_bytes: int = 256 * 1024
    """A prompt's text (or chat contents) longer than this is refused before tokenizing."""
    max_generation_seconds: float = 600.0
    """Wall time one generation may take, whatever deadline its client set."""
    log_interval_seconds: float = 30.0
    """Log a one-line throughput summary this often while the worker is busy (0 = never)."""


# -- protobuf ⇄ domain ---------------------------------------------------------------------


def to_work_request(msg: generation_pb2.GenerateRequest) -> WorkRequest:
    kind = msg.WhichOneof("prompt")
    s = msg.sampling
    sampling = SamplingParams(
        temperature=s.temperature,
        top_p=1.0 if s.top_p == 0 else s.top_p,  # 0: unset; NaN or a negative value is refused
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=1.0 if s.repetition_penalty == 0 else s.repetition_penalty,  # 0: unset
    )
    return WorkRequest(
        text=msg.text if kind == "text" else None,
        token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        chat=tuple((m.role, m.content) for m in msg.chat.messages) if kind == "chat" else None,
        mode=msg.mode or DEFAULT_MODE,
        max_new_tokens=msg.max_new_tokens,
        sampling=sampling,
        draft_budget=msg.draft_budget,
        speculation_off=msg.speculation_off,
        ignore_eos=msg.ignore_eos,
        tenant=msg.tenant,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def _tenant(requested: str, context: grpc.aio.ServicerContext) -> str:
    """The request's online-drafting namespace, inside its bearer token's
    (``specdraft.security.tenant_namespace``); ``BadRequest`` for a malformed field."""
    try:
        return tenant_namespace(requested, bearer(context))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def prompt_bytes(msg: generation_pb2.GenerateRequest) -> int:
    """The prompt's size before tokenizing: text bytes, chat content bytes, or 4 per token id."""
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        return len(msg.text.encode())
    if kind == "chat":
        return sum(len(m.content.encode()) + len(m.role.encode()) for m in msg.chat.messages)
    if kind == "token_ids":
        return 4 * len(msg.token_ids.ids)
    return 0


# -- the servicer --------------------------------------------------------------------------

_DONE = object()


def close_after(step: Future[Any] | None, steps: Iterator[Any]) -> None:
    """Close the engine's generator (which frees its KV cache and leaves the batch) once the
    step a cancelled call left running has returned: a generator cannot be closed while it runs."""
    if step is not None:
        with contextlib.suppress(BaseException):  # its outcome no longer matters, only its end
            step.result()
    close = getattr(steps, "close", None)
    if close is not None:
        close()


class _Call:
    """One RPC as the metrics see it."""

    def __init__(self, request: generation_pb2.GenerateRequest, method: str) -> None:
        self.mode = request.mode or DEFAULT_MODE
        self.method = method
        self.status = "OK"
        self.began = time.perf_counter()
        self.first_token_seen = False


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, worker: Worker, cfg: ServerConfig, metrics: WorkerMetrics | None = None) -> None:
        self.worker = worker
        self.cfg = cfg
        self.metrics = metrics or WorkerMetrics()
        self.active = 0
        self.waiting = 0  # of the active, those whose first engine step has not started
        self.draining = False
        self.window = ThroughputWindow()  # since the last summary line (``WorkerServer._summaries``)
        self.served = ThroughputWindow()  # since start
        self.executor = ThreadPoolExecutor(max_workers=cfg.max_concurrent, thread_name_prefix="decode")

    async def _abort(
        self, context: grpc.aio.ServicerContext, call: _Call, code: grpc.StatusCode, message: str
    ) -> None:
        call.status = code.name
        await context.abort(code, shorten(message, MAX_ERROR_CHARS))

    @contextlib.asynccontextmanager
    async def _observed(self, call: _Call, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Count the call under its status when it ends. A client that left is CANCELLED however
        the handler learns it: cancelled at an await, or a failed send of the next message (grpc
        raises its own error there, which would otherwise read as INTERNAL)."""
        try:
            yield
        except asyncio.CancelledError:
            call.status = "CANCELLED"
            raise
        except BaseException:
            if call.status == "OK":  # not an abort of ours (which set its own status)
                call.status = "CANCELLED" if context.cancelled() else "INTERNAL"
            raise
        finally:
            self.metrics.observe_request(
                call.mode, call.method, call.status, time.perf_counter() - call.began
            )

    async def _steps(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext, call: _Call
    ) -> AsyncIterator[tuple[StepOutput | GenerationResult, int]]:
        """Admit, validate, then run the engine one step per thread-pool call."""
        if self.draining:
            await self._abort(context, call, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if self.active >= self.cfg.max_concurrent:
            message = (
                f"the worker is at its limit of {self.cfg.max_concurrent} concurrent generations; retry later"
            )
            await self._abort(context, call, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.active += 1
        self.waiting += 1
        self.metrics.waiting.inc()
        running = False  # counted in ``specdraft_num_requests_running``, no longer waiting
        loop = asyncio.get_running_loop()
        steps: Iterator[StepOutput | GenerationResult] | None = None
        step: Future[Any] | None = None  # the step running on the pool, if any
        cancel: threading.Event | None = None
        ends = time.monotonic() + self.cfg.max_generation_seconds
        try:
            size = prompt_bytes(request)
            if size > self.cfg.max_prompt_bytes:
                message = (
                    f"the prompt has {size} bytes; this worker takes at most {self.cfg.max_prompt_bytes}"
                )
                await self._abort(context, call, grpc.StatusCode.INVALID_ARGUMENT, message)
            try:
                work = to_work_request(request)
                work = replace(work, tenant=_tenant(work.tenant, context))
                gen = await loop.run_in_executor(self.executor, self.worker.to_engine, work)
            except BadRequest as exc:
                await self._abort(context, call, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            cancel = threading.Event()  # set when the call ends early: a prefill stops at its next chunk
            gen = replace(gen, cancel=cancel)
            steps = self.worker.stream(gen)
            running = True
            self.waiting -= 1
            self.metrics.waiting.dec()
            self.metrics.in_flight.inc()
            self.metrics.observe_admitted(call.mode, len(gen.prompt_ids), time.perf_counter() - call.began)
            while True:
                step = self.executor.submit(next, steps, _DONE)
                item = await asyncio.wrap_future(step)
                if item is _DONE:
                    return
                assert isinstance(item, StepOutput | GenerationResult)
                if isinstance(item, StepOutput) and not call.first_token_seen:
                    call.first_token_seen = True
                    self.metrics.observe_first_token(call.mode, time.perf_counter() - call.began)
                if isinstance(item, GenerationResult):
                    self.metrics.observe_result(call.mode, item.stats, item.finish_reason)
                    self.window.observe(item.stats)
                    self.served.observe(item.stats)
                yield item, len(gen.prompt_ids)
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    await self._abort(context, call, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                if time.monotonic() > ends:
                    limit = self.cfg.max_generation_seconds
                    message = f"the generation ran past this worker's limit of {limit:g} s"
                    await self._abort(context, call, grpc.StatusCode.DEADLINE_EXCEEDED, message)
        finally:
            if cancel is not None:
                cancel.set()
            try:
                if steps is not None:
                    # off the event loop, after a step a cancellation left running (it still holds
                    # a pool thread and the model's forwards, so it still counts as active)
                    with contextlib.suppress(Exception):
                        await loop.run_in_executor(self.executor, close_after, step, steps)
            finally:
                self.active -= 1
                if running:
                    self.metrics.in_flight.dec()
                else:
                    self.waiting -= 1
                    self.metrics.waiting.dec()

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        call = _Call(request, "Generate")
        async with self._observed(call, context):
            async for item, prompt_tokens in self._steps(request, context, call):
                if isinstance(item, GenerationResult):
                    text = self.worker.text(item, request.stop)
                    return to_response(item, text, prompt_tokens, self.worker.worker_id)
            await self._abort(context, call, grpc.StatusCode.INTERNAL, "generation ended without a result")
        raise AssertionError("unreachable")

    async def GenerateStream(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateChunk]:
        call = _Call(request, "GenerateStream")
        stream = TextStream(self.worker.decode, request.stop)
        async with self._observed(call, context):
            async for item, prompt_tokens in self._steps(request, context, call):
                if isinstance(item, StepOutput):
                    yield generation_pb2.GenerateChunk(
                        token_ids=item.token_ids, text=stream.push(item.token_ids)
                    )
                else:
                    rest = stream.finish()
                    if rest:  # text held back for an unfinished character: the tokens never finished it
                        yield generation_pb2.GenerateChunk(text=rest)
                    final = to_response(
                        item, self.worker.text(item, request.stop), prompt_tokens, self.worker.worker_id
                    )
                    yield generation_pb2.GenerateChunk(final=final)

    async def ListModes(
        self, request: generation_pb2.ListModesRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModesResponse:
        modes = [
            generation_pb2.ModeInfo(
                name=m.name,
                summary=m.summary,
                options=m.options,
                available=m.available,
                unavailable_reason=m.unavailable_reason,
            )
            for m in self.worker.modes()
        ]
        return generation_pb2.ListModesResponse(modes=modes)

    async def GetModelInfo(
        self, request: generation_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        i = self.worker.model_info
        return generation_pb2.ModelInfo(
            name=i.name,
            fingerprint=i.fingerprint,
            vocab_size=i.vocab_size,
            max_context=i.max_context,
            dtype=i.dtype,
            device=i.device,
            backend=i.backend,
            eos_token_ids=list(i.eos_token_ids),
            worker_id=self.worker.worker_id,
            version=__version__,
        )


# -- the server ----------------------------------------------------------------------------


def describe_datastore(datastore: Any) -> str:
    """The datastore a worker drafts from, for its log: "none", its version directory, or the
    shard addresses of a remote fan-out."""
    from datastore_svc.fanout import RemoteDatastore
    from datastore_svc.store import LocalRetriever

    if datastore is None:
        return "none"
    if isinstance(datastore, LocalRetriever):
        return f"{datastore.current.path} (in process)"
    if isinstance(datastore, RemoteDatastore):
        return "shards at " + ", ".join(datastore.addresses)
    return type(datastore).__name__


class DroppedDrafts:
    """Prometheus view of ``Engine.dropped_drafts``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(
            "specdraft_drafts_dropped_untrusted",
            "Drafts dropped before the forward: a token id outside the vocabulary",
            self.engine.dropped_drafts,
        )


class PrefixCacheCollector:
    """Prometheus view of the engine's prefix cache (``llm_worker.prefix_cache``), counted in
    prompt tokens as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, and its memory."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.cache.stats
        yield CounterMetricFamily(
            "specdraft_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (each prompt's reusable whole blocks)",
            stats.queried_tokens,
        )
        yield CounterMetricFamily(
            "specdraft_prefix_cache_hits", "Of those, prompt tokens found cached", stats.hit_tokens
        )
        yield GaugeMetricFamily(
            "specdraft_prefix_cache_bytes", "Memory the prefix cache's blocks hold", self.cache.stored_bytes
        )


def watch_engine(worker: Worker, metrics: WorkerMetrics) -> None:
    """Export what ``worker``'s engine counts in ``metrics``: requests and rows per batched
    forward, the dense query cache, the shards, dropped drafts, the prefix cache, the model, the
    KV cache's use (every server of a worker calls this once: gRPC, and HTTP in process)."""
    if worker.engine.scheduler is not None:  # requests and rows per batched forward
        worker.engine.scheduler.on_batch = metrics.observe_batch
    queries = worker.engine.resources.dense_queries
    if queries is not None:  # hit rate and saved time of the dense query cache
        from datastore_svc.cache import CacheCollector

        metrics.registry.register(CacheCollector(queries))
    from datastore_svc.fanout import RemoteDatastore, ShardsCollector

    if isinstance(worker.engine.resources.datastore, RemoteDatastore):  # per shard: failures, off-version
        metrics.registry.register(ShardsCollector(worker.engine.resources.datastore))
    metrics.registry.register(DroppedDrafts(worker.engine))
    cache = worker.engine.prefix_cache
    if cache is not None and worker.engine.target.prefix_reuse:
        metrics.registry.register(PrefixCacheCollector(cache))
    metrics.describe_model(worker.model_info, worker.engine.target.kernel_info())
    metrics.watch_kv_cache(worker.engine.target.kv_cache_usage)


class WorkerServer:
    """A running worker: gRPC server, health, reflection. ``start`` / ``stop`` on one event loop."""

    def __init__(
        self,
        worker: Worker,
        cfg: ServerConfig,
        metrics: WorkerMetrics | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.worker = worker
        self.cfg = cfg
        self.metrics = metrics or WorkerMetrics()
        watch_engine(worker, self.metrics)
        self.registry = registry
        self.metrics_port: int | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._summaries: asyncio.Task[None] | None = None
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *connection_options(cfg.max_connection_age_seconds),
        ]
        guard = Guard(cfg.security, {SERVICE_NAME: "client"}, refusals=self.metrics.auth_refusals)
        self.server = grpc.aio.server(options=options, interceptors=[guard])
        self.servicer = GenerationServicer(worker, cfg, self.metrics)
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.port = 0
        self.modes: tuple[str, ...] = ()
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None

    async def start(self) -> int:
        self.port = listen(self.server, self.cfg.host, self.cfg.port, self.cfg.security)
        # grpc's health servicer starts out SERVING for "": not before we say so.
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.cfg.health_port is not None:
            self.health_server, self.health_port = health_only_server(
                self.cfg.host, self.cfg.health_port, self.health, self.cfg.security
            )
            await self.health_server.start()
        if self.cfg.metrics_port is not None:
            self.metrics_port = serve_metrics(
                self.metrics.registry, self.cfg.host, self.cfg.metrics_port, self.cfg.security
            )
        described = await asyncio.to_thread(self.worker.modes)
        self.modes = tuple(m.name for m in described if m.available)
        if self.registry is not None:
            await self._publish()
            self._heartbeat = asyncio.create_task(self._beat())
        if self.cfg.log_interval_seconds > 0:
            self._summaries = asyncio.create_task(self._summarize(self.cfg.log_interval_seconds))
        # SERVING last: once health says so, the worker is also discoverable in the registry.
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(SERVICE_NAME, serving)
        for line in self.startup_summary([m.name for m in described if not m.available]):
            log.info("%s", line)
        return self.port

    def startup_summary(self, unavailable: list[str]) -> list[str]:
        """What the worker serves and how, for its log. Example:

        worker w-1 serving on 127.0.0.1:50051 (plaintext, no token check; metrics on port 9100)
        model SmolLM2-135M-Instruct, float32 on cpu, backend fast, kernels quant:1+fused
        modes: ar, pld, pld+h, suffix (unavailable here: rest, dresd, glide); datastore: none
        """
        info, security = self.worker.model_info, self.cfg.security
        kernels = kernels_label(self.worker.engine.target.kernel_info())
        access = "TLS" if security.tls else "plaintext"
        access += " with client certificates" if security.ca else ""
        access += ", bearer tokens" if security.tokens else ", no token check"
        ports = [f"metrics on port {self.metrics_port}" if self.metrics_port is not None else "no metrics"]
        if self.health_port is not None:
            ports.append(f"health also on port {self.health_port}")
        datastore = self.worker.engine.resources.datastore
        registry = "published in the registry" if self.registry is not None else "no registry"
        return [
            f"worker {self.worker.worker_id} serving on {self.cfg.host}:{self.port} "
            f"({access}; {'; '.join(ports)}; {registry})",
            f"model {info.name}, {info.dtype} on {info.device}, backend {info.backend}, kernels {kernels}; "
            f"batching {'on' if self.worker.engine.scheduler is not None else 'off'}, "
            f"at most {self.cfg.max_concurrent} generations at once",
            f"modes: {', '.join(self.modes) or 'none'}"
            + (f" (unavailable here: {', '.join(unavailable)})" if unavailable else "")
            + f"; datastore: {describe_datastore(datastore)}",
        ]

    async def _summarize(self, interval: float) -> None:
        """Every ``interval`` seconds while busy (a generation finished or running), one line of
        throughput (``ThroughputWindow.line``)."""
        began = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            window, self.servicer.window = self.servicer.window, ThroughputWindow()
            if window.requests or self.servicer.active:
                running = self.servicer.active - self.servicer.waiting
                log.info("%s", window.line(now - began, running, self.servicer.waiting))
            began = now

    def record(self) -> WorkerRecord:
        info = self.worker.model_info
        return WorkerRecord(
            worker_id=self.worker.worker_id,
            address=self.cfg.advertise or f"{self.cfg.host}:{self.port}",
            model=info.name,
            fingerprint=info.fingerprint,
            modes=self.modes,
            load=self.servicer.active,
            capacity=self.cfg.max_concurrent,
            version=__version__,
        )

    async def _publish(self) -> None:
        """Publish (or refresh) this worker's record; a registry failure never stops serving."""
        assert self.registry is not None
        try:
            await asyncio.to_thread(self.registry.publish, self.record())
        except Exception as exc:  # Redis down or slow: keep serving, try again next beat
            log.warning("registry unavailable, still serving: %s", exc)

    async def _beat(self) -> None:
        assert self.registry is not None
        interval = max(0.05, getattr(self.registry, "ttl", 10.0) / 3)
        while True:
            await asyncio.sleep(interval)
            await self._publish()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING, leave the registry, refuse new calls, let calls in flight
        finish within grace."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        for task in (self._heartbeat, self._summaries):
            if task is not None:
                task.cancel()
        if self.registry is not None:
            try:
                await asyncio.to_thread(self.registry.remove, self.worker.worker_id)
            except Exception as exc:
                log.warning("could not deregister from the registry: %s", exc)
        await self.server.stop(self.cfg.grace_seconds if grace is None else grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        self.servicer.executor.shutdown(wait=False, cancel_futures=True)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def serve_worker(
    worker: Worker, cfg: ServerConfig, ready: Any = None, registry: Registry | None = None
) -> None:
    """Run until SIGTERM / SIGINT, then drain gracefully."""
    import signal

    async def main() -> None:
        server = WorkerServer(worker, cfg, registry=registry)
        port = await server.start()
        if ready is not None:
            ready(port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info(
            "draining: %d generations running, refusing new ones (grace %.0f s)",
            server.servicer.active,
            cfg.grace_seconds,
        )
        await server.stop()
        served = server.servicer.served
        log.info("stopped: %d generations served, %d tokens", served.requests, served.new_tokens)

    asyncio.run(main())
