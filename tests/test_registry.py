"""The worker registry against a real redis-server on a free port, and Prometheus metrics."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import CPU_LIKE_CURVE
from test_server import ServerThread

from client.grpc_client import GenerationClient, RequestOptions, build_request
from llm_worker.config import EngineConfig, ModelConfig
from llm_worker.engine import Engine
from llm_worker.model import load_target
from llm_worker.registry import InProcessRegistry, RedisRegistry, WorkerRecord, discover, open_registry
from llm_worker.server import ServerConfig
from llm_worker.worker import Worker

pytestmark = pytest.mark.redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (make test installs it)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url)
        deadline = time.time() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Worker:
    target, tokenizer = load_target(ModelConfig(path=str(tiny_dir)))
    return Worker(Engine(target, EngineConfig(), curve=CPU_LIKE_CURVE), tokenizer, worker_id="reg-w")


def record(worker_id: str, modes: tuple[str, ...], load: int = 0) -> WorkerRecord:
    return WorkerRecord(worker_id, f"127.0.0.1:{1000 + len(worker_id)}", "m", "f", modes, load, 4)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_publish_discover_by_mode_and_expire(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "redis":
        registry = RedisRegistry(request.getfixturevalue("redis_server").url, namespace="t", ttl=0.5)
    else:
        registry = InProcessRegistry(ttl=0.5)
    registry.publish(record("a", ("ar", "pld"), load=3))
    registry.publish(record("b", ("ar", "pld", "pld+h"), load=1))
    assert [r.worker_id for r in registry.workers("pld")] == ["b", "a"]  # least loaded first
    assert [r.worker_id for r in registry.workers("pld+h:layer=3")] == ["b"]  # options do not matter
    assert registry.workers("rest") == []
    registry.remove("a")
    assert [r.worker_id for r in registry.workers()] == ["b"]
    time.sleep(0.7)  # no heartbeat: the record expires
    assert registry.workers() == []


def test_open_registry_urls() -> None:
    assert isinstance(open_registry(None), InProcessRegistry)
    with pytest.raises(ValueError, match="redis://"):
        open_registry("http://nope")


def test_worker_registers_heartbeats_and_deregisters(worker: Worker, redis_server: RedisServer) -> None:
    registry = RedisRegistry(redis_server.url, ttl=0.6)
    srv = ServerThread(worker, ServerConfig(port=0), registry=registry)
    try:
        [rec] = registry.workers("pld")
        assert rec.worker_id == "reg-w" and rec.address == srv.address
        assert {"ar", "pld", "pld+h"} <= set(rec.modes) and "pld+a" not in rec.modes
        time.sleep(1.5)  # longer than the TTL: heartbeats keep it alive
        assert discover(registry, "pld+h") == [srv.address]
        with GenerationClient(discover(registry, "pld")) as client:
            assert client.generate(
                build_request(text="hi", options=RequestOptions(mode="pld", max_new_tokens=3))
            )
    finally:
        srv.stop()
    assert registry.workers() == []  # deregistered on shutdown


def test_a_killed_worker_expires(worker: Worker, redis_server: RedisServer) -> None:
    registry = RedisRegistry(redis_server.url, ttl=0.6)
    srv = ServerThread(worker, ServerConfig(port=0), registry=registry)
    assert len(registry.workers()) == 1
    srv.kill()  # no deregistration, no more heartbeats
    time.sleep(1.0)
    assert registry.workers() == []


def test_redis_down_the_worker_keeps_serving(worker: Worker, redis_server: RedisServer) -> None:
    registry = RedisRegistry(redis_server.url, ttl=0.6)
    srv = ServerThread(worker, ServerConfig(port=0), registry=registry)
    try:
        redis_server.stop()
        time.sleep(0.5)  # heartbeats now fail
        with GenerationClient([srv.address]) as client:
            resp = client.generate(build_request(text="still here", options=RequestOptions(max_new_tokens=4)))
        assert len(resp.token_ids) >= 1
    finally:
        srv.stop()  # deregistration fails quietly too


def test_worker_without_redis_at_start_still_serves(worker: Worker) -> None:
    registry = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0", ttl=0.6)  # nothing listens
    srv = ServerThread(worker, ServerConfig(port=0), registry=registry)
    try:
        with GenerationClient([srv.address]) as client:
            assert client.generate(
                build_request(text="hi", options=RequestOptions(max_new_tokens=2))
            ).token_ids
    finally:
        srv.stop()


EXPECTED_METRICS = (
    'specdraft_requests_total{method="Generate",mode="pld",status="OK"} 1.0',
    'specdraft_requests_total{method="GenerateStream",mode="ar",status="OK"} 1.0',
    'specdraft_requests_total{method="Generate",mode="unknown",status="INVALID_ARGUMENT"} 1.0',
    "specdraft_requests_in_flight 0.0",
)


def test_metrics_endpoint_counts_requests_by_mode_and_status(worker: Worker) -> None:
    srv = ServerThread(worker, ServerConfig(port=0, metrics_port=0))
    try:
        with GenerationClient([srv.address]) as client:
            client.generate(build_request(text="hi", options=RequestOptions(mode="pld", max_new_tokens=5)))
            list(client.generate_stream(build_request(text="hi", options=RequestOptions(max_new_tokens=5))))
            with pytest.raises(Exception):  # noqa: B017 - the status is what is checked below
                client.generate(build_request(text="hi", options=RequestOptions(mode="nope")))
        port = srv.server.metrics_port
        deadline = time.time() + 10
        while True:  # a call's bookkeeping finishes just after its last message reaches the client
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            if all(line in body for line in EXPECTED_METRICS) or time.time() > deadline:
                break
            time.sleep(0.05)
    finally:
        srv.stop()
    for line in EXPECTED_METRICS:
        assert line in body
    assert 'specdraft_generated_tokens_total{mode="pld"}' in body
    assert "specdraft_tau_bucket" in body and "specdraft_time_to_first_token_seconds_bucket" in body
