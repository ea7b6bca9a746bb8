"""Real servers on ephemeral loopback ports (a worker, a datastore shard, redis-server) and
polling until something holds, instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import redis

from datastore_svc.dense import DenseConfig
from datastore_svc.retrieval import RetrievalConfig
from datastore_svc.server import ShardServer, ShardServerConfig
from datastore_svc.shard import ShardState
from helpers.models import CPU_LIKE_CURVE
from llm_worker.config import EngineConfig, ModelConfig
from llm_worker.engine import Engine
from llm_worker.model import load_target
from llm_worker.server import ServerConfig, WorkerServer
from llm_worker.worker import Worker
from specdraft.redisconn import ROLES, acl_file
from specdraft.security import ClientSecurity, ServerSecurity
from specdraft.stubs import datastore_pb2

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy, and return
    that; fail the test after ``timeout`` seconds (generous: a 2-core machine under load is slow).

    Example: ``wait_until(lambda: registry.workers() == [], 10, what="the record expires")``.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s: {what or predicate}")
        time.sleep(interval)


def free_port() -> int:
    """A port nothing listens on now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    """The Prometheus text a metrics endpoint on ``port`` serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


# -- a worker -------------------------------------------------------------------------------------


def tiny_worker(model_dir: Path, worker_id: str) -> Worker:
    """A worker of the model saved in ``model_dir`` (CPU-like cost curve, nothing measured)."""
    target, tokenizer = load_target(ModelConfig(path=str(model_dir)))
    return Worker(Engine(target, EngineConfig(), curve=CPU_LIKE_CURVE), tokenizer, worker_id=worker_id)


class ServerThread:
    """A WorkerServer on its own event loop in a background thread."""

    def __init__(self, worker: Worker, cfg: ServerConfig, registry: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> WorkerServer:
            server = WorkerServer(worker, cfg, registry=registry)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self, grace: float = 0.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def kill(self) -> None:
        """Die without a word: no deregistration, no drain (as a killed process would)."""

        async def die() -> None:
            if self.server._heartbeat is not None:
                self.server._heartbeat.cancel()
            await self.server.server.stop(0)

        asyncio.run_coroutine_threadsafe(die(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- a datastore shard ------------------------------------------------------------------------------


ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
"""The admin token of every ``ShardThread`` (unless its config says otherwise)."""
ADMIN = ClientSecurity(token=ADMIN_TOKEN)
"""A client with the admin identity of ``ShardThread``s."""


class ShardThread:
    """A ShardServer on its own event loop in a background thread: data and admin services on
    free loopback ports; the admin identity is ``ADMIN_TOKEN`` unless ``cfg`` says otherwise."""

    def __init__(self, state: ShardState, cfg: ShardServerConfig | None = None) -> None:
        self.state = state
        self.cfg = cfg or ShardServerConfig(
            port=0, admin_port=0, security=ServerSecurity(admin_tokens=(ADMIN_TOKEN,))
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> ShardServer:
            server = ShardServer(state, self.cfg)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)
        self.address = f"{self.cfg.host}:{self.server.port}"
        self.admin_address = f"{self.cfg.host}:{self.server.admin_port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def retrieve_request(**fields: Any) -> datastore_pb2.RetrieveRequest:
    """A ``RetrieveRequest`` from flat fields: those of ``SparseQuery`` (``context``, ``min_match``,
    ...) go into its sparse query, those of ``DenseQuery`` (``embedding``, ``next_token``,
    ``top_k``) into its dense one, the rest (``version``, ``max_length``, ...) stay on the request.
    ``retrieve_request(context=[])`` is a sparse query with no context."""
    sparse_fields = datastore_pb2.SparseQuery.DESCRIPTOR.fields_by_name
    dense_fields = datastore_pb2.DenseQuery.DESCRIPTOR.fields_by_name
    sparse = {k: v for k, v in fields.items() if k in sparse_fields}
    dense = {k: v for k, v in fields.items() if k in dense_fields}
    rest = {k: v for k, v in fields.items() if k not in sparse and k not in dense}
    if sparse:
        rest["sparse"] = datastore_pb2.SparseQuery(**sparse)
    if dense:
        rest["dense"] = datastore_pb2.DenseQuery(**dense)
    return datastore_pb2.RetrieveRequest(**rest)


class SlowShard(ShardState):
    """Answers sparse and dense retrievals, but only after ``delay`` seconds — past any sensible
    deadline. (The sleep is the point: it stands for an overloaded shard.)"""

    delay = 0.5

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> Any:
        time.sleep(self.delay)
        return super().retrieve(context, cfg, version)

    def retrieve_dense(self, query: np.ndarray, next_token: int, cfg: DenseConfig, version: str = "") -> Any:
        time.sleep(self.delay)
        return super().retrieve_dense(query, next_token, cfg, version)


# -- redis ----------------------------------------------------------------------------------------


class RedisServer:
    """A throwaway redis-server on a free port, without persistence; ready when constructed.

    ``acl``: locked down as in production (``specdraft.redisconn``): protected mode, the default
    user off, one user per role and one per worker id of ``workers`` (its own registry record
    alone); ``url_for(user)`` and ``password(user)`` reach it as that user.
    ``tls``: ``(ca, cert, key)`` PEM files: TLS only (``rediss://``), no plaintext port.
    """

    def __init__(
        self,
        acl: bool = False,
        tls: tuple[str, str, str] | None = None,
        workdir: Path | None = None,
        workers: tuple[str, ...] = (),
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (make test installs it)")
        self.port = free_port()
        argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        self.passwords: dict[str, str] = {}
        if acl:
            assert workdir is not None, "an ACL server needs a directory for its ACL file"
            self.passwords = {user: f"{user}-password-{self.port}" for user in (*ROLES, *workers)}
            acl_path = workdir / f"redis-{self.port}.acl"
            acl_path.write_text(acl_file(self.passwords))
            argv += ["--aclfile", str(acl_path)]
        scheme, query = "redis", ""
        if tls is not None:
            ca, cert, key = tls
            argv += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
            ]
            argv += ["--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
            scheme, query = "rediss", f"?ssl_ca_certs={ca}"
        else:
            argv += ["--port", str(self.port)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._base = f"{scheme}://{{user}}127.0.0.1:{self.port}/0{query}"
        self.url = self.url_for("worker") if acl else self._base.format(user="")
        client = redis.Redis.from_url(self.url, password=self.passwords.get("worker"))
        wait_until(lambda: self._answers(client), 10, what=f"redis-server answers on port {self.port}")

    def url_for(self, user: str) -> str:
        """The URL of ``user`` (its password goes in ``$SPECDRAFT_REDIS_PASSWORD`` or ``password``)."""
        return self._base.format(user=f"{user}@")

    def password(self, user: str) -> str:
        return self.passwords[user]

    @staticmethod
    def _answers(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        """Terminate and reap it (nothing happens if it already exited)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)
