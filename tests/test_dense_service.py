"""Dense retrieval through real shard servers on loopback and a real Redis: remote = in process,
precise statuses, statistics published and read back, the query cache, and generations that
stay identical to ``ar`` when shards or Redis die."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from datastore_svc.cache import QueryCache, RedisLink, StatsCache
from datastore_svc.dense import DenseConfig
from datastore_svc.fanout import RemoteDatastore
from datastore_svc.server import ShardServer, ShardServerConfig
from datastore_svc.shard import ShardState
from datastore_svc.store import DatastoreVersion, LocalRetriever, write_version
from helpers.datastores import datastore_engine, dense_version, own_continuations, tiny_identity
from helpers.models import FLAT_CURVE, DraftTally, prompts, tiny_model
from helpers.servers import ADMIN, RedisServer, ShardThread, SlowShard, retrieve_request
from helpers.stats import VOCAB
from llm_worker.config import ModelConfig
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from specdraft.stubs import datastore_pb2, datastore_pb2_grpc

pytestmark = pytest.mark.redis
CFG = DenseConfig(top_k=32, max_candidates=3, max_length=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model, a 2-shard dense version of its own continuations, the engine's reference outputs."""
    root = tmp_path_factory.mktemp("dense-service")
    model = tiny_model("llama", vocab=VOCAB, seed=0)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    version = dense_version(model, target, root / "v", own_continuations(target), shards=2)
    ar = Engine(target, curve=FLAT_CURVE)
    refs = [
        ar.generate(GenerationRequest(tuple(p), 40, "ar", stop_at_eos=False)).token_ids
        for p in prompts(VOCAB)
    ]
    return model, target, version, root, refs


def queries_of(version: DatastoreVersion, n: int = 20) -> list[tuple[np.ndarray, int]]:
    """Queries near stored keys, each with the next token of a nearby key (so that drafts exist)."""
    rng = np.random.default_rng(0)
    shard = version.shards[0]
    assert shard.dense is not None
    keys = shard.dense.keys()
    out = []
    for row in rng.integers(0, len(keys), size=n):
        q = keys[row] + rng.normal(size=keys.shape[1]).astype(np.float32) * 0.05
        out.append((q / np.linalg.norm(q), int(shard.tokens[int(shard.dense.positions[row]) + 1])))
    return out


def test_dense_statistics_ask_every_shard_at_once(setup) -> None:
    """Shards that never answer (blackholed: the connection opens, no reply comes) cost one
    timeout together, not one each, before a live shard's statistics are used."""
    import socket
    import time

    _, _, version, root, _ = setup
    holes = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    server = ShardThread(ShardState.open(root / "v", 0))
    try:
        addresses = [f"127.0.0.1:{h.getsockname()[1]}" for h in holes] + [server.address]
        remote = RemoteDatastore(addresses, deadline_seconds=5.0)
        remote.info_timeout = 1.0
        began = time.perf_counter()
        stats, _ = remote.dense_stats("v")
        assert stats is not None and stats.digest() == version.dense_stats.digest()
        assert time.perf_counter() - began < 2.5  # one after another: 3 s at least
        remote.close()
    finally:
        server.stop()
        for h in holes:
            h.close()


def test_remote_dense_retrieval_equals_in_process(setup) -> None:
    _, _, version, root, _ = setup
    servers = [ShardThread(ShardState.open(root / "v", i)) for i in range(2)]
    try:
        remote = RemoteDatastore([s.address for s in servers], deadline_seconds=5.0)
        assert remote.current_version() == "v"
        stats, model = remote.dense_stats("v")
        assert stats is not None and stats.digest() == version.dense_stats.digest()
        assert model == version.dense_model
        found = 0
        for query, nxt in queries_of(version):
            local = version.retrieve_dense(query, nxt, CFG)
            got, answered = remote.retrieve_dense(query, nxt, CFG)
            assert answered == "v"
            assert [c.tokens for c in got.candidates] == [c.tokens for c in local.candidates]
            assert [c.score for c in got.candidates] == pytest.approx([c.score for c in local.candidates])
            found += len(got.candidates)
        assert found > 0
    finally:
        for s in servers:
            s.stop()


def test_bad_dense_requests_get_precise_statuses(setup, tmp_path: Path) -> None:
    _, _, version, root, _ = setup
    docs = [np.arange(20, dtype=np.int32) % VOCAB]
    write_version(docs, tmp_path / "sparse", VOCAB, tiny_identity(VOCAB))
    dense, sparse = (
        ShardThread(ShardState.open(root / "v", 0)),
        ShardThread(ShardState.open(tmp_path / "sparse", 0)),
    )
    try:
        dims = version.dense_stats.dims
        ok = [0.25] * dims
        cases = [
            (
                dense,
                dict(embedding=[0.1] * (dims + 1), next_token=1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "dimensions",
            ),
            (
                dense,
                dict(embedding=[float("nan")] * dims, next_token=1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "finite",
            ),
            (dense, dict(embedding=ok, next_token=VOCAB + 5), grpc.StatusCode.INVALID_ARGUMENT, "next_token"),
            (dense, dict(embedding=ok, next_token=-1), grpc.StatusCode.INVALID_ARGUMENT, "next_token"),
            (dense, dict(embedding=ok, next_token=1, top_k=10**6), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
            (dense, dict(embedding=ok, next_token=1, version="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
            (sparse, dict(embedding=ok, next_token=1), grpc.StatusCode.FAILED_PRECONDITION, "no dense index"),
        ]
        for server, fields, code, words in cases:
            with grpc.insecure_channel(server.address) as channel:
                stub = datastore_pb2_grpc.DatastoreStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.Retrieve(retrieve_request(**fields), timeout=10)
                assert err.value.code() == code and words in err.value.details(), fields
                # and the shard keeps serving
                good = stub.Retrieve(retrieve_request(context=[1, 2]), timeout=10)
                assert good.version in ("v", "sparse")
    finally:
        dense.stop()
        sparse.stop()


def test_generation_survives_a_killed_and_a_slow_dense_shard(setup, tmp_path: Path) -> None:
    model, target, _, _, refs = setup
    version = dense_version(model, target, tmp_path / "v3", own_continuations(target), shards=3)
    assert version.num_shards == 3

    healthy, killed = ShardState.open(tmp_path / "v3", 0), ShardState.open(tmp_path / "v3", 1)
    slow = SlowShard(DatastoreVersion(tmp_path / "v3", shards=[2]), 2)
    servers = [ShardThread(s) for s in (healthy, killed, slow)]
    try:
        servers[1].stop()
        remote = RemoteDatastore([s.address for s in servers], deadline_seconds=0.1)
        engine = datastore_engine(target, remote)
        tally = DraftTally()
        for prompt, ref in zip(prompts(VOCAB), refs, strict=True):
            for mode in ("dresd", "dresd-batch"):
                res = engine.generate(GenerationRequest(tuple(prompt), 40, mode, stop_at_eos=False))
                assert res.token_ids == ref, f"{mode} differs from ar with shards lost"
                tally.observe(mode, res.stats)
        tally.assert_every_mode_drafted_and_accepted("shard loss")  # the healthy shard still drafted
        assert remote.failures[servers[1].address] > 0 and remote.failures[servers[2].address] > 0
    finally:
        servers[0].stop()
        servers[2].stop()


def test_stats_are_published_to_redis_and_read_back(setup, redis_server: RedisServer) -> None:
    import asyncio

    _, _, version, root, _ = setup
    state = ShardState.open(root / "v", 0)

    async def publish() -> None:
        server = ShardServer(state, ShardServerConfig(port=0, admin_port=None, redis_url=redis_server.url))
        await server.start()
        await server.stop(0)

    asyncio.run(publish())
    cache = StatsCache(RedisLink(redis_server.url))

    def no_fallback(v: str) -> None:
        raise AssertionError("the statistics should have come from redis")

    stats = cache.get("v", no_fallback)
    assert stats is not None and stats.digest() == version.dense_stats.digest() and cache.redis_hits == 1
    h = np.random.default_rng(0).normal(size=(3, stats.hidden_size)).astype(np.float32)
    assert np.array_equal(stats.project(h), version.dense_stats.project(h))


def test_query_cache_hits_return_identical_drafts(setup, redis_server: RedisServer) -> None:
    """A second worker (its own engine and caches, the same Redis) answering the same request
    takes every step's drafts from the cache — never searching — and drafts exactly the same."""
    _, target, version, _, refs = setup
    prompt = prompts(VOCAB)[0]

    def worker() -> tuple[Engine, QueryCache]:
        link = RedisLink(redis_server.url)
        queries = QueryCache(link, ttl=60)
        return datastore_engine(
            target, LocalRetriever(version), dense_stats=StatsCache(link), dense_queries=queries
        ), queries

    first_engine, first_cache = worker()
    first = first_engine.generate(GenerationRequest(tuple(prompt), 40, "dresd", stop_at_eos=False))
    assert first_cache.counters.stores > 0 and first_cache.counters.hits == 0
    original = LocalRetriever.retrieve_dense

    def forbid(*args, **kwargs):
        raise AssertionError("a cached step searched again")

    second_engine, second_cache = worker()
    LocalRetriever.retrieve_dense = forbid  # type: ignore[method-assign]
    try:
        again = second_engine.generate(GenerationRequest(tuple(prompt), 40, "dresd", stop_at_eos=False))
    finally:
        LocalRetriever.retrieve_dense = original  # type: ignore[method-assign]
    assert again.token_ids == first.token_ids == refs[0]
    assert first.stats.drafted_tokens > 0 and first.stats.accepted_tokens > 0, first.stats
    assert (again.stats.drafted_tokens, again.stats.accepted_tokens, again.stats.target_forwards) == (
        first.stats.drafted_tokens,
        first.stats.accepted_tokens,
        first.stats.target_forwards,
    )
    assert second_cache.counters.misses == 0 and second_cache.counters.hits > 0
    assert second_cache.counters.saved_seconds == 0  # this worker never paid for a miss to compare with
    keys = second_cache.link.client.keys("specdraft:datastore:v:dense-q:*")
    assert keys and all(0 < second_cache.link.client.ttl(k) <= 60 for k in keys)


def test_redis_killed_mid_run_changes_nothing(setup, redis_server: RedisServer) -> None:
    _, target, version, _, refs = setup
    link = RedisLink(redis_server.url, timeout=0.05, retry_after=0.5)
    queries = QueryCache(link)
    engine = datastore_engine(
        target, LocalRetriever(version), dense_stats=StatsCache(link), dense_queries=queries
    )
    before, after = DraftTally(), DraftTally()
    for i, (prompt, ref) in enumerate(zip(prompts(VOCAB), refs, strict=True)):
        if i == 2:
            redis_server.proc.kill()
            redis_server.proc.wait(10)
        for mode in ("dresd", "dresd-batch"):
            res = engine.generate(GenerationRequest(tuple(prompt), 40, mode, stop_at_eos=False))
            assert res.token_ids == ref, f"{mode} prompt {i} differs after redis died"
            (after if i >= 2 else before).observe(mode, res.stats)
    assert link.errors > 0, "redis was killed, the cache must have noticed"
    before.assert_every_mode_drafted_and_accepted("with redis")
    # without redis, dresd still drafts (statistics cached in process)
    after.assert_every_mode_drafted_and_accepted("after redis died")


@pytest.mark.parametrize(
    "index,words",
    [
        (
            ["--index", "ivf", "--ivf-lists", "100000"],
            "ivf: 100000 inverted lists need at least as many keys",
        ),
        (["--index", "ivfpq"], "ivfpq: its product quantiser trains on at least 256 keys"),
    ],
    ids=["more-lists-than-keys", "too-few-keys-for-pq"],
)
def test_cli_dense_build_refuses_an_index_its_keys_cannot_train(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], index: list[str], words: str
) -> None:
    """An IVF build with more inverted lists than a shard has keys (or ``ivfpq`` with fewer keys
    than its quantiser's 256 centroids) is one clear error line and exit 2, before the model reads
    anything: no version, no temporary directory, no hidden states cached; a dense rebuild
    (``--from``) alike. A negative ``--ivf-lists`` is a usage error."""
    import json

    from client.cli import main

    texts = [f"def add_{i}(x, y):\n    return x + y * {i}\n" for i in range(12)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    versions, hidden = tmp_path / "versions", tmp_path / "h"
    common = ["--model", str(tiny_dir), "--quiet", "--hidden-cache", str(hidden), "--window", "64"]
    build = ["datastore", "build", "--dense", *common, "--pca-dims", "8"]
    capsys.readouterr()
    assert main([*build, "--corpus", str(tmp_path / "c.jsonl"), "--out", str(versions / "a"), *index]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert [p.name for p in versions.iterdir() if not p.name.endswith(".lock")] == []  # nothing half-written
    assert not hidden.exists() or not any(hidden.rglob("*.npy")), "the model ran before the check"

    sparse = ["datastore", "build", *common[:3], "--corpus", str(tmp_path / "c.jsonl")]
    assert main([*sparse, "--out", str(versions / "s")]) == 0
    capsys.readouterr()
    derive = [*build, "--from", str(versions / "s"), "--out", str(versions / "d"), *index]
    assert main(derive) == 2 and words in capsys.readouterr().err
    assert sorted(p.name for p in versions.iterdir() if not p.name.endswith(".lock")) == ["s"]
    with pytest.raises(SystemExit) as usage:
        main(
            [*build, "--corpus", str(tmp_path / "c.jsonl"), "--out", str(versions / "n"), "--ivf-lists", "-1"]
        )
    assert usage.value.code == 2 and "must be >= 0" in capsys.readouterr().err


def test_cli_dense_build_rebuild_eval_generate(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    import json

    from client.cli import main

    texts = [f"def add_{i}(x, y):\n    return x + y * {i}\n\nprint(add_{i}(1, 2))\n" for i in range(30)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[:24]) + "\n")
    (tmp_path / "held.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[24:]) + "\n")
    common = ["--model", str(tiny_dir), "--quiet", "--hidden-cache", str(tmp_path / "h"), "--window", "64"]
    build = ["datastore", "build", "--dense", *common]
    assert (
        main(
            [*build, "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "a"), "--pca-dims", "16"]
        )
        == 0
    )
    built = json.loads(capsys.readouterr().out)
    dense = built["dense"]
    assert dense["dims"] == 16 and dense["keys"] > 0 and dense["chunks"]["computed"] > 0
    assert dense["bytes_per_key"] > 0 and dense["index"] == "flat"
    rebuild = [*build, "--from", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--pca-dims", "8"]
    assert main([*rebuild, "--index", "hnsw"]) == 0
    rebuilt = json.loads(capsys.readouterr().out)["dense"]
    assert rebuilt["chunks"]["computed"] == 0 and rebuilt["dims"] == 8 and rebuilt["index"] == "hnsw"
    assert main(["datastore", "info", str(tmp_path / "b")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dense"]["dims"] == 8 and info["build"]["derived_from"] == "a"

    bench = [
        "datastore",
        "bench",
        "--datastore",
        str(tmp_path / "a"),
        "--model",
        str(tiny_dir),
        "--queries",
        "30",
    ]
    assert main([*bench, "--dense", "--grpc"]) == 0
    measured = json.loads(capsys.readouterr().out)["dense"]
    assert measured["in_process"]["calls"] == measured["grpc"]["calls"] == 30
    assert measured["grpc"]["failures"] == 0 and measured["bytes_per_key"] > 0

    evaluate = ["datastore", "eval", "--datastore", str(tmp_path / "a"), str(tmp_path / "b")]
    assert main([*evaluate, "--corpus", str(tmp_path / "held.jsonl"), *common[:2], "--k", "1,8"]) == 0
    report = json.loads(capsys.readouterr().out)["versions"]
    assert set(report) == {"a", "b"} and report["b"]["dims"] == 8
    assert 0 <= report["a"]["mrr"]["1"]["8"] <= 1 and 0 <= report["b"]["recall_vs_exact"]["8"] <= 1
    assert report["a"]["recall_vs_exact"]["8"] == 1.0  # flat: exact

    gen = ["generate", "def add_3(x, y):", "--model", str(tiny_dir), "--max-new-tokens", "12", "--json"]
    assert main([*gen, "--datastore", str(tmp_path / "a"), "--mode", "dresd"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main([*gen]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    assert out["datastore_version"] == "a"

    questions, report_path = tmp_path / "q.jsonl", tmp_path / "bench.json"
    question = {"question_id": "q", "category": "code", "turns": ["def add_3(x, y):"]}
    questions.write_text(json.dumps(question) + "\n")
    bench_modes = ["bench", "--model", str(tiny_dir), "--datastore", str(tmp_path / "a"), "--questions"]
    assert main([*bench_modes, str(questions), "--modes", "rest:ctx=0,dresd", "--max-new-tokens", "8",
                 "--json-out", str(report_path)]) == 0  # fmt: skip
    latency = json.loads(report_path.read_text())["datastore_latency_ms"]
    assert latency["where"] == "in-process"
    assert latency["sparse"]["calls"] > 0 and latency["dense"]["calls"] > 0
    assert 0 < latency["dense"]["p50_ms"] <= latency["dense"]["p90_ms"] <= latency["dense"]["p99_ms"]
    assert "datastore retrieval (in-process): dense" in capsys.readouterr().out

    assert main(["datastore", "build", "--from", str(tmp_path / "a"), "--out", str(tmp_path / "x")]) == 2
    assert "add --dense" in capsys.readouterr().err
    assert main([*rebuild[:-4], "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "y")]) == 2
    assert "--corpus FILE" in capsys.readouterr().err
    assert (
        main(
            [
                "datastore",
                "build",
                "--corpus",
                str(tmp_path / "c.jsonl"),
                "--out",
                str(tmp_path / "s"),
                *common[:2],
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main([*gen, "--datastore", str(tmp_path / "s"), "--mode", "dresd"]) == 2
    assert "no dense index" in capsys.readouterr().err


def test_cache_metrics_are_exported_to_prometheus() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from datastore_svc.cache import CacheCollector

    queries = QueryCache(None)
    queries.counters.hits, queries.counters.misses, queries.counters.saved_seconds = 3, 1, 0.25
    registry = CollectorRegistry()
    registry.register(CacheCollector(queries))
    text = generate_latest(registry).decode()
    for line in (
        "specdraft_dense_cache_hits_total 3.0",
        "specdraft_dense_cache_misses_total 1.0",
        "specdraft_dense_cache_saved_seconds_total 0.25",
        "specdraft_dense_cache_errors_total 0.0",
    ):
        assert line in text, text


def test_query_keys_cover_the_whole_context_or_a_recent_window() -> None:
    whole, recent = QueryCache(None), QueryCache(None, context_window=3)
    a, b = np.array([1, 2, 3, 4, 5]), np.array([9, 9, 3, 4, 5])
    assert whole.key("v", CFG, a) != whole.key("v", CFG, b)
    assert recent.key("v", CFG, a) == recent.key("v", CFG, b) != whole.key("v", CFG, a)
    assert recent.key("v", CFG, a) != recent.key("w", CFG, a)
    other_shape = DenseConfig(top_k=8, max_candidates=3, max_length=8)
    assert whole.key("v", CFG, a) != whole.key("v", other_shape, a)


def test_a_swap_to_a_dense_version_of_other_dimensions(setup, tmp_path: Path) -> None:
    """Each request projects with the statistics of the version it is pinned to: before a swap v
    (16 dims), after it v-d8 (8 dims, rebuilt from v's tokens without the model) — identical to ar
    on both, and both draft."""
    from datastore_svc.dense_build import DenseBuildConfig, dense_step
    from datastore_svc.fanout import swap_all
    from datastore_svc.store import derive_version
    from llm_worker.encoders import ModelEncoder

    model, target, _, root, refs = setup
    cfg = DenseBuildConfig(dims=8, window=32, overlap=8, chunk_tokens=120, cache_dir=root / "hidden")
    if not (root / "v-d8").exists():
        derive_version(
            root / "v",
            root / "v-d8",
            dense_step(ModelEncoder(model), "tiny", target.info.weights_id, cfg, False),
        )
    servers = [ShardThread(ShardState.open(root / "v", i)) for i in range(2)]
    try:
        remote = RemoteDatastore([s.address for s in servers], deadline_seconds=5.0)
        remote.recheck_seconds = 0.0  # ask the shards for their version at every request
        engine = datastore_engine(target, remote)
        prompt = prompts(VOCAB)[0]
        before = engine.generate(GenerationRequest(tuple(prompt), 40, "dresd", stop_at_eos=False))
        swap_all([s.admin_address for s in servers], "v-d8", ADMIN)
        after = engine.generate(GenerationRequest(tuple(prompt), 40, "dresd", stop_at_eos=False))
        assert before.token_ids == after.token_ids == refs[0]
        assert (before.datastore_version, after.datastore_version) == ("v", "v-d8")
        for res in (before, after):
            assert res.stats.drafted_tokens > 0 and res.stats.accepted_tokens > 0, res.stats
    finally:
        for s in servers:
            s.stop()


def test_a_dense_index_of_other_dimensions_than_its_statistics_is_refused(setup, tmp_path: Path) -> None:
    """A version whose FAISS index has 16 dimensions but whose statistics make 8 (index files
    swapped, checksums updated so only the dimension is wrong): FAILED_PRECONDITION on LoadVersion,
    DatastoreError in process, and the shard keeps its version."""
    import json
    import shutil

    from datastore_svc.dense_build import DenseBuildConfig, dense_step
    from datastore_svc.store import DatastoreError, derive_version
    from llm_worker.encoders import ModelEncoder
    from specdraft.common import sha256_file

    model, target, _, root, _ = setup
    cfg = DenseBuildConfig(dims=8, window=32, overlap=8, chunk_tokens=120, cache_dir=root / "hidden")
    if not (root / "v-d8").exists():
        derive_version(
            root / "v",
            root / "v-d8",
            dense_step(ModelEncoder(model), "tiny", target.info.weights_id, cfg, False),
        )
    bad = root / "v-mismatch"
    if not bad.exists():
        shutil.copytree(root / "v-d8", bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["version"] = "v-mismatch"
        for entry in manifest["shards"]:
            shard = f"shard-{entry['index']:04d}"
            shutil.copyfile(root / "v" / shard / "dense.faiss", bad / shard / "dense.faiss")
            file = bad / shard / "dense.faiss"
            entry["files"]["dense.faiss"] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
        (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match="16 dimensions, its statistics 8"):
        DatastoreVersion(bad)
    server = ShardThread(ShardState.open(root / "v", 0))
    try:
        with ADMIN.channel(server.admin_address) as channel, pytest.raises(grpc.RpcError) as err:
            datastore_pb2_grpc.DatastoreAdminStub(channel).LoadVersion(
                datastore_pb2.LoadVersionRequest(version="v-mismatch"), timeout=30
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "dimensions" in (err.value.details() or "") and str(root) not in (err.value.details() or "")
        assert server.state.current_version() == "v"
    finally:
        server.stop()


def test_out_of_vocabulary_drafts_planted_in_redis_change_nothing(setup, redis_server: RedisServer) -> None:
    """Someone with access to Redis rewrites every cached dense query so that its drafts hold token
    ids outside the vocabulary: the worker drops those drafts before the forward (counted), and
    its output stays identical to ar."""
    from datastore_svc.cache import decode_result, encode_result
    from datastore_svc.dense import DenseCandidate, DenseRetrieval

    _, target, version, _, refs = setup
    prompt = prompts(VOCAB)[0]

    def worker() -> tuple[Engine, QueryCache]:
        link = RedisLink(redis_server.url)
        queries = QueryCache(link, ttl=60)
        engine = datastore_engine(
            target, LocalRetriever(version), dense_stats=StatsCache(link), dense_queries=queries
        )
        return engine, queries

    first_engine, first_cache = worker()
    first_engine.generate(GenerationRequest(tuple(prompt), 40, "dresd", stop_at_eos=False))
    client = first_cache.link.client
    keys = client.keys("specdraft:datastore:v:dense-q:*")
    assert keys
    for key in keys:
        query, result = decode_result(client.hgetall(key))
        poisoned = tuple(
            DenseCandidate((c.tokens[0], 10**6, -5, *c.tokens[1:]), c.score, c.count, c.source)
            for c in result.candidates
        ) or (DenseCandidate((1, 10**6), 1.0, 1),)
        client.hset(
            key, mapping=encode_result(query, DenseRetrieval(poisoned, result.searched, result.matched))
        )
    engine, cache = worker()
    res = engine.generate(GenerationRequest(tuple(prompt), 40, "dresd", stop_at_eos=False))
    assert res.token_ids == refs[0]
    assert cache.counters.hits > 0 and engine.dropped_drafts > 0


def test_a_poisoned_statistics_entry_costs_one_miss_and_is_replaced(setup, redis_server: RedisServer) -> None:
    """Each poison planted where a worker reads a version's statistics (a truncated zip, a
    decompression bomb, a hash where a string belongs) is read once: counted, deleted, replaced
    with the datastore's own statistics, without taking Redis for down; the next worker reads
    the good value from Redis."""
    _, _, version, _, _ = setup
    good = version.dense_stats
    assert good is not None
    client = RedisLink(redis_server.url).client
    key = StatsCache.key("v")
    poisons = {
        "truncated": lambda: client.set(key, good.to_bytes()[:-10]),
        "bomb": lambda: client.set(key, _deflated_zeros(64)),
        "wrong type": lambda: client.hset(key, mapping={"x": "y"}),
    }
    asked: list[str] = []

    def fallback(v: str) -> object:
        asked.append(v)
        return good

    def forbid(v: str) -> None:
        raise AssertionError("the poison was not replaced in redis")

    for name, plant in poisons.items():
        client.delete(key)
        plant()
        asked.clear()
        link = RedisLink(redis_server.url)
        cache = StatsCache(link)
        stats = cache.get("v", fallback)
        assert stats is not None and stats.digest() == good.digest(), name
        assert (cache.unreadable, cache.redis_hits, asked, link.errors) == (1, 0, ["v"], 0), name
        assert cache.get("v", fallback) is stats and asked == ["v"], name  # held in process now
        again = StatsCache(RedisLink(redis_server.url))
        replaced = again.get("v", forbid)
        assert replaced is not None and replaced.digest() == good.digest(), name
        assert (again.redis_hits, again.unreadable) == (1, 0), name


def _deflated_zeros(mib: int) -> bytes:
    """An ``.npz``-looking zip whose first member inflates to ``mib`` MiB of zeros."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mean.npy", bytes(mib << 20))
    return buf.getvalue()


def test_a_poisoned_query_cache_entry_costs_one_miss_and_is_replaced(
    setup, redis_server: RedisServer
) -> None:
    """Cached queries that do not parse (numbers JSON allows but ``int`` refuses, a string where
    a hash belongs, a hash over the size this cache stores) are misses, counted and deleted; the
    worker's own result then takes the key, and the next read hits."""
    from datastore_svc.cache import encode_result
    from datastore_svc.dense import DenseCandidate, DenseRetrieval

    link = RedisLink(redis_server.url)
    queries = QueryCache(link, ttl=60)
    client = link.client
    key = queries.key("v", CFG, np.arange(12))
    good = DenseRetrieval((DenseCandidate((5, 6, 7), 0.9, 1),), 3, 1)
    query = np.ones(4, np.float32)
    poisons = {
        "infinite count": lambda: client.hset(key, mapping={"q": b"", "r": b'{"c": [], "s": 1e999, "m": 0}'}),
        "deep nesting": lambda: client.hset(key, mapping={"q": b"", "r": b"[" * 5000}),
        "wrong type": lambda: client.set(key, b"x"),
        "too big": lambda: client.hset(key, mapping={**encode_result(query, good), "pad": bytes(20_000)}),
    }
    for n, (name, plant) in enumerate(poisons.items(), start=1):
        client.delete(key)
        plant()
        assert queries.get(key) is None, name
        assert (queries.counters.unreadable, queries.counters.misses, link.errors) == (n, n, 0), name
        assert not client.exists(key), name
        queries.put(key, query, good, 0.01)
        assert queries.get(key) == good, name


def test_load_version_with_malformed_statistics_is_failed_precondition(setup) -> None:
    """A version whose manifest carries statistics that are not a readable ``.npz`` (checksum
    updated, so only the content is wrong): FAILED_PRECONDITION, never INTERNAL, and the shard
    keeps its version."""
    import base64
    import hashlib
    import io
    import json
    import shutil

    _, _, version, root, _ = setup
    assert version.dense_stats is not None
    scalar = io.BytesIO()
    np.savez(scalar, mean=np.float32(1), std=np.ones(3), components=np.ones((2, 3)), offset=np.ones(2))
    bad_stats = {
        "v-stats-truncated": version.dense_stats.to_bytes()[:-10],  # was BadZipFile
        "v-stats-scalar": scalar.getvalue(),  # was IndexError
    }
    for name, data in bad_stats.items():
        if not (root / name).exists():
            shutil.copytree(root / "v", root / name)
            manifest = json.loads((root / name / "manifest.json").read_text())
            manifest["version"] = name
            manifest["dense"]["stats"]["npz_base64"] = base64.b64encode(data).decode()
            manifest["dense"]["stats"]["sha256"] = hashlib.sha256(data).hexdigest()
            (root / name / "manifest.json").write_text(json.dumps(manifest))
    server = ShardThread(ShardState.open(root / "v", 0))
    try:
        with ADMIN.channel(server.admin_address) as channel:
            admin = datastore_pb2_grpc.DatastoreAdminStub(channel)
            for name in bad_stats:
                with pytest.raises(grpc.RpcError) as err:
                    admin.LoadVersion(datastore_pb2.LoadVersionRequest(version=name), timeout=30)
                details = err.value.details() or ""
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (name, details)
                assert "dense statistics" in details and str(root) not in details, details
        assert server.state.current_version() == "v"
    finally:
        server.stop()
