"""Safe to expose (issue 12), against real shard and worker servers on loopback: who may call
what, TLS and mutual TLS with certificates made at test time, version names contained in the
versions root, swaps across shards that never split, bounded work, and statuses that say
nothing about the server's insides."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.cli import main
from client.grpc_client import GenerationClient, RequestOptions, build_request
from datastore_svc.fanout import RemoteDatastore, SwapError, load_all, swap_all, swap_loaded
from datastore_svc.retrieval import RetrievalConfig
from datastore_svc.server import ShardServer, ShardServerConfig
from datastore_svc.shard import ShardState
from datastore_svc.store import DatastoreVersion, write_version
from helpers.datastores import tiny_identity
from helpers.models import CPU_LIKE_CURVE
from helpers.servers import (
    ADMIN,
    ADMIN_TOKEN,
    ServerThread,
    ShardThread,
    SlowShard,
    retrieve_request,
    tiny_worker,
    wait_until,
)
from helpers.tls import Certificates, make_certificates
from llm_worker.server import ServerConfig
from llm_worker.worker import Worker
from specdraft.security import ClientSecurity, SecurityError, ServerSecurity, read_tokens
from specdraft.stubs import datastore_pb2, datastore_pb2_grpc, generation_pb2

VOCAB = 96
IDENTITY = tiny_identity(VOCAB)
CLIENT_TOKEN = "test-client-token-0123456789abcdef"
CFG = RetrievalConfig(c_max=8, max_length=6, max_nodes=40, max_candidates=40)


def docs(seed: int, count: int = 30, length: int = 50, symbols: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, symbols, size=length).astype(np.int32) for _ in range(count)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A versions root: v1, v2, v3 of two shards, one big single-shard version, and beside the
    root (outside it) a valid version a symlink inside points to."""
    base = tmp_path_factory.mktemp("security")
    root = base / "versions"
    for i, name in enumerate(("v1", "v2", "v3")):
        write_version(docs(i + 1), root / name, VOCAB, IDENTITY, shards=2)
    write_version(docs(9, count=200, length=2000, symbols=3), root / "big", VOCAB, IDENTITY, shards=1)
    write_version(docs(7), base / "outside", VOCAB, IDENTITY, shards=2)
    (root / "escape").symlink_to(base / "outside")
    return root


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture()
def shards(root: Path) -> Iterator[list[ShardThread]]:
    servers = [ShardThread(ShardState.open(root / "v1", i, drain_seconds=30)) for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value


def load(address: str, version: str, security: ClientSecurity | None = None) -> Any:
    with (security or ClientSecurity()).channel(address) as channel:
        stub = datastore_pb2_grpc.DatastoreAdminStub(channel)
        return stub.LoadVersion(datastore_pb2.LoadVersionRequest(version=version), timeout=10)


# -- who may call what ------------------------------------------------------------------------------


def test_admin_calls_need_the_admin_identity(root: Path) -> None:
    security = ServerSecurity(tokens=(CLIENT_TOKEN,), admin_tokens=(ADMIN_TOKEN,))
    shard = ShardThread(
        ShardState.open(root / "v1", 0), ShardServerConfig(port=0, admin_port=0, security=security)
    )
    bare = ShardThread(ShardState.open(root / "v1", 0), ShardServerConfig(port=0, admin_port=0))
    try:
        nobody = rpc_error(load, shard.admin_address, "v2")
        assert nobody.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = rpc_error(load, shard.admin_address, "v2", ClientSecurity(token="x" * 32))
        assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
        client = rpc_error(load, shard.admin_address, "v2", ClientSecurity(token=CLIENT_TOKEN))
        assert client.code() == grpc.StatusCode.PERMISSION_DENIED
        unconfigured = rpc_error(load, bare.admin_address, "v2", ADMIN)
        assert unconfigured.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "no admin identity" in (unconfigured.details() or "")
        assert shard.state.loaded_versions() == ["v1"]  # nothing was loaded
        assert load(shard.admin_address, "v2", ClientSecurity(token=ADMIN_TOKEN)).version == "v2"
        # the data port has no admin calls; its Retrieve needs the client token, health does not
        with grpc.insecure_channel(shard.address) as channel:
            admin_on_data_port = datastore_pb2_grpc.DatastoreAdminStub(channel).SwapVersion
            err = rpc_error(admin_on_data_port, datastore_pb2.SwapVersionRequest(version="v2"), timeout=5)
            assert err.code() == grpc.StatusCode.UNIMPLEMENTED
            retrieve = datastore_pb2_grpc.DatastoreStub(channel).Retrieve
            err = rpc_error(retrieve, retrieve_request(context=[1, 2]), timeout=5)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        remote = RemoteDatastore([shard.address], 5.0, ClientSecurity(token=CLIENT_TOKEN))
        assert remote.retrieve(np.array([1, 2, 3]), CFG).version == "v1"
        admin_retrieves = RemoteDatastore([shard.address], 5.0, ADMIN)  # the admin may also read
        assert admin_retrieves.retrieve(np.array([1, 2, 3]), CFG).version == "v1"
    finally:
        shard.stop()
        bare.stop()


@pytest.mark.parametrize(
    "name", ["../v2", "/etc", "/any/dir/evil", "v2/../v3", "..", ".", "", "escape", "a\\b", "v1\x00"]
)
def test_version_names_stay_in_the_versions_root(shards: list[ShardThread], root: Path, name: str) -> None:
    err = rpc_error(load, shards[0].admin_address, name, ADMIN)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    details = err.details() or ""
    assert str(root.parent) not in details and "manifest" not in details and "No such" not in details
    assert shards[0].state.loaded_versions() == ["v1"]


def test_a_missing_version_is_not_found_and_says_nothing_of_the_disk(
    shards: list[ShardThread], root: Path
) -> None:
    err = rpc_error(load, shards[0].admin_address, "nope", ADMIN)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert str(root) not in (err.details() or "")


def test_a_version_that_cannot_be_read_is_a_precise_status_and_the_shard_serves_on(
    shards: list[ShardThread], root: Path
) -> None:
    """A symlink loop under the versions root (``Path.resolve`` raises ``RuntimeError``) is a
    FAILED_PRECONDITION naming the version, not UNKNOWN; the shard keeps serving its version."""
    loop = root / "loop"
    loop.symlink_to(loop)
    try:
        err = rpc_error(load, shards[0].admin_address, "loop", ADMIN)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert "'loop' cannot be loaded" in (err.details() or "")
        assert shards[0].state.loaded_versions() == ["v1"]
        assert load(shards[0].admin_address, "v2", ADMIN).version == "v2"
    finally:
        loop.unlink()


def test_a_swap_with_a_shard_killed_between_load_and_swap_leaves_one_version(
    shards: list[ShardThread],
) -> None:
    admins = [s.admin_address for s in shards]
    expected = load_all(admins, "v2", ADMIN)
    assert expected == ["v1", "v1"]
    shards[1].stop()  # dies after loading, before swapping
    with pytest.raises(SwapError, match=r"UNAVAILABLE.*rolled back") as err:
        swap_loaded(admins, "v2", expected, ADMIN, timeout=5)
    assert shards[0].state.current_version() == "v1", err.value  # rolled back: v1 everywhere alive
    # the killed shard restarts from its --datastore (v1): every shard serves v1
    shards[1] = ShardThread(ShardState.open(shards[0].state.version().path, 1))
    remote = RemoteDatastore([s.address for s in shards], 5.0)
    assert [i.version for i in remote.info()] == ["v1", "v1"]


def test_a_shard_that_swapped_without_answering_is_returned_too(shards: list[ShardThread]) -> None:
    """The last shard swaps, but its answer comes after the call's deadline: the swap fails and
    that shard is returned to its version as well, not left alone on the new one."""
    import time

    admins = [s.admin_address for s in shards]
    expected = load_all(admins, "v2", ADMIN)
    state = shards[1].state
    swap = state.swap

    def swap_then_stall(name: str, expected_previous: str = "") -> tuple[str, str]:
        out = swap(name, expected_previous)
        if name == "v2":
            time.sleep(3.0)  # the answer is lost past the deadline
        return out

    state.swap = swap_then_stall  # type: ignore[method-assign]
    with pytest.raises(SwapError, match="had swapped without answering and was returned") as err:
        swap_loaded(admins, "v2", expected, ADMIN, timeout=2.0)
    assert "DEADLINE_EXCEEDED" in str(err.value)
    assert [s.state.current_version() for s in shards] == ["v1", "v1"], err.value


def test_swaps_compare_and_swap_and_never_split_the_shards(shards: list[ShardThread]) -> None:
    admins = [s.admin_address for s in shards]
    load_all(admins, "v2", ADMIN)
    with pytest.raises(SwapError, match="not the expected 'v3'"):
        swap_loaded(admins, "v2", ["v3", "v3"], ADMIN)
    assert [s.state.current_version() for s in shards] == ["v1", "v1"]
    for _ in range(4):  # two swaps at once, to different versions: one wins everywhere, or neither
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(swap_all, admins, v, ADMIN) for v in ("v2", "v3")]
            outcomes = [f.exception() for f in futures]
        assert all(o is None or isinstance(o, SwapError) for o in outcomes), outcomes
        current = {s.state.current_version() for s in shards}
        assert len(current) == 1, f"the shards split: {current} ({outcomes})"


def test_the_fan_out_reports_shards_on_another_version(
    shards: list[ShardThread], caplog: pytest.LogCaptureFixture
) -> None:
    load(shards[1].admin_address, "v2", ADMIN)
    with ADMIN.channel(shards[1].admin_address) as channel:
        datastore_pb2_grpc.DatastoreAdminStub(channel).SwapVersion(
            datastore_pb2.SwapVersionRequest(version="v2"), timeout=5
        )
    remote = RemoteDatastore([s.address for s in shards], 5.0)
    with caplog.at_level(logging.WARNING, logger="datastore_svc.fanout"):
        for _ in range(3):
            assert remote.retrieve(np.array([1, 2, 3]), CFG).version == "v1"  # shard 0's (a tie)
    assert remote.off_version[shards[1].address] == 3 and remote.off_version[shards[0].address] == 0
    assert sum("answers from version v2" in r.getMessage() for r in caplog.records) == 1  # logged once


# -- TLS and mutual TLS -------------------------------------------------------------------------------


def test_shards_over_mutual_tls_with_an_admin_certificate(root: Path, certs: Certificates) -> None:
    security = ServerSecurity(
        cert=certs.server.cert, key=certs.server.key, ca=certs.ca, admin_names=("admin.specdraft",)
    )
    shards = [
        ShardThread(
            ShardState.open(root / "v1", i), ShardServerConfig(port=0, admin_port=0, security=security)
        )
        for i in range(2)
    ]
    worker_cert, admin_cert = certs.clients["worker.specdraft"], certs.clients["admin.specdraft"]
    as_worker = ClientSecurity(ca=certs.ca, cert=worker_cert.cert, key=worker_cert.key)
    as_admin = ClientSecurity(ca=certs.ca, cert=admin_cert.cert, key=admin_cert.key)
    try:
        remote = RemoteDatastore([s.address for s in shards], 5.0, as_worker)
        answer = remote.retrieve(np.array([1, 2, 3]), CFG)
        assert answer.version == "v1" and answer.retrieval.candidates and not remote.failures
        for plain in (ClientSecurity(), ClientSecurity(ca=certs.ca)):  # plaintext; TLS without a cert
            other = RemoteDatastore([shards[0].address], 2.0, plain)
            assert other.retrieve(np.array([1, 2, 3]), CFG).retrieval.candidates == ()
            assert other.failures[shards[0].address] == 1
        probe = ShardThread(
            ShardState.open(root / "v1", 0),
            ShardServerConfig(port=0, admin_port=None, health_port=0, security=security),
        )
        try:  # a Kubernetes gRPC probe speaks plaintext: a port of health alone answers it
            with grpc.insecure_channel(f"127.0.0.1:{probe.server.health_port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                retrieve = datastore_pb2_grpc.DatastoreStub(channel).Retrieve
                assert rpc_error(retrieve, retrieve_request(context=[1]), timeout=5).code() == (
                    grpc.StatusCode.UNIMPLEMENTED
                )
        finally:
            probe.stop()
        refused = rpc_error(load, shards[0].admin_address, "v2", as_worker)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert swap_all([s.admin_address for s in shards], "v2", as_admin) == [("v1", "v2"), ("v1", "v2")]
        assert remote.retrieve(np.array([1, 2, 3]), CFG).version == "v2"
    finally:
        for s in shards:
            s.stop()


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Worker:
    return tiny_worker(tiny_dir, "w-security")


def test_a_worker_over_tls_with_a_token(worker: Worker, certs: Certificates) -> None:
    security = ServerSecurity(cert=certs.server.cert, key=certs.server.key, tokens=(CLIENT_TOKEN,))
    server = ServerThread(worker, ServerConfig(port=0, security=security))
    request = build_request(text="hello world hello", options=RequestOptions(max_new_tokens=8))
    try:
        good = ClientSecurity(ca=certs.ca, token=CLIENT_TOKEN)
        with GenerationClient([server.address], timeout=60, security=good) as client:
            unary = client.generate(request)
            chunks = list(client.generate_stream(request))
        assert unary.token_ids and chunks[-1].final.token_ids == unary.token_ids
        for bad, code in [
            (ClientSecurity(ca=certs.ca), grpc.StatusCode.UNAUTHENTICATED),
            (ClientSecurity(ca=certs.ca, token="y" * 32), grpc.StatusCode.UNAUTHENTICATED),
            (ClientSecurity(token=CLIENT_TOKEN), grpc.StatusCode.UNAVAILABLE),  # plaintext to a TLS port
        ]:
            with GenerationClient([server.address], timeout=10, security=bad) as client:
                assert rpc_error(client.generate, request).code() == code
        with ClientSecurity(ca=certs.ca).channel(server.address) as channel:  # health: open, no token
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_plaintext_on_a_public_address_needs_insecure(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    state = ShardState.open(root / "v1", 0)

    async def start(security: ServerSecurity) -> None:
        server = ShardServer(
            state, ShardServerConfig(host="0.0.0.0", port=0, admin_port=None, security=security)
        )
        try:
            await server.start()
        finally:
            await server.stop(0)

    with pytest.raises(SecurityError, match="--insecure"):
        asyncio.run(start(ServerSecurity()))
    with caplog.at_level(logging.WARNING, logger="specdraft.security"):
        asyncio.run(start(ServerSecurity(insecure=True)))
    assert any("plaintext on 0.0.0.0 without authentication" in r.getMessage() for r in caplog.records)
    # a token alone is no protection in plaintext: anyone on the path reads it (issue 34)
    with pytest.raises(SecurityError, match=r"bearer tokens in cleartext.*--insecure"):
        asyncio.run(start(ServerSecurity(tokens=(CLIENT_TOKEN,))))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdraft.security"):
        asyncio.run(start(ServerSecurity(tokens=(CLIENT_TOKEN,), insecure=True)))
    assert any("bearer tokens in cleartext (--insecure)" in r.getMessage() for r in caplog.records)


def test_the_cli_refuses_a_public_plaintext_shard(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["serve", "datastore", "--datastore", str(root / "v1"), "--host", "0.0.0.0", "--port", "0"]
    assert main(args) == 2
    assert "--insecure" in capsys.readouterr().err
    tokens = tmp_path / "tokens"
    tokens.write_text(CLIENT_TOKEN + "\n")
    assert main([*args, "--token-file", str(tokens)]) == 2  # a token-only server too
    assert "bearer tokens in cleartext" in capsys.readouterr().err


def test_every_listener_is_under_the_bind_check(root: Path, certs: Certificates) -> None:
    """Metrics and health-only ports pass the same check as the gRPC ports: refused in
    plaintext on a public address without --insecure; beside a TLS server the metrics endpoint
    speaks HTTPS only and the health-only port (plaintext by purpose) is allowed."""
    import ssl
    import urllib.error
    import urllib.request

    from grpc_health.v1.health import aio as health_aio
    from prometheus_client import CollectorRegistry

    from specdraft.security import health_only_server, serve_metrics

    token_only = ServerSecurity(tokens=(CLIENT_TOKEN,))
    with pytest.raises(SecurityError, match=r"metrics in plaintext on 0\.0\.0\.0"):
        serve_metrics(CollectorRegistry(), "0.0.0.0", 0, token_only)
    with pytest.raises(SecurityError, match=r"health in plaintext on 0\.0\.0\.0"):
        health_only_server("0.0.0.0", 0, health_aio.HealthServicer(), token_only)

    tls = ServerSecurity(cert=certs.server.cert, key=certs.server.key)
    shard = ShardThread(
        ShardState.open(root / "v1", 0),
        ShardServerConfig(
            host="0.0.0.0", port=0, admin_port=None, health_port=0, metrics_port=0, security=tls
        ),
    )
    try:
        url = f"127.0.0.1:{shard.server.metrics_port}/metrics"
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{url}", timeout=5).read()
        context = ssl.create_default_context(cafile=certs.ca)
        with urllib.request.urlopen(f"https://{url}", timeout=5, context=context) as reply:
            assert b"specdraft_datastore_tokens" in reply.read()
        with grpc.insecure_channel(f"127.0.0.1:{shard.server.health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        shard.stop()


def test_a_client_never_sends_a_token_in_plaintext_to_a_public_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import asyncio

    from specdraft.security import target_hosts

    assert target_hosts("10.0.0.5:50051") == ["10.0.0.5"]
    assert target_hosts("[::1]:50051") == ["::1"]
    assert target_hosts("dns:///w.example:443") == ["w.example"]
    assert target_hosts("ipv4:127.0.0.1:1,10.0.0.5:2") == ["127.0.0.1", "10.0.0.5"]
    assert target_hosts("unix:/run/s.sock") == ["localhost"]
    plain = ClientSecurity(token=CLIENT_TOKEN)
    for address in ("10.0.0.5:50051", "specdraft-worker:50051", "dns:///w.example:443", "[2001:db8::1]:1"):
        with pytest.raises(SecurityError, match=r"plaintext.*--insecure"):
            plain.channel(address)
        with pytest.raises(SecurityError, match=r"plaintext.*--insecure"):
            plain.aio_channel(address)
    plain.channel("127.0.0.1:1").close()  # loopback: allowed
    ClientSecurity(tls=True, token=CLIENT_TOKEN).channel("10.0.0.5:50051").close()  # TLS: allowed
    ClientSecurity().channel("10.0.0.5:50051").close()  # no token to leak
    insecure = ClientSecurity(token=CLIENT_TOKEN, insecure=True)

    async def open_aio() -> None:
        await insecure.aio_channel("10.0.0.5:1").close()

    with caplog.at_level(logging.WARNING, logger="specdraft.security"):
        insecure.channel("10.0.0.5:50051").close()
        asyncio.run(open_aio())
    assert sum("token in plaintext to 10.0.0.5" in r.getMessage() for r in caplog.records) == 2
    assert all(CLIENT_TOKEN not in r.getMessage() for r in caplog.records)


def test_auth_refusals_are_counted_and_logged_without_the_token(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    security = ServerSecurity(tokens=(CLIENT_TOKEN,), admin_tokens=(ADMIN_TOKEN,))
    shard = ShardThread(
        ShardState.open(root / "v1", 0), ShardServerConfig(port=0, admin_port=0, security=security)
    )
    wrong = "w" * 40
    try:
        with caplog.at_level(logging.WARNING, logger="specdraft.guard"):
            for _ in range(3):
                remote = ClientSecurity(token=wrong)
                with remote.channel(shard.address) as channel:
                    retrieve = datastore_pb2_grpc.DatastoreStub(channel).Retrieve
                    err = rpc_error(retrieve, retrieve_request(context=[1, 2]), timeout=5)
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            client = rpc_error(load, shard.admin_address, "v2", ClientSecurity(token=CLIENT_TOKEN))
            assert client.code() == grpc.StatusCode.PERMISSION_DENIED
        counter = shard.server.metrics.auth_refusals
        assert counter.labels("client", "UNAUTHENTICATED")._value.get() == 3
        assert counter.labels("admin", "PERMISSION_DENIED")._value.get() == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "specdraft.guard"]
        assert len(lines) == 1 and "refused Retrieve from" in lines[0], lines  # one line per 10 s
        assert all(wrong not in line and CLIENT_TOKEN not in line for line in lines)
    finally:
        shard.stop()


def test_refusal_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    from specdraft.common import ThrottledWarning

    now = [0.0]
    limited = ThrottledWarning(logging.getLogger("test.refusals"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for t in (0.0, 1.0, 2.0, 12.0):
            now[0] = t
            limited.warn("refused %s", "Retrieve")
    assert [r.getMessage() for r in caplog.records] == [
        "refused Retrieve",
        "refused Retrieve (2 more since the last)",
    ]


def test_token_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "tokens"
    file.write_text("# the workers\n" + "a" * 20 + "\n\n" + "b" * 24 + "\n")
    assert read_tokens(file) == ("a" * 20, "b" * 24)
    monkeypatch.setenv("X_TOKEN", "c" * 16)
    assert read_tokens(None, "X_TOKEN") == ("c" * 16,)
    file.write_text("short\n")
    with pytest.raises(SecurityError, match="16"):
        read_tokens(file)
    with pytest.raises(SecurityError, match="cannot read"):
        read_tokens(tmp_path / "missing")


# -- statuses ---------------------------------------------------------------------------------------


def raw_call(address: str, method: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method)
        return rpc_error(call, payload, timeout=10)


def bad_utf8(message: Any, field: str) -> bytes:
    number = message.DESCRIPTOR.fields_by_name[field].number
    return bytes([(number << 3) | 2, 3]) + b"\xff\xfe\xfd"


def test_invalid_utf8_is_invalid_argument(shards: list[ShardThread], worker: Worker) -> None:
    server = ServerThread(worker, ServerConfig(port=0))
    try:
        err = raw_call(
            server.address,
            "/specdraft.v1.Generation/Generate",
            bad_utf8(generation_pb2.GenerateRequest, "text"),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in (err.details() or "")
        err = raw_call(server.address, "/specdraft.v1.Generation/Generate", b"\xff\xff\xff")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop()
    err = raw_call(
        shards[0].address,
        "/specdraft.v1.Datastore/Retrieve",
        bad_utf8(datastore_pb2.RetrieveRequest, "version"),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(shards[0].address) as channel:  # and the shard keeps serving
        assert datastore_pb2_grpc.DatastoreStub(channel).Retrieve(retrieve_request(context=[1, 2]), timeout=5)


class BrokenShard(ShardState):
    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> Any:
        raise OSError(2, "No such file or directory", "/srv/secret/place")


def test_unexpected_errors_are_internal_with_an_opaque_id(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = ShardThread(BrokenShard(DatastoreVersion(root / "v1", shards=[0]), 0))
    try:
        with (
            caplog.at_level(logging.ERROR, logger="specdraft.guard"),
            grpc.insecure_channel(shard.address) as channel,
        ):
            stub = datastore_pb2_grpc.DatastoreStub(channel)
            err = rpc_error(stub.Retrieve, retrieve_request(context=[1, 2]), timeout=5)
        details = err.details() or ""
        assert err.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in details and "No such" not in details and "id " in details
        error_id = details.split("id ")[1].split()[0]
        assert any(error_id in r.getMessage() for r in caplog.records)  # the detail is in the log
    finally:
        shard.stop()


# -- bounded work ---------------------------------------------------------------------------------------


def test_an_abusive_n_times_l_is_refused(shards: list[ShardThread]) -> None:
    with grpc.insecure_channel(shards[0].address) as channel:
        stub = datastore_pb2_grpc.DatastoreStub(channel)
        t0 = time.perf_counter()
        err = rpc_error(
            stub.Retrieve,
            retrieve_request(context=[1, 2], max_occurrences=100_000, max_length=256),
            timeout=5,
        )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "N × L" in (err.details() or "")
    assert time.perf_counter() - t0 < 1.0


def test_admission_limit_and_expired_requests(root: Path) -> None:
    slow = SlowShard(DatastoreVersion(root / "v1", shards=[0]), 0)
    cfg = ShardServerConfig(port=0, admin_port=None, retrieve_threads=1, max_pending=2)
    shard = ShardThread(slow, cfg)
    try:
        with grpc.insecure_channel(shard.address) as channel:
            stub = datastore_pb2_grpc.DatastoreStub(channel)
            calls = [stub.Retrieve.future(retrieve_request(context=[1, 2]), timeout=0.2) for _ in range(4)]
            codes = []
            for call in calls:
                try:
                    call.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes  # beyond 2 pending: refused at once
        # the second one waited behind a 0.5 s retrieval past its 0.2 s deadline: dropped unrun
        wait_until(
            lambda: shard.server.metrics.expired._value.get() >= 1, 5, what="an expired request dropped"
        )
    finally:
        shard.stop()


def test_abandoned_expensive_requests_leave_health_fast(root: Path) -> None:
    shard = ShardThread(ShardState.open(root / "big", 0))
    heavy = retrieve_request(
        context=[1], max_occurrences=26_000, max_length=10, max_nodes=1024, max_candidates=1024
    )
    try:
        with grpc.insecure_channel(shard.address) as channel:
            stub = datastore_pb2_grpc.DatastoreStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            t0 = time.perf_counter()
            stub.Retrieve(heavy, timeout=30)
            cost = time.perf_counter() - t0
            for _ in range(3):
                stub.Retrieve.future(heavy, timeout=0.02)  # abandoned after 20 ms
            seconds = []
            for _ in range(60):
                t0 = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                seconds.append(time.perf_counter() - t0)
                time.sleep(0.005)
        p99 = float(np.percentile(seconds, 99))
        assert p99 < 0.1, f"health p99 {p99 * 1000:.0f} ms while abandoned retrievals ({cost:.2f} s each) ran"
    finally:
        shard.stop()


def rss_kb() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def test_a_request_never_names_a_file(worker: Worker) -> None:
    server = ServerThread(worker, ServerConfig(port=0))
    try:
        with GenerationClient([server.address], timeout=10) as client:
            for mode in ("pld+a:file=/dev/zero", "pld+a:file=/etc/passwd"):
                before, t0 = rss_kb(), time.perf_counter()
                err = rpc_error(client.generate, build_request(text="hi", options=RequestOptions(mode=mode)))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not ['file']" in (
                    err.details() or ""
                )
                assert time.perf_counter() - t0 < 0.1
                assert rss_kb() - before < 10 * 1024
            err = rpc_error(
                client.generate, build_request(text="hi", options=RequestOptions(mode="rest:n=100000:l=128"))
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop()


def test_a_huge_prompt_is_refused_before_tokenizing(worker: Worker) -> None:
    server = ServerThread(worker, ServerConfig(port=0, max_prompt_bytes=64 * 1024))
    try:
        with GenerationClient([server.address], timeout=10) as client:
            t0 = time.perf_counter()
            err = rpc_error(client.generate, build_request(text="word " * 600_000))  # 3 MB
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in (err.details() or "")
            assert time.perf_counter() - t0 < 1.0  # tokenizing it would take seconds
            chat = build_request(chat=[("user", "x" * 70_000)])
            assert rpc_error(client.generate, chat).code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop()


def test_a_generation_past_the_wall_time_cap_ends(worker: Worker) -> None:
    server = ServerThread(worker, ServerConfig(port=0, max_generation_seconds=0.0))
    try:
        with GenerationClient([server.address], timeout=60) as client:
            request = build_request(text="hello", options=RequestOptions(max_new_tokens=64, ignore_eos=True))
            err = rpc_error(client.generate, request)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "limit" in (err.details() or "")
    finally:
        server.stop()


def test_a_worker_and_shards_over_mutual_tls_equal_ar(
    worker: Worker, certs: Certificates, root: Path, tmp_path: Path
) -> None:
    """The whole path encrypted: client → worker (TLS + token) → shards (mutual TLS)."""
    from helpers.datastores import datastore_for
    from llm_worker.drafters import DraftResources
    from llm_worker.engine import Engine

    target = worker.engine.target
    datastore_for(target, tmp_path / "v", shards=2)
    security = ServerSecurity(cert=certs.server.cert, key=certs.server.key, ca=certs.ca)
    shards = [
        ShardThread(
            ShardState.open(tmp_path / "v", i), ShardServerConfig(port=0, admin_port=None, security=security)
        )
        for i in range(2)
    ]
    cert = certs.clients["worker.specdraft"]
    remote = RemoteDatastore(
        [s.address for s in shards], 5.0, ClientSecurity(ca=certs.ca, cert=cert.cert, key=cert.key)
    )
    engine = Engine(target, worker.engine.config, curve=CPU_LIKE_CURVE, resources=DraftResources(remote))
    tls_worker = Worker(engine, worker.tokenizer, "w-tls")
    server_security = ServerSecurity(cert=certs.server.cert, key=certs.server.key, tokens=(CLIENT_TOKEN,))
    server = ServerThread(tls_worker, ServerConfig(port=0, security=server_security))
    try:
        with GenerationClient(
            [server.address], 60, ClientSecurity(ca=certs.ca, token=CLIENT_TOKEN)
        ) as client:
            text = "the cat sat on the mat, the cat sat on the mat, the cat"
            ar = client.generate(build_request(text=text, options=RequestOptions(max_new_tokens=24)))
            rest = client.generate(
                build_request(text=text, options=RequestOptions(mode="rest", max_new_tokens=24))
            )
        assert list(rest.token_ids) == list(ar.token_ids)
        assert not remote.failures
    finally:
        server.stop()
        for s in shards:
            s.stop()


@pytest.mark.parametrize(
    "name,edit,field",
    [
        ("m-dir", None, "not a readable file"),
        ("m-tokenizer", {"tokenizer": "x"}, "'tokenizer'"),
        ("m-separator", {"separator": "abc"}, "'separator'"),
        ("m-shards", {"shards": [{"index": "0"}]}, "'shards[0]'"),
        ("m-version", {"version": 7}, "'version'"),
    ],
)
def test_a_malformed_manifest_is_failed_precondition_naming_the_field(
    shards: list[ShardThread], root: Path, name: str, edit: dict[str, Any] | None, field: str
) -> None:
    import json
    import shutil

    target = root / name
    if not target.exists():
        shutil.copytree(root / "v1", target)
        manifest = target / "manifest.json"
        if edit is None:
            manifest.unlink()
            manifest.mkdir()
        else:
            manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **edit}))
    err = rpc_error(load, shards[0].admin_address, name, ADMIN)
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and field in details, details
    assert str(root) not in details
    assert shards[0].state.current_version() == "v1"


def test_a_request_streaming_method_of_a_guarded_service_is_refused_not_left_open() -> None:
    """The guard checks unary requests; a request-streaming method of a guarded service (none
    exists today) is refused with or without a token, never served unchecked."""
    import asyncio

    from specdraft.guard import Guard
    from specdraft.security import ServerSecurity

    token = "t" * 32

    async def chat(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield request

    async def run() -> list[grpc.StatusCode]:
        handlers = {"Chat": grpc.stream_stream_rpc_method_handler(chat)}
        server = grpc.aio.server(
            interceptors=[Guard(ServerSecurity(tokens=(token,)), {"test.Svc": "client"})]
        )
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call_chat = channel.stream_stream("/test.Svc/Chat")
                for metadata in ((), (("authorization", f"Bearer {token}"),)):
                    try:
                        async for _ in call_chat(iter([b"hi"]), metadata=metadata, timeout=10):
                            pass
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
        finally:
            await server.stop(None)
        return codes

    assert asyncio.run(run()) == [grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNIMPLEMENTED]
