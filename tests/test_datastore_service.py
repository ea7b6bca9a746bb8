"""Datastore shards as real gRPC servers on loopback: retrieval, validation, fan-out under shard
loss, version swaps under load, refusal of bad versions, and the CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.cli import main
from datastore_svc.fanout import RemoteDatastore, SwapError, swap_all
from datastore_svc.retrieval import RetrievalConfig
from datastore_svc.shard import ShardState
from datastore_svc.store import DatastoreVersion, write_version
from helpers.datastores import datastore_engine, datastore_for, tiny_identity
from helpers.models import (
    FLAT_CURVE,
    DraftTally,
    assert_greedy_identical,
    engine_for,
    greedy_tokens,
    prompts,
    tiny_target,
)
from helpers.servers import ADMIN, ADMIN_TOKEN, ShardThread, SlowShard, retrieve_request, wait_until
from llm_worker.engine import GenerationRequest
from specdraft.stubs import datastore_pb2, datastore_pb2_grpc

VOCAB = 96
IDENTITY = tiny_identity(VOCAB)


def random_docs(seed: int, count: int = 30) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 6, size=50).astype(np.int32) for _ in range(count)]  # few symbols: many matches


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("versions")
    write_version(random_docs(1), root / "v1", VOCAB, IDENTITY, shards=2)
    write_version(random_docs(2), root / "v2", VOCAB, IDENTITY, shards=2)
    return root


@pytest.fixture()
def shards(versions: Path) -> Iterator[list[ShardThread]]:
    servers = [ShardThread(ShardState.open(versions / "v1", i, drain_seconds=30)) for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


CFG = RetrievalConfig(c_max=8, max_length=6, max_nodes=40, max_candidates=40)


def test_shards_of_another_tokenizer_are_refused_at_start_and_left_out_later(
    shards: list[ShardThread], versions: Path
) -> None:
    """A worker whose tokenizer is not the one the shards' datastore was built with: assembling
    it fails with a clear error, and a datastore that already runs leaves such a shard out (its
    token ids would mean other tokens) once it sees it, and takes it back when it matches."""
    from llm_worker.assembly import AssemblyError, ResourceConfig, build_resources

    class OtherTokenizer:
        name_or_path = "other"
        all_special_tokens = ()

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

        def __len__(self) -> int:
            return 2

    addresses = tuple(s.address for s in shards)
    with pytest.raises(AssemblyError, match="another tokenizer"):
        build_resources(ResourceConfig(datastore_addresses=addresses), OtherTokenizer())

    remote = RemoteDatastore(list(addresses), deadline_seconds=5.0, tokenizer_fingerprint="someone-else")
    context = np.array([1, 2, 3, 1, 2])
    assert remote.retrieve(context, CFG)[0].candidates  # not checked yet
    assert remote.check_tokenizers() == (list(addresses), [])
    assert remote.retrieve(context, CFG)[0].candidates == ()
    remote.tokenizer_fingerprint = IDENTITY["fingerprint"]
    assert remote.current_version() == "v1" and remote.foreign == {}
    assert remote.retrieve(context, CFG)[0].candidates
    remote.close()


def test_remote_retrieval_equals_in_process(shards: list[ShardThread], versions: Path) -> None:
    local = DatastoreVersion(versions / "v1")
    remote = RemoteDatastore([s.address for s in shards], deadline_seconds=5.0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        context = rng.integers(0, 6, size=8)
        got, version = remote.retrieve(context, CFG)
        want = local.retrieve(context, CFG)
        assert version == "v1" and got.match_length == want.match_length
        assert sorted((c.tokens, c.counts) for c in got.candidates) == sorted(
            (c.tokens, c.counts) for c in want.candidates
        )
    timed = remote.times.summary()["sparse"]  # each fan-out as the worker waited for it
    assert timed["calls"] == 20 and 0 < timed["p50_ms"] <= timed["p90_ms"] <= timed["p99_ms"]
    info = remote.info()
    assert [(i.shard, i.shards, i.version) for i in info] == [(0, 2, "v1"), (1, 2, "v1")]
    with grpc.insecure_channel(shards[0].address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_admin_port_tells_the_shards_health(shards: list[ShardThread]) -> None:
    """The admin port's health is the shard's: NOT_SERVING when the shard says so (draining),
    not SERVING from start to end."""
    import asyncio

    def status(address: str) -> int:
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            return check(health_pb2.HealthCheckRequest(), timeout=5).status

    shard = shards[0]
    assert status(shard.admin_address) == health_pb2.HealthCheckResponse.SERVING
    asyncio.run_coroutine_threadsafe(
        shard.server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING), shard.loop
    ).result(10)
    assert status(shard.admin_address) == status(shard.address) == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize(
    "request_kw,code",
    [
        ({"context": []}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"context": [1, 2, VOCAB + 7]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"context": [1, -2]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"context": [1] * 2000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"context": [1, 2], "max_length": 10_000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"context": [1, 2], "min_match": 5}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"context": [1, 2], "version": "v9"}, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_retrieve_requests_get_precise_statuses(
    shards: list[ShardThread], request_kw: dict[str, Any], code: grpc.StatusCode
) -> None:
    with grpc.insecure_channel(shards[0].address) as channel:
        stub = datastore_pb2_grpc.DatastoreStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Retrieve(retrieve_request(**request_kw), timeout=5)
        assert err.value.code() == code
        assert stub.Retrieve(retrieve_request(context=[1, 2]), timeout=5).version == "v1"


def test_a_huge_version_name_is_invalid_argument_with_a_short_message(shards: list[ShardThread]) -> None:
    """A 200 000-character version name cannot name a version (one directory name, at most 255
    characters): INVALID_ARGUMENT on every call that takes one, and the error text quotes only its
    start (echoed whole, it made the status trailer too large: the client saw RESOURCE_EXHAUSTED)."""
    huge = "v" * 200_000
    with grpc.insecure_channel(shards[0].address) as channel, ADMIN.channel(shards[0].admin_address) as admin:
        stub = datastore_pb2_grpc.DatastoreStub(channel)
        admin_stub = datastore_pb2_grpc.DatastoreAdminStub(admin)
        calls = {
            "sparse": lambda: stub.Retrieve(retrieve_request(context=[1, 2], version=huge), timeout=5),
            "dense": lambda: stub.Retrieve(
                retrieve_request(embedding=[0.5] * 4, next_token=1, version=huge), timeout=5
            ),
            "info": lambda: stub.GetShardInfo(datastore_pb2.ShardInfoRequest(version=huge), timeout=5),
            "load": lambda: admin_stub.LoadVersion(datastore_pb2.LoadVersionRequest(version=huge), timeout=5),
            "swap": lambda: admin_stub.SwapVersion(datastore_pb2.SwapVersionRequest(version=huge), timeout=5),
            "swap from": lambda: admin_stub.SwapVersion(
                datastore_pb2.SwapVersionRequest(version="v1", expected_previous=huge), timeout=5
            ),
        }
        wrong = {}
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            code, details = err.value.code(), err.value.details()
            if code != grpc.StatusCode.INVALID_ARGUMENT or len(details) > 300:
                wrong[name] = (code.name, details[:100])
        assert not wrong
        assert stub.Retrieve(retrieve_request(context=[1, 2]), timeout=5).version == "v1"


def test_generation_survives_a_killed_and_a_slow_shard(tmp_path: Path) -> None:
    """Three shards: one healthy, one killed, one past its deadline → identical to ar, still drafting."""
    target = tiny_target("llama")
    datastore_for(target, tmp_path / "v", shards=3)
    states = [ShardState.open(tmp_path / "v", 0), ShardState.open(tmp_path / "v", 1)]
    slow = SlowShard(DatastoreVersion(tmp_path / "v", shards=[2]), 2)
    servers = [ShardThread(s) for s in (*states, slow)]
    try:
        servers[1].stop()  # killed: connection refused from now on
        remote = RemoteDatastore([s.address for s in servers], deadline_seconds=0.1)
        engine = datastore_engine(target, remote)
        ref_engine = engine_for(target, FLAT_CURVE)
        tally = DraftTally()
        for i, prompt in enumerate(prompts(VOCAB)):
            ref = greedy_tokens(ref_engine, prompt, "ar", 40)
            res = engine.generate(GenerationRequest(tuple(prompt), 40, "rest"))
            assert_greedy_identical(target, prompt, ref, res.token_ids, f"shard loss/prompt{i}")
            tally.observe("rest", res.stats)
        tally.assert_every_mode_drafted_and_accepted("shard loss")  # the healthy shard still drafted
        assert remote.failures[servers[1].address] > 0 and remote.failures[servers[2].address] > 0
    finally:
        for s in (servers[0], servers[2]):
            s.stop()


def test_swap_under_concurrent_load_never_mixes_versions(shards: list[ShardThread]) -> None:
    addresses = [s.address for s in shards]
    remote = RemoteDatastore(addresses, deadline_seconds=5.0)
    stop = threading.Event()
    seen: list[list[str]] = []

    def request_loop(seed: int) -> int:
        rng = np.random.default_rng(seed)
        calls = 0
        while not stop.is_set():
            pinned = ""
            versions = []
            for _ in range(5):  # one "request": five retrievals pinned to the first answer's version
                _, version = remote.retrieve(rng.integers(0, 6, size=6), CFG, pinned)
                pinned = pinned or version
                versions.append(version)
                calls += 1
            seen.append(versions)
        return calls

    def requests_pinned_to(version: str) -> int:
        return sum(v[0] == version for v in list(seen))

    with ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(request_loop, i) for i in range(4)]
        try:
            wait_until(lambda: requests_pinned_to("v1") >= 8, what="requests run on v1 before the swap")
            swapped = swap_all([s.admin_address for s in shards], "v2", ADMIN)
            wait_until(lambda: requests_pinned_to("v2") >= 8, what="requests run on v2 after the swap")
        finally:
            stop.set()
        calls = sum(f.result() for f in loops)  # raises if any call failed
    assert swapped == [("v1", "v2"), ("v1", "v2")]
    assert calls > 20 and sum(remote.failures.values()) == 0
    assert all(len(set(v)) == 1 for v in seen), "a request mixed datastore versions"
    assert {v[0] for v in seen} == {"v1", "v2"}
    assert seen[-1][0] == "v2"
    assert all(s.state.loaded_versions() == ["v1", "v2"] for s in shards)  # v1 drains for 30 s


def test_bad_versions_are_refused_while_the_current_one_serves(
    shards: list[ShardThread], versions: Path
) -> None:
    addresses = [s.address for s in shards]
    admins = [s.admin_address for s in shards]
    bad = versions / "v-corrupt"
    write_version(random_docs(3), bad, VOCAB, IDENTITY, shards=2)
    sa = bad / "shard-0001" / "sa.npy"
    data = bytearray(sa.read_bytes())
    data[-1] ^= 0x55
    sa.write_bytes(bytes(data))
    other = versions / "v-other-tokenizer"
    write_version(random_docs(4), other, VOCAB, {**IDENTITY, "fingerprint": "other"}, shards=2)
    partial = versions / "v-partial"
    partial.mkdir()
    for path, reason in [(bad, "checksum"), (other, "another tokenizer"), (partial, "manifest")]:
        with pytest.raises(SwapError, match=reason) as err:
            swap_all(admins, path.name, ADMIN)
        assert str(versions) not in str(err.value)  # nothing about where the versions live
    remote = RemoteDatastore(addresses, deadline_seconds=5.0)
    _, version = remote.retrieve(np.array([1, 2, 3]), CFG)
    assert version == "v1" and [i.version for i in remote.info()] == ["v1", "v1"]
    with ADMIN.channel(admins[0]) as channel:
        with pytest.raises(grpc.RpcError) as rpc_err:
            datastore_pb2_grpc.DatastoreAdminStub(channel).SwapVersion(
                datastore_pb2.SwapVersionRequest(version="never-loaded"), timeout=5
            )
        assert rpc_err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_cli_build_info_serve_and_swap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) for i in range(40))
    )
    for name in ("a", "b"):
        assert (
            main(["datastore", "build", "--corpus", str(corpus), "--out", str(tmp_path / name), "--quiet"])
            == 0
        )
        built = json.loads(capsys.readouterr().out)
        assert built["version"] == name and built["tokens"] > 0 and built["bytes_per_token"] > 0
    assert main(["datastore", "info", str(tmp_path / "a")]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 1
    assert main(["datastore", "bench", "--datastore", str(tmp_path / "a"), "--queries", "20", "--grpc"]) == 0
    bench = json.loads(capsys.readouterr().out)
    assert bench["in_process"]["calls"] == bench["grpc"]["calls"] == 20 and bench["grpc"]["failures"] == 0
    assert main(["datastore", "build", "--corpus", str(corpus), "--out", str(tmp_path / "a")]) == 2
    assert "immutable" in capsys.readouterr().err

    cmd = [sys.executable, "-m", "client.cli", "serve", "datastore", "--datastore", str(tmp_path / "a")]
    monkeypatch.setenv("SPECDRAFT_ADMIN_TOKEN", ADMIN_TOKEN)  # the shard's admin identity and ours
    proc = subprocess.Popen([*cmd, "--port", "0", "--admin-port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        admin = ""
        for line in proc.stderr:
            found = re.search(r"listening on (\S+) \(admin (\d+), plaintext\)", line)
            if found:
                admin = f"127.0.0.1:{found.group(2)}"
                break
        assert admin, "the shard did not start"
        assert main(["datastore", "swap", "--version", "b", "--admin-addr", admin]) == 0
        assert f"{admin}: a -> b" in capsys.readouterr().err
        assert main(["datastore", "swap", "--version", "nope", "--admin-addr", admin]) == 2
        assert "refused version 'nope'" in capsys.readouterr().err
        monkeypatch.setenv("SPECDRAFT_ADMIN_TOKEN", "not-the-admin-token-at-all")
        assert main(["datastore", "swap", "--version", "a", "--admin-addr", admin]) == 2
        assert "bearer token is not valid" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
