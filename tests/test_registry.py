"""The worker registry against a real redis-server on a free port, and Prometheus metrics."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from client.grpc_client import GenerationClient, RequestOptions, build_request
from helpers.servers import RedisServer, ServerThread, free_port, scrape, tiny_worker, wait_until
from llm_worker.registry import InProcessRegistry, RedisRegistry, WorkerRecord, discover, open_registry
from llm_worker.server import ServerConfig
from llm_worker.worker import Worker

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Worker:
    return tiny_worker(tiny_dir, "reg-w")


def record(worker_id: str, modes: tuple[str, ...], load: int = 0) -> WorkerRecord:
    return WorkerRecord(worker_id, f"127.0.0.1:{1000 + len(worker_id)}", "m", "f", modes, load, 4)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_publish_discover_by_mode_and_expire(kind: str, request: pytest.FixtureRequest) -> None:
    # A TTL long enough for the checks before expiry even on a loaded machine.
    if kind == "redis":
        registry = RedisRegistry(request.getfixturevalue("redis_server").url, namespace="t", ttl=2.0)
    else:
        registry = InProcessRegistry(ttl=2.0)
    registry.publish(record("a", ("ar", "pld"), load=3))
    registry.publish(record("b", ("ar", "pld", "pld+h"), load=1))
    assert [r.worker_id for r in registry.workers("pld")] == ["b", "a"]  # least loaded first
    assert [r.worker_id for r in registry.workers("pld+h:layer=3")] == ["b"]  # options do not matter
    assert registry.workers("rest") == []
    registry.remove("a")
    assert [r.worker_id for r in registry.workers()] == ["b"]
    wait_until(lambda: registry.workers() == [], 10, what="the record expires without heartbeats")


def test_poisoned_records_are_skipped_counted_and_logged_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Records planted by someone who may write to Redis: a negative load (it sorted first for
    every client), a load that is not a number (discovery raised TypeError), an address that is
    not host:port, a record under another worker's key, and one that is not JSON. Discovery
    returns the honest worker alone, counts the five, and logs one line for them."""
    import json

    registry = RedisRegistry(redis_server.url, namespace="poison", ttl=30.0)
    registry.publish(record("honest", ("pld",), load=2))
    fields = json.loads(record("x", ("pld",)).to_json())
    planted = {
        "negative": {**fields, "worker_id": "negative", "load": -5},
        "text-load": {**fields, "worker_id": "text-load", "load": "x"},
        "bad-address": {**fields, "worker_id": "bad-address", "address": "evil.example:0"},
        "other-key": {**fields, "worker_id": "honest"},
    }
    for worker_id, data in planted.items():
        registry.client.set(registry._key(worker_id), json.dumps(data), px=30_000)
    registry.client.set(registry._key("not-json"), b"\xff{", px=30_000)
    with caplog.at_level(logging.WARNING, logger="llm_worker.registry"):
        assert discover(registry, "pld") == [record("honest", ("pld",)).address]
        assert registry.skipped == 5
        assert [r.worker_id for r in registry.workers()] == ["honest"]  # the second scan
    assert registry.skipped == 10
    assert caplog.text.count("skipping a malformed worker record") == 1, caplog.text


def test_a_workers_redis_user_writes_its_own_record_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One Redis user per worker (``specdraft.redisconn.worker_rules``): with worker a's password
    one can publish, refresh and remove a's record and use the dense caches, but neither
    overwrite nor delete b's record, nor plant a record under any other id; the shared role
    ``worker`` writes no record at all. What discovery sees is what each worker wrote."""
    import redis

    from specdraft.redisconn import PASSWORD_ENV, acl_file

    def as_user(user: str) -> RedisRegistry:
        monkeypatch.setenv(PASSWORD_ENV, server.password(user))
        return RedisRegistry(server.url_for(user), ttl=30.0)

    server = RedisServer(acl=True, workdir=tmp_path, workers=("worker-a", "worker-b"))
    try:
        as_user("worker-b").publish(record("worker-b", ("pld",), load=3))
        a = as_user("worker-a")
        a.publish(record("worker-a", ("pld",), load=1))
        a.publish(record("worker-a", ("pld",), load=2))  # a heartbeat
        hijack = WorkerRecord("worker-b", "203.0.113.9:50051", "m", "f", ("pld",), 0, 4)
        attempts = {
            "overwrite b": lambda: a.publish(hijack),
            "delete b": lambda: a.remove("worker-b"),
            "plant c": lambda: a.publish(record("worker-c", ("pld",))),
            "plant a key": lambda: a.client.set("specdraft:workers:worker-a:x", "{}"),
            "scan": lambda: a.workers(),
        }
        for what, attempt in attempts.items():
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
                pytest.fail(f"worker a's credential could {what}")
        assert a.client.set("specdraft:datastore:v1:dense-stats", b"x")  # the worker role's rights
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_user("worker").publish(record("worker-a", ("pld",)))
        discovery = as_user("client")
        assert {r.worker_id: r.load for r in discovery.workers()} == {"worker-a": 2, "worker-b": 3}
        a.remove("worker-a")
        assert [r.address for r in discovery.workers()] == [record("worker-b", ()).address]
    finally:
        server.stop()
    for pattern in ("*", "worker-?", "w[0-9]", "a b"):  # a glob would open other workers' keys
        with pytest.raises(ValueError, match="worker id"):
            acl_file({pattern: "password"})


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
        time.sleep(2.5 * registry.ttl)  # the test itself: past the TTL, heartbeats keep it alive
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
    wait_until(lambda: registry.workers() == [], 10, what="the killed worker's record expires")


def test_redis_down_the_worker_keeps_serving(
    worker: Worker, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    registry = RedisRegistry(redis_server.url, ttl=0.6)
    srv = ServerThread(worker, ServerConfig(port=0), registry=registry)
    try:
        with caplog.at_level(logging.WARNING, logger="llm_worker.server"):
            redis_server.stop()
            wait_until(lambda: "registry unavailable" in caplog.text, 10, what="a heartbeat fails")
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
    "specdraft_num_requests_running 0.0",
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
        assert port is not None

        def counted() -> str:  # a call's bookkeeping finishes just after its last message reaches the client
            body = scrape(port)
            return body if all(line in body for line in EXPECTED_METRICS) else ""

        body = wait_until(counted, 10, what=f"/metrics shows {EXPECTED_METRICS}")
    finally:
        srv.stop()
    assert 'specdraft_generation_tokens_total{mode="pld"}' in body
    assert "specdraft_tau_bucket" in body and "specdraft_time_to_first_token_seconds_bucket" in body


def test_a_tls_worker_registers_in_a_tls_redis_with_acl_users(
    worker: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path with everything on: Redis over TLS only (rediss://, with a CA of the tests' own
    helper) with ACL users, the worker as its own user ``reg-w`` (password from the environment,
    never in the URL or the log), discovery as user ``client`` (read only: it cannot plant a
    record), clients over TLS with a token."""
    import redis

    from helpers.tls import make_certificates
    from specdraft.redisconn import PASSWORD_ENV
    from specdraft.security import ClientSecurity, ServerSecurity

    certs = make_certificates(tmp_path / "tls")
    tls = (certs.ca, certs.server.cert, certs.server.key)
    server = RedisServer(acl=True, tls=tls, workdir=tmp_path, workers=("reg-w",))
    token = "registry-test-token-0123456789"
    srv = None
    try:
        monkeypatch.setenv(PASSWORD_ENV, server.password("reg-w"))
        published = RedisRegistry(server.url_for("reg-w"), ttl=5.0)
        assert "password" not in published.url
        security = ServerSecurity(cert=certs.server.cert, key=certs.server.key, tokens=(token,))
        srv = ServerThread(worker, ServerConfig(port=0, security=security), registry=published)
        monkeypatch.setenv(PASSWORD_ENV, server.password("client"))
        discovery = RedisRegistry(server.url_for("client"))
        addresses = discover(discovery, "pld")
        assert addresses == [srv.address]
        with pytest.raises(redis.exceptions.NoPermissionError):  # no poisoning the registry
            discovery.publish(record("evil", ("pld",), load=0))
        with GenerationClient(addresses, security=ClientSecurity(ca=certs.ca, token=token)) as client:
            reply = client.generate(
                build_request(text="hi", options=RequestOptions(mode="pld", max_new_tokens=3))
            )
        assert reply.token_ids
        monkeypatch.setenv(PASSWORD_ENV, "wrong")
        with pytest.raises(redis.AuthenticationError):
            RedisRegistry(server.url_for("client")).workers()
        plain = server.url_for("client").replace("rediss://", "redis://").split("?")[0]
        with pytest.raises(redis.ConnectionError):  # no plaintext port at all
            RedisRegistry(plain).workers()
    finally:
        if srv is not None:
            srv.stop()
        server.stop()


def test_redis_urls_are_logged_without_their_passwords() -> None:
    """Neither the user part's password nor a ``?password=`` (redis-py reads both) reaches a log."""
    from specdraft.redisconn import redacted

    assert redacted("redis://worker:s3cret@cache:6379/0") == "redis://worker:***@cache:6379/0"
    assert "s3cret" not in redacted("redis://worker@cache/0?password=s3cret")
    assert "s3cret" not in redacted("rediss://w@cache/0?ssl_cert_reqs=none&Password=s3cret")
    assert redacted("redis://w:p@[::1]:6379/0") == "redis://w:***@[::1]:6379/0"
    assert redacted("redis://cache:6379/0") == "redis://cache:6379/0"
