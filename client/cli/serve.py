"""``specdraft serve worker`` (an LLM worker), ``serve http`` (the OpenAI API over HTTP) and
``specdraft serve datastore`` (one shard)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from client.cli.common import (
    CliError,
    add_chat_template_arg,
    add_client_security_args,
    add_datastore_args,
    add_model_args,
    add_online_store_args,
    add_server_security_args,
    addresses,
    chat_template,
    client_security,
    engine_from_args,
    server_security,
)


def add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run a service")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    w = serve_sub.add_parser("worker", help="an LLM worker (gRPC Generation service)")
    add_model_args(w)
    add_datastore_args(w)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=50051, help="0 = any free port")
    _add_worker_args(w, "RESOURCE_EXHAUSTED")
    w.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    w.add_argument(
        "--log-interval",
        type=float,
        default=30.0,
        help="seconds between one-line throughput summaries on stderr while busy (0 = none)",
    )
    w.add_argument(
        "--registry", default=None, help="publish this worker in a registry: redis://HOST:PORT[/DB]"
    )
    w.add_argument(
        "--registry-ttl", type=float, default=10.0, help="seconds a record lives without a heartbeat"
    )
    w.add_argument(
        "--advertise", default=None, help="host:port to publish (default: --host and the bound port)"
    )
    add_server_security_args(w)
    w.set_defaults(func=cmd_serve_worker)

    h = serve_sub.add_parser(
        "http",
        help="an OpenAI-compatible HTTP API: a worker in this process, or in front of gRPC workers",
    )
    add_model_args(h)
    add_datastore_args(h)
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=8000, help="0 = any free port")
    h.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: its Hub id, or its directory's name)",
    )
    _add_worker_args(h, "429")
    pool = h.add_argument_group("in front of gRPC workers (instead of a worker in this process)")
    pool.add_argument("--workers", type=addresses, default=(), help="HOST:PORT[,HOST:PORT...] of workers")
    pool.add_argument("--registry", default=None, help="the workers' registry: redis://USER@HOST:PORT[/DB]")
    add_client_security_args(h, prefix="worker-")
    add_server_security_args(h)
    h.set_defaults(func=cmd_serve_http)

    ds = serve_sub.add_parser("datastore", help="one datastore shard (gRPC Datastore service)")
    ds.add_argument("--datastore", required=True, help="the version directory to serve first")
    ds.add_argument("--shard", type=int, default=0, help="which shard of the version")
    ds.add_argument("--host", default="127.0.0.1")
    ds.add_argument("--port", type=int, default=50061, help="0 = any free port")
    ds.add_argument(
        "--admin-port",
        type=int,
        default=50062,
        help="port of the DatastoreAdmin service (LoadVersion, SwapVersion); 0 = any free port",
    )
    ds.add_argument(
        "--versions-root",
        help="directory whose subdirectories LoadVersion may load (default: the one holding --datastore)",
    )
    ds.add_argument("--retrieve-threads", type=int, default=2, help="threads that compute retrievals")
    ds.add_argument(
        "--max-pending",
        type=int,
        default=16,
        help="retrievals waiting or running; more get RESOURCE_EXHAUSTED",
    )
    ds.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ds.add_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    ds.add_argument(
        "--drain-seconds",
        type=float,
        default=60.0,
        help="keep a swapped-out version this long for its requests",
    )
    ds.add_argument("--redis", help="publish each loaded version's dense statistics here (redis://HOST:PORT)")
    ds.add_argument(
        "--faiss-gpu", type=int, default=None, help="search dense indexes on this GPU (needs faiss-gpu)"
    )
    add_server_security_args(ds, admin=True)
    ds.set_defaults(func=cmd_serve_datastore)


def _add_worker_args(p: argparse.ArgumentParser, refusal: str) -> None:
    """The options of a worker and its limits (``serve worker``, ``serve http``); ``refusal``:
    what a generation over ``--max-concurrent`` gets."""
    p.add_argument("--max-concurrent", type=int, default=4, help=f"generations at once; more get {refusal}")
    p.add_argument(
        "--no-batching",
        dest="batching",
        action="store_false",
        help="run each generation's forwards on their own instead of every active generation's new "
        "tokens in one forward (continuous batching, the default)",
    )
    p.add_argument("--max-batch-rows", type=int, default=512, help="most new tokens in one batched forward")
    p.add_argument("--grace-seconds", type=float, default=30.0, help="drain time on SIGTERM")
    p.add_argument("--default-max-new-tokens", type=int, default=256)
    add_chat_template_arg(p)
    p.add_argument("--worker-id", default=None)
    p.add_argument(
        "--no-warm", dest="warm", action="store_false", help="skip measuring the cost curve at start"
    )
    p.add_argument(
        "--max-prompt-bytes", type=int, default=256 * 1024, help="refuse longer prompts before tokenizing"
    )
    p.add_argument(
        "--max-generation-seconds", type=float, default=600.0, help="wall time one generation may take"
    )
    add_online_store_args(p)


def _worker(args: argparse.Namespace) -> Any:
    """The ``Worker`` of the model, datastore and worker options, ready for traffic."""
    if args.max_batch_rows < 1:
        raise CliError(f"--max-batch-rows must be >= 1, got {args.max_batch_rows}")
    template = chat_template(args)
    engine, _, tokenizer = engine_from_args(args)
    if args.batching:
        from llm_worker.batching import BatchingConfig
        from llm_worker.engine import Engine

        engine = Engine(
            engine.target,
            engine.config,
            resources=engine.resources,
            batching=BatchingConfig(args.max_batch_rows),
        )
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.worker import Worker

    if template is not None:  # a template that does not render fails here, not at every request
        try:
            chat_prompt_ids(tokenizer, [{"role": "user", "content": "hello"}], template)
        except ValueError as exc:
            raise CliError(f"--chat-template {args.chat_template}: {exc}") from None

    worker = Worker(
        engine,
        tokenizer,
        worker_id=args.worker_id,
        default_max_new_tokens=args.default_max_new_tokens,
        chat_template=template,
    )
    if args.warm:
        engine.cost_curve  # measure (or load) the verify cost curve before taking traffic  # noqa: B018
    return worker


def cmd_serve_worker(args: argparse.Namespace) -> int:
    security = server_security(args)
    _check_exposure(args.host, security)  # before the model loads
    worker = _worker(args)
    from llm_worker.registry import open_registry
    from llm_worker.server import ServerConfig, serve_worker

    cfg = ServerConfig(
        host=args.host,
        port=args.port,
        max_concurrent=args.max_concurrent,
        grace_seconds=args.grace_seconds,
        metrics_port=args.metrics_port,
        advertise=args.advertise,
        security=security,
        max_prompt_bytes=args.max_prompt_bytes,
        max_generation_seconds=args.max_generation_seconds,
        health_port=args.health_port,
        log_interval_seconds=args.log_interval,
    )
    # The start-up summary, the throughput lines and the drain are the worker's own log: shown
    # without -v, as the "listening on" line is.
    logging.getLogger("llm_worker.server").setLevel(logging.INFO)
    try:
        registry = open_registry(args.registry, ttl=args.registry_ttl) if args.registry else None
    except ValueError as exc:
        raise CliError(str(exc)) from exc

    def ready(port: int) -> None:
        sys.stderr.write(f"specdraft worker {worker.worker_id} listening on {args.host}:{port}\n")
        sys.stderr.flush()

    serve_worker(worker, cfg, ready, registry)
    return 0


def cmd_serve_http(args: argparse.Namespace) -> int:
    from client.http_api.app import create_app
    from client.http_api.backends import Backend, InProcessBackend, Limits, WorkerPool
    from client.http_api.server import HttpConfig, serve_http
    from llm_worker.metrics import WorkerMetrics

    security = server_security(args)
    _check_exposure(args.host, security, "HTTP")  # before the model loads
    if args.health_port is not None:
        raise CliError("serve http answers /health on its own port: --health-port is for the gRPC servers")
    metrics = WorkerMetrics()
    backend: Backend
    if args.workers or args.registry:
        from llm_worker.registry import open_registry

        try:
            registry = open_registry(args.registry) if args.registry else None
            backend = WorkerPool(
                args.workers,
                registry,
                client_security(args, prefix="worker-"),
                timeout=args.max_generation_seconds,
                name=args.served_model_name,
            )
        except ValueError as exc:
            raise CliError(str(exc)) from exc
        what = f"{len(args.workers)} workers" if args.workers else "the registry's workers"
    else:
        from llm_worker.server import watch_engine

        worker = _worker(args)
        watch_engine(worker, metrics)
        limits = Limits(args.max_concurrent, args.max_prompt_bytes, args.max_generation_seconds)
        backend = InProcessBackend(worker, limits, args.served_model_name)
        what = f"worker {worker.worker_id} in process"
    app = create_app(backend, security, metrics)
    cfg = HttpConfig(args.host, args.port, security, args.grace_seconds)

    def ready(port: int) -> None:
        scheme = "https" if security.tls else "http"
        sys.stderr.write(f"specdraft http ({what}) listening on {scheme}://{args.host}:{port}/v1\n")
        sys.stderr.flush()

    serve_http(app, cfg, ready)
    return 0


def cmd_serve_datastore(args: argparse.Namespace) -> int:
    from datastore_svc.server import ShardServer, ShardServerConfig, serve_shard
    from datastore_svc.shard import ShardState
    from datastore_svc.store import DatastoreError

    security = server_security(args)
    _check_exposure(args.host, security)
    try:
        state = ShardState.open(
            args.datastore,
            args.shard,
            drain_seconds=args.drain_seconds,
            faiss_gpu=args.faiss_gpu,
            versions_root=args.versions_root,
        )
    except DatastoreError as exc:
        raise CliError(str(exc)) from exc
    cfg = ShardServerConfig(
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        health_port=args.health_port,
        security=security,
        retrieve_threads=args.retrieve_threads,
        max_pending=args.max_pending,
        metrics_port=args.metrics_port,
        grace_seconds=args.grace_seconds,
        redis_url=args.redis,
    )

    def ready(server: ShardServer) -> None:
        name = state.current.version
        sys.stderr.write(
            f"specdraft datastore shard {args.shard} ({name}) listening on {args.host}:{server.port} "
            f"(admin {server.admin_port}, {security.describe()})\n"
        )
        sys.stderr.flush()

    serve_shard(state, cfg, ready)
    return 0


def _check_exposure(host: str, security: Any, listener: str = "gRPC") -> None:
    from specdraft.security import SecurityError, check_exposure

    try:
        check_exposure(host, security, listener)
    except SecurityError as exc:
        raise CliError(str(exc)) from exc
