"""Dense retrieval (DReSD): statistics, FAISS indexes vs exact search, drafts vs a brute-force
scan, dense versions on disk (build, hidden-state cache, refusal of corrupt parts), and the
``dresd`` modes against ``ar`` on tiny random models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from datastore_svc.dense import (
    FLAT_MAX_KEYS,
    DenseConfig,
    DenseError,
    DenseIndex,
    DenseStats,
    IndexParams,
    build_faiss_index,
    check_index,
    choose_kind,
    dense_retrieve,
    drafts_from_hits,
    exact_search,
    fit_stats,
    ivf_lists,
    merge_dense,
    recall_at,
)
from datastore_svc.dense_build import DenseBuildConfig, HiddenStates, dense_step, spread_documents
from datastore_svc.store import (
    DatastoreError,
    DatastoreVersion,
    LocalRetriever,
    derive_version,
    write_version,
)
from helpers.datastores import (
    datastore_engine,
    dense_version,
    key_positions,
    own_continuations,
    own_samples,
    tiny_identity,
)
from helpers.models import BACKEND_CASES, BACKEND_IDS, DraftTally, prompts, tiny_model
from helpers.stats import SAMPLES, VOCAB, chi_square_p, exact_distribution, sample_counts
from llm_worker.config import ModelConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftResources, ModeUnavailableError
from llm_worker.encoders import ModelEncoder
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.planner import CostCurve

SEP = 100


def hidden_like(n: int, size: int = 48, seed: int = 0) -> np.ndarray:
    """Vectors with uneven scales and offsets per dimension, loosely clustered (like hidden
    states); the structure is fixed, ``seed`` draws other vectors from it."""
    fixed = np.random.default_rng(1234)
    centres = fixed.normal(size=(12, size))
    scale, offset = fixed.uniform(0.2, 5.0, size), fixed.normal(size=size) * 10
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(0, 12, size=n)] + rng.normal(size=(n, size))
    return (x * scale + offset).astype(np.float32)


# -- statistics --------------------------------------------------------------------------------


def test_zscore_and_pca_round_trip() -> None:
    h = hidden_like(4000)
    full = fit_stats(h, h.shape[1])
    z = (h - full.mean) / full.std
    assert np.allclose(z.mean(axis=0), 0, atol=1e-3) and np.allclose(z.std(axis=0), 1, atol=1e-3)
    y = z @ full.components.T + full.offset  # all dimensions: an orthonormal rotation
    assert np.allclose(full.components @ full.components.T, np.eye(h.shape[1]), atol=1e-4)
    back = (y - full.offset) @ full.components
    assert np.allclose(back * full.std + full.mean, h, atol=1e-2 * np.abs(h).max())
    reduced = fit_stats(h, 8)
    assert np.allclose(reduced.components, full.components[:8], atol=1e-3)  # the top components
    q = reduced.project(h)
    assert q.shape == (4000, 8) and np.allclose(np.linalg.norm(q, axis=1), 1, atol=1e-5)
    assert np.allclose(reduced.project(h[7]), q[7], atol=1e-6)
    explained = np.var(z @ reduced.components.T, axis=0)
    assert (np.diff(explained) <= 1e-3).all(), "components are sorted by explained variance"


def test_stats_survive_bytes_and_manifest_and_refuse_corruption() -> None:
    stats = fit_stats(hidden_like(500), 8)
    h = hidden_like(10, seed=1)
    for copy in (DenseStats.from_bytes(stats.to_bytes()), DenseStats.from_manifest(stats.to_manifest())):
        assert np.array_equal(copy.project(h), stats.project(h))
    entry = stats.to_manifest()
    entry["npz_base64"] = entry["npz_base64"][:-8] + "AAAAAAA="
    with pytest.raises(DenseError, match=r"checksum|base64"):
        DenseStats.from_manifest(entry)
    with pytest.raises(DenseError, match="unreadable"):
        DenseStats.from_bytes(b"not an npz")
    with pytest.raises(DenseError, match="hidden state of size"):
        stats.project(np.zeros(7, np.float32))
    with pytest.raises(DenseError, match="dims"):
        fit_stats(hidden_like(100), 49)


def stats_bomb(unpacked_mib: int, declared_bytes: int | None = None) -> bytes:
    """An ``.npz`` whose ``mean.npy`` deflates ``unpacked_mib`` MiB of zeros into a few hundred
    KiB (183 MiB: 183 KiB, as in issue 34); ``declared_bytes`` rewrites the size its central
    directory declares (a bomb that lies about its size)."""
    import io
    import struct
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        header = io.BytesIO()
        shape = (unpacked_mib << 18,)
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
        archive.writestr("mean.npy", header.getvalue() + bytes(unpacked_mib << 20))
        for name in ("std", "components", "offset"):
            member = io.BytesIO()
            np.save(member, np.ones(2, np.float32))
            archive.writestr(f"{name}.npy", member.getvalue())
    data = bytearray(buf.getvalue())
    if declared_bytes is not None:
        entry = data.index(b"PK\x01\x02")  # mean.npy's central directory entry; its size at +24
        struct.pack_into("<I", data, entry + 24, declared_bytes)
    return bytes(data)


@pytest.mark.parametrize("declared", [None, 1000], ids=["honest", "lying-size"])
def test_a_decompression_bomb_is_refused_without_unpacking_it(declared: int | None) -> None:
    """183 MiB deflated into about 183 KiB: refused before inflating (declared size over
    ``MAX_STATS_BYTES``) or while inflating (a declared size that lies: inflation stops there),
    with well under 8 MiB allocated (numpy's own allocations are traced too)."""
    import tracemalloc

    bomb = stats_bomb(183, declared)
    assert len(bomb) < 200 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(DenseError, match=r"more than|unreadable"):
            DenseStats.from_bytes(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB allocated to refuse a bomb"


def test_every_malformed_statistics_value_is_a_dense_error() -> None:
    """Whatever the bytes, ``from_bytes`` raises ``DenseError`` and nothing else (a truncated zip
    was ``BadZipFile``, a scalar mean ``IndexError``)."""
    import io

    good = fit_stats(hidden_like(200), 8)
    data = good.to_bytes()
    scalar = io.BytesIO()
    np.savez(
        scalar, mean=np.float32(1), std=np.ones(3, np.float32), components=np.ones((2, 3)), offset=np.ones(2)
    )
    compressed = io.BytesIO()
    np.savez_compressed(
        compressed, mean=good.mean, std=good.std, components=good.components, offset=good.offset
    )
    assert DenseStats.from_bytes(compressed.getvalue()).digest() == good.digest()
    wrong_dtype = io.BytesIO()
    np.savez(
        wrong_dtype,
        mean=good.mean.astype(np.int32),
        std=good.std,
        components=good.components,
        offset=good.offset,
    )
    for bad in (
        b"",
        b"PK\x03\x04" + b"\x00" * 64,
        data[:-10],
        data[: len(data) // 2],
        data.replace(b"mean.npy", b"mean.npz"),
        scalar.getvalue(),
        wrong_dtype.getvalue(),
        b"\x00" * (33 << 20),  # over MAX_STATS_BYTES
    ):
        with pytest.raises(DenseError):
            DenseStats.from_bytes(bad)


# -- indexes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,floor", [("flat", 0.99), ("hnsw", 0.95), ("ivf", 0.85), ("ivfpq", 0.6)])
def test_approximate_indexes_recall_exact_search(kind: str, floor: float, tmp_path: Path) -> None:
    import faiss

    stats = fit_stats(hidden_like(20_000), 16)
    keys = stats.project(hidden_like(20_000))
    queries = stats.project(hidden_like(200, seed=3))
    index = build_faiss_index(keys, kind, IndexParams(pq_bytes=8))
    faiss.write_index(index, str(tmp_path / "i.faiss"))  # what a shard reads back
    dense = DenseIndex(faiss.read_index(str(tmp_path / "i.faiss")), np.arange(len(keys)))
    _, approx = dense.search(queries, 10)
    _, exact = exact_search(keys, queries, 10)
    recall = recall_at(approx, exact)
    assert recall >= floor, f"{kind}: recall@10 {recall:.3f} < {floor}"
    assert np.allclose(dense.keys(), keys, atol=0.3 if kind == "ivfpq" else 2e-3)


def test_auto_index_kind_by_size() -> None:
    assert choose_kind(FLAT_MAX_KEYS) == "flat" and choose_kind(FLAT_MAX_KEYS + 1) == "ivf"
    assert choose_kind(10_000_000) == "ivf"  # measured better than HNSW above the bound
    assert choose_kind(10, "ivf") == "ivf" and choose_kind(10_000_000, "hnsw") == "hnsw"
    with pytest.raises(DenseError, match="choose one of"):
        choose_kind(10, "annoy")


def test_an_index_its_keys_cannot_train_is_refused_before_faiss() -> None:
    """IVF needs a key per inverted list and ``ivfpq`` 256 keys (FAISS's k-means would fail after
    the model pass with a C++ message); an empty shard trains nothing and passes."""
    keys = np.eye(8, dtype=np.float32)[np.arange(40) % 8]
    with pytest.raises(DenseError, match="ivf: 41 inverted lists need at least as many keys"):
        build_faiss_index(keys, "ivf", IndexParams(ivf_lists=41))
    assert build_faiss_index(keys, "ivf", IndexParams(ivf_lists=40)).ntotal == 40
    with pytest.raises(DenseError, match="ivfpq: its product quantiser trains on at least 256 keys"):
        check_index(255, "ivfpq")
    check_index(0, "ivf", IndexParams(ivf_lists=5))
    check_index(3, "flat", IndexParams(ivf_lists=5))  # only IVF has lists
    assert ivf_lists(200_001) == 1788 and ivf_lists(100) == 2


def test_auto_ivf_trains_just_above_the_flat_bound(capfd: pytest.CaptureFixture[str]) -> None:
    """The smallest shard ``auto`` sends to IVF gets enough training points per list (FAISS's
    k-means warns below 39) and finds what exact search finds."""
    import faiss

    n = FLAT_MAX_KEYS + 1
    keys = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    capfd.readouterr()
    index = build_faiss_index(keys, choose_kind(n))
    assert "WARNING" not in capfd.readouterr().err  # e.g. "please provide at least 69732 training points"
    ivf = faiss.extract_index_ivf(index)
    assert index.is_trained and index.ntotal == n and n // ivf.nlist >= 39
    queries = keys[:200] + 0.05 * np.random.default_rng(1).standard_normal((200, 8)).astype(np.float32)
    _, approx = DenseIndex(index, np.arange(n)).search(queries, 8)
    _, exact = exact_search(keys, queries, 8)
    assert recall_at(approx, exact) >= 0.9


# -- drafts from hits ---------------------------------------------------------------------------


def test_drafts_keep_the_verified_next_token_and_read_what_followed() -> None:
    tokens = np.array([5, 6, 7, 8, SEP, 5, 6, 7, 9, 4, SEP, 1, 7, SEP], dtype=np.int64)
    assert key_positions(tokens, SEP).tolist() == [0, 1, 2, 5, 6, 7, 8, 11]
    cfg = DenseConfig(top_k=8, max_candidates=3, max_length=4)
    positions = np.array([1, 6, 11, 0, 5, -1])
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, -1.0])
    res = drafts_from_hits(tokens, SEP, positions, scores, 7, cfg, np.array([0, 5, 11]), shard=2)
    # p=1 → next 7, draft [8]; p=6 → next 7, draft [9, 4]; p=11 → next 7, nothing after it; p=0, 5 → next 6
    assert [c.tokens for c in res.candidates] == [(8,), (9, 4)]
    assert [c.score for c in res.candidates] == pytest.approx([0.9, 0.8])
    assert res.candidates[1].source is not None and res.candidates[1].source.document == 1
    assert res.candidates[1].source.offset == 3 and res.candidates[1].source.shard == 2
    assert (res.searched, res.matched) == (5, 3)
    assert drafts_from_hits(tokens, SEP, positions, scores, 42, cfg).candidates == ()


def test_equal_drafts_merge_and_shards_merge_by_score() -> None:
    tokens = np.array([1, 2, 3, SEP, 1, 2, 3, SEP, 1, 2, 4, SEP], dtype=np.int64)
    cfg = DenseConfig(top_k=8, max_candidates=2, max_length=3)
    res = drafts_from_hits(tokens, SEP, np.array([4, 0, 8]), np.array([0.9, 0.8, 0.7]), 2, cfg)
    assert [(c.tokens, c.count) for c in res.candidates] == [((3,), 2), ((4,), 1)]
    other = drafts_from_hits(tokens, SEP, np.array([8]), np.array([0.95]), 2, cfg)
    merged = merge_dense([res, other], 2)
    assert [(c.tokens, c.count, c.score) for c in merged.candidates] == [
        ((4,), 2, pytest.approx(0.95)),
        ((3,), 2, pytest.approx(0.9)),
    ]


def test_dense_retrieval_equals_a_brute_force_scan() -> None:
    rng = np.random.default_rng(4)
    vocab = 6  # few tokens: many keys share the next token
    docs = [rng.integers(0, vocab, size=int(rng.integers(5, 40))) for _ in range(60)]
    tokens = np.concatenate([np.append(d, SEP) for d in docs])
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])[:-1]])
    pos = key_positions(tokens, SEP)
    keys = fit_stats(hidden_like(len(pos), 24), 12).project(hidden_like(len(pos), 24))
    dense = DenseIndex(build_faiss_index(keys, "flat"), pos)
    stored = dense.keys()  # float16-rounded: what the index compares against
    cfg = DenseConfig(top_k=40, max_candidates=5, max_length=6)
    for trial in range(30):
        query = keys[rng.integers(len(keys))] + rng.normal(size=12).astype(np.float32) * 0.3
        query /= np.linalg.norm(query)
        nxt = int(rng.integers(vocab))
        got = dense_retrieve(dense, tokens, SEP, query, nxt, cfg, starts)
        scores = stored @ query
        order = np.argsort(-scores, kind="stable")[: cfg.top_k]
        best: dict[tuple[int, ...], float] = {}
        for row in order:
            p = int(pos[row])
            if tokens[p + 1] != nxt:
                continue
            draft = []
            for t in tokens[p + 2 : p + 2 + cfg.max_length]:
                if t >= SEP:
                    break
                draft.append(int(t))
            if draft and tuple(draft) not in best:
                best[tuple(draft)] = float(scores[row])
        expected = sorted(best.items(), key=lambda kv: -kv[1])[: cfg.max_candidates]
        assert [c.tokens for c in got.candidates] == [d for d, _ in expected], trial
        assert [c.score for c in got.candidates] == pytest.approx([s for _, s in expected], abs=1e-4)


# -- versions on disk ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple:
    model = tiny_model("llama", vocab=VOCAB, seed=0)
    return model, wrap_model(model, None, ModelConfig(backend="fast"))


def test_batched_windows_compute_the_states_of_one_pass(tiny, tmp_path: Path) -> None:
    """A document within one window (padded in a batch with a shorter one) gets the states of a
    plain forward; a longer one is cut into windows that start after ``overlap`` tokens of context."""
    import torch

    model, _ = tiny
    doc = np.arange(60, dtype=np.int64) % (VOCAB - 1)
    with torch.inference_mode():
        ref = model.base_model(input_ids=torch.from_numpy(doc)[None]).last_hidden_state[0].numpy()
    whole = HiddenStates(
        ModelEncoder(model), "fp", DenseBuildConfig(window=80, overlap=8, batch=2, cache_dir=tmp_path)
    )
    got = whole.compute([doc, doc[:10]])
    assert np.allclose(got[:60], ref, atol=2e-2) and np.allclose(got[60:], ref[:10], atol=2e-2)
    cut = HiddenStates(
        ModelEncoder(model), "fp", DenseBuildConfig(window=32, overlap=8, batch=3, cache_dir=tmp_path)
    )
    windows = cut.compute([doc]).astype(np.float32)
    assert np.allclose(windows[:24], ref[:24], atol=2e-2)  # the first window saw the same context
    with torch.inference_mode():  # the second: tokens 24..47 after 8 tokens of context (16..23)
        second = model.base_model(input_ids=torch.from_numpy(doc[16:48])[None]).last_hidden_state[0].numpy()
    assert np.allclose(windows[24:48], second[8:], atol=2e-2)


def test_dense_version_builds_reuses_cached_states_and_rebuilds_other_dims(tiny, tmp_path: Path) -> None:
    model, target = tiny
    docs = own_continuations(target)
    v1 = dense_version(model, target, tmp_path / "v1", docs)
    dense = v1.manifest["dense"]
    assert dense["keys"] == sum(len(d) - 1 for d in docs) and dense["dims"] == 16
    assert dense["model_fingerprint"] == target.info.weights_id and dense["index"] == "flat"
    assert dense["chunks"]["computed"] > 0 and v1.dense_stats is not None
    for shard in v1.manifest["shards"]:
        assert {"dense.faiss", "positions.npy"} <= set(shard["files"])
    for shard in v1.shards:  # every token but each document's last has a key
        assert shard.dense is not None
        assert shard.dense.positions.tolist() == key_positions(shard.tokens, shard.separator).tolist()
    # another PCA size and index type: a derived version, no hidden state computed again
    cfg = DenseBuildConfig(
        dims=8, index="hnsw", window=32, overlap=8, chunk_tokens=120, cache_dir=tmp_path / "hidden"
    )
    derive_version(
        tmp_path / "v1",
        tmp_path / "v2",
        dense_step(ModelEncoder(model), "tiny", target.info.weights_id, cfg, False),
    )
    v2 = DatastoreVersion(tmp_path / "v2")
    assert v2.manifest["dense"]["chunks"]["computed"] == 0 and v2.manifest["dense"]["dims"] == 8
    assert v2.manifest["dense"]["index"] == "hnsw" and v2.manifest["build"]["derived_from"] == "v1"
    assert v2.tokens == v1.tokens
    # interrupted builds leave nothing behind
    with pytest.raises(ValueError, match="overlap"):
        dense_version(model, target, tmp_path / "v3", docs, overlap=40)
    assert not (tmp_path / "v3").exists() and not list(tmp_path.glob(".v3.tmp-*"))


def test_corrupt_dense_parts_are_refused(tiny, tmp_path: Path) -> None:
    model, target = tiny
    dense_version(model, target, tmp_path / "v", own_continuations(target, 2), shards=1)
    for name, damage in [("dense.faiss", b"garbage"), ("positions.npy", None)]:
        bad = tmp_path / f"bad-{name}"
        shutil.copytree(tmp_path / "v", bad)
        file = bad / "shard-0000" / name
        data = bytearray(file.read_bytes())
        data[-8:] = b"\xff" * 8
        file.write_bytes(damage if damage is not None else bytes(data))
        with pytest.raises(DatastoreError, match=f"{name}.*(bytes|checksum)"):
            DatastoreVersion(bad)
    bad = tmp_path / "bad-stats"
    shutil.copytree(tmp_path / "v", bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["dense"]["stats"]["sha256"] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match="checksum"):
        DatastoreVersion(bad)


def test_dresd_needs_a_dense_index_of_this_model(tiny, tmp_path: Path) -> None:
    model, target = tiny
    docs = own_continuations(target, 2)
    write_version(docs, tmp_path / "sparse", VOCAB, tiny_identity(VOCAB))
    sparse = DraftResources(LocalRetriever(DatastoreVersion(tmp_path / "sparse")))
    with pytest.raises(ModeUnavailableError, match="no dense index"):
        DRAFTERS.create("dresd", target, sparse)
    assert "rest" in DRAFTERS.available(target, sparse) and "dresd" not in DRAFTERS.available(target, sparse)
    other = wrap_model(tiny_model("llama", vocab=VOCAB, seed=9), None, ModelConfig(backend="fast"))
    dense = DraftResources(LocalRetriever(dense_version(model, target, tmp_path / "v", docs)))
    with pytest.raises(ModeUnavailableError, match="another model"):
        DRAFTERS.create("dresd", other, dense)
    assert {"dresd", "dresd-batch"} <= set(DRAFTERS.available(target, dense))


# -- dresd against ar ---------------------------------------------------------------------------

DRESD_MODES = ["dresd", "dresd:d=5:l=4:k=16", "dresd-batch", "dresd-batch:d=2:l=12"]


@pytest.mark.parametrize("kind,backend,curve", BACKEND_CASES, ids=BACKEND_IDS)
def test_greedy_dresd_equals_ar(kind: str, backend: str, curve: CostCurve, tmp_path: Path) -> None:
    model = tiny_model(kind, vocab=VOCAB, seed=0)
    target = wrap_model(model, None, ModelConfig(backend=backend))
    version = dense_version(model, target, tmp_path / "v", own_continuations(target))
    engine = datastore_engine(target, LocalRetriever(version), curve)
    tally = DraftTally()
    for prompt in prompts(VOCAB):
        ref = engine.generate(GenerationRequest(tuple(prompt), 40, "ar", stop_at_eos=False)).token_ids
        for mode in DRESD_MODES:
            res = engine.generate(GenerationRequest(tuple(prompt), 40, mode, stop_at_eos=False))
            assert res.token_ids == ref, f"{kind}/{backend}/{mode}: differs from ar on {prompt}"
            assert res.datastore_version == "v"
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(f"{kind}/{backend}")


def test_dresd_on_inverted_lists_searches_compiled_and_equals_ar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An IVF index is searched by the compiled library (``native.dense_candidates``); greedy
    output stays ``ar``'s, and so does the sampled distribution (checked in the next test on the
    same kind of index)."""
    from datastore_svc import native

    if native.library() is None:
        pytest.skip("the compiled retrieval could not be built here")
    model = tiny_model("llama", vocab=VOCAB, seed=0)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    version = dense_version(
        model, target, tmp_path / "v", own_continuations(target), index="ivf", params=IndexParams(ivf_lists=4)
    )
    assert version._dense_native() is not None
    calls = []
    search = native.dense_candidates
    monkeypatch.setattr(native, "dense_candidates", lambda *a: calls.append(1) or search(*a))
    engine = datastore_engine(target, LocalRetriever(version))
    tally = DraftTally()
    for prompt in prompts(VOCAB):
        ref = engine.generate(GenerationRequest(tuple(prompt), 40, "ar", stop_at_eos=False)).token_ids
        for mode in ("dresd", "dresd-batch:d=2:l=12"):
            res = engine.generate(GenerationRequest(tuple(prompt), 40, mode, stop_at_eos=False))
            assert res.token_ids == ref, f"{mode}: differs from ar on {prompt}"
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("ivf")
    assert len(calls) > 20  # the compiled search answered, not FAISS


@pytest.mark.parametrize(
    "mode,params",
    [
        ("dresd", SamplingParams(temperature=1.3)),
        ("dresd-batch:d=4", SamplingParams(temperature=0.8, top_k=5, top_p=0.9)),
    ],
    ids=["dresd-t1.3", "batch-t0.8-k5-p0.9"],
)
def test_sampling_dresd_matches_exact_distribution(mode: str, params: SamplingParams, tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    docs = own_samples(target, prompt, params)  # drafts often right, siblings common
    # inverted lists: the compiled search (flat indexes: the greedy tests)
    version = dense_version(
        model, target, tmp_path / "v", docs, shards=1, index="ivf", params=IndexParams(ivf_lists=4)
    )
    engine = datastore_engine(target, LocalRetriever(version))
    dist = exact_distribution(model, prompt, params)
    counts, drafted, accepted = sample_counts(engine, prompt, mode, params)
    p = chi_square_p(counts, dist, SAMPLES)
    assert p > 1e-3, f"{mode}: sampled continuations do not follow the target distribution (p = {p:.2g})"
    assert drafted > SAMPLES // 4, f"{mode} hardly drafted ({drafted}); the test would prove nothing"
    assert accepted > 0, f"{mode}: no draft was ever accepted; the test would prove nothing"


# -- intrinsic evaluation -----------------------------------------------------------------------


def test_reciprocal_ranks_and_relevance() -> None:
    from client.bench.dense_eval import reciprocal_ranks, relevance

    rel = np.array([[False, True, True], [False, False, False], [True, False, False]])
    assert reciprocal_ranks(rel).tolist() == [0.5, 0.0, 1.0]
    tokens = np.array([5, 6, 7, SEP, 5, 6, 8, SEP], dtype=np.int64)
    positions = np.array([[0, 4, -1], [1, 5, 2]])
    truth = np.array([[6, 7], [7, SEP]])  # the second: a key never stores the separator
    assert relevance(tokens, SEP, positions, truth).tolist() == [[True, False, False], [False, False, False]]
    assert relevance(tokens, SEP, positions, truth[:, :1]).tolist() == [
        [True, True, False],
        [True, False, False],
    ]


def test_eval_finds_the_keys_of_seen_text(tiny, tmp_path: Path) -> None:
    """Positions of text the datastore holds retrieve their own key first (MRR 1 for the next token
    at k=1 when the states are identical), and the flat index recalls exact search fully."""
    from client.bench.dense_eval import evaluate

    model, target = tiny
    docs = own_continuations(target, 3)
    version = dense_version(model, target, tmp_path / "v", docs, shards=2)
    states = HiddenStates(
        ModelEncoder(model),
        target.info.weights_id,
        DenseBuildConfig(window=32, overlap=8, cache_dir=tmp_path / "hidden"),
    )
    hidden = [states.chunk([np.asarray(d, dtype=np.int64)])[0] for d in docs]
    report = evaluate(version, hidden, docs, ks=(1, 8), n=2, count=200)
    assert report.queries == 200
    assert report.mrr["1"][1] > 0.9 and report.hit["2"][8] > 0.9
    assert report.recall[8] == pytest.approx(1.0)


def test_a_gpu_index_without_faiss_gpu_is_a_clear_error(tiny, tmp_path: Path) -> None:
    from datastore_svc.dense import faiss_gpus

    if faiss_gpus() > 0:
        pytest.skip("this machine has a FAISS GPU")
    model, target = tiny
    dense_version(model, target, tmp_path / "v", own_continuations(target, 1), shards=1)
    with pytest.raises(DatastoreError, match="faiss-gpu"):
        DatastoreVersion(tmp_path / "v", faiss_gpu=0)


def test_spread_documents_keeps_every_kth() -> None:
    docs = [(100 * i, np.zeros(100, np.int64)) for i in range(10)]
    assert [s for s, _ in spread_documents(docs, 300)] == [0, 400, 800]
    assert spread_documents(docs, 0) == docs and spread_documents(docs, 5000) == docs


def test_dense_keys_for_a_subsample_of_documents(tiny, tmp_path: Path) -> None:
    """``max_tokens``: keys for documents spread over each shard, the sparse arrays keep all."""
    model, target = tiny
    docs = own_continuations(target)
    whole = sum(len(d) for d in docs)
    v1 = dense_version(model, target, tmp_path / "v1", docs, max_tokens=whole // 3)
    dense = v1.manifest["dense"]
    assert dense["max_tokens"] == whole // 3
    assert 0 < dense["keys"] < whole // 2  # about a third: every k-th document
    assert sum(len(shard.tokens) for shard in v1.shards) >= whole  # the sparse part keeps all
    for shard in v1.shards:  # the keys are whole documents' (each but its last token)
        assert shard.dense is not None
        every = set(key_positions(shard.tokens, shard.separator).tolist())
        kept = shard.dense.positions.tolist()
        assert set(kept) <= every and len(kept) < len(every)
    # a dense rebuild (--from) keys the same documents unless told otherwise
    from argparse import Namespace

    from client.cli.datastore import _dense_tokens

    assert _dense_tokens(Namespace(dense_tokens=0, source=str(tmp_path / "v1"))) == whole // 3
    assert _dense_tokens(Namespace(dense_tokens=7, source=str(tmp_path / "v1"))) == 7
    assert _dense_tokens(Namespace(dense_tokens=0, source=None)) == 0
