"""The compiled retrieval (datastore_svc/native.py, csrc/retrieval.c) against the steps it
replaces: sparse against the numpy steps (datastore_svc/retrieval.py, themselves checked against
brute force in test_retrieval.py): the same candidates, counts, match, sampling and sources, for
one shard, several merged, and the context; dense against FAISS and ``drafts_from_hits`` /
``merge_dense`` (datastore_svc/dense.py); and the fallback where it cannot be built."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore_svc import native
from datastore_svc.dense import DenseConfig, DenseError, DenseIndex, IndexParams, build_faiss_index
from datastore_svc.retrieval import RetrievalConfig, context_retrieval, retrieve
from datastore_svc.store import DatastoreVersion, Shard
from datastore_svc.suffix import SuffixIndex

T = TypeVar("T")

pytestmark = pytest.mark.skipif(
    native.library() is None, reason="the compiled retrieval could not be built here"
)


Both = Callable[..., tuple[object, object]]


@pytest.fixture
def both() -> Iterator[Both]:
    """``both(f, *args)``: f's answer compiled, and with the compiled retrieval turned off (the
    numpy steps)."""
    lib = native.library()

    def run(f: Callable[..., T], *args: object) -> tuple[T, T]:
        compiled = f(*args)
        native._state["lib"] = None
        try:
            return compiled, f(*args)
        finally:
            native._state["lib"] = lib

    yield run
    native._state["lib"] = lib


def corpus(rng: np.random.Generator, vocab: int, docs: int) -> np.ndarray:
    parts = []
    for _ in range(docs):
        parts += [rng.integers(0, vocab, size=int(rng.integers(1, 50))), [vocab]]
    return np.concatenate(parts).astype(np.int32)


def document_starts(tokens: np.ndarray, separator: int) -> np.ndarray:
    return np.flatnonzero(np.r_[True, tokens[:-1] == separator]).astype(np.int64)


def random_config(rng: np.random.Generator) -> RetrievalConfig:
    return RetrievalConfig(
        c_min=int(rng.integers(1, 3)),
        c_max=int(rng.integers(3, 9)),
        max_occurrences=int(rng.integers(1, 40)),
        max_length=int(rng.integers(1, 8)),
        max_nodes=int(rng.integers(1, 30)),
        max_candidates=int(rng.integers(1, 10)),
    )


@pytest.mark.parametrize("seed", range(6))
def test_one_shard_equals_numpy(seed: int, both: Both) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(150):
        vocab = int(rng.integers(2, 8))
        tokens = corpus(rng, vocab, int(rng.integers(1, 10)))
        idx, docs, cfg = SuffixIndex.build(tokens, vocab), document_starts(tokens, vocab), random_config(rng)
        context = rng.integers(0, vocab + 1, size=int(rng.integers(1, 30)))  # the separator too, now and then

        compiled, reference = both(retrieve, idx, vocab, context, cfg, docs, 2)
        assert compiled == reference


@pytest.mark.parametrize("seed", range(6))
def test_several_shards_merge_as_numpy(seed: int, both: Both) -> None:
    """One compiled call over every shard of a version gives what merging the shards' numpy
    answers gives (``retrieval.merge``), sources included."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(100):
        vocab = int(rng.integers(2, 8))
        shards = []
        for position in range(int(rng.integers(1, 4))):
            tokens = corpus(rng, vocab, int(rng.integers(1, 8)))
            shards.append(
                Shard(position + 3, SuffixIndex.build(tokens, vocab), document_starts(tokens, vocab), vocab)
            )
        version = DatastoreVersion.__new__(DatastoreVersion)
        version.shards, version._table, version._docs = shards, None, []
        cfg = random_config(rng)
        context = rng.integers(0, vocab, size=int(rng.integers(1, 30)))

        compiled, reference = both(version.retrieve, context, cfg)
        assert compiled == reference


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=80),
    st.integers(1, 3),
    st.integers(1, 8),
    st.integers(1, 30),
    st.integers(1, 6),
    st.integers(1, 20),
)
def test_context_retrieval_equals_numpy(
    context: list[int], c_min: int, c_max: int, n: int, length: int, nodes: int
) -> None:
    cfg = RetrievalConfig(
        c_min=min(c_min, c_max),
        c_max=c_max,
        max_occurrences=n,
        max_length=length,
        max_nodes=nodes,
        max_candidates=5,
    )
    tokens = np.array(context, dtype=np.int64)
    compiled = context_retrieval(tokens, 5, cfg)
    lib = native.library()
    native._state["lib"] = None
    try:
        assert compiled == context_retrieval(tokens, 5, cfg)
    finally:
        native._state["lib"] = lib


def test_real_tokens_with_the_default_shape(both: Both) -> None:
    """A 49 152-token vocabulary (2-byte tokens, the first-token table) and REST's own shape."""
    rng = np.random.default_rng(3)
    vocab = 49_152
    words = rng.integers(0, vocab, size=300)
    tokens = np.concatenate(
        [np.append(words[rng.integers(0, 300, size=int(rng.integers(5, 80)))], vocab) for _ in range(400)]
    ).astype(np.int32)
    idx, docs = SuffixIndex.build(tokens, vocab), document_starts(tokens, vocab)
    for cfg in (RetrievalConfig(), RetrievalConfig(max_nodes=8, max_candidates=4)):
        for start in rng.integers(0, len(tokens) - 20, size=60):
            context = tokens[start : start + int(rng.integers(1, 20))].astype(np.int64)

            compiled, reference = both(retrieve, idx, vocab, context, cfg, docs, 0)
            assert compiled == reference
            compiled, reference = both(context_retrieval, context, vocab, cfg)
            assert compiled == reference


def test_first_token_table_is_each_tokens_range_of_the_suffix_array() -> None:
    tokens = np.array([5, 6, 5, 7, 8, 2, 5, 8], dtype=np.int32)  # 8: the separator
    idx = SuffixIndex.build(tokens, 8)
    starts = idx.first_token_starts(8)
    first = tokens[idx.positions(np.arange(len(tokens)))]
    for t in range(8):
        assert (first[starts[t] : starts[t + 1]] == t).all()
        assert starts[t + 1] - starts[t] == int((tokens == t).sum())
    assert idx.native_row(8)[5] != 0  # the table is passed
    assert idx.native_row(2**21)[5] == 0  # too large a vocabulary: no table, whole-array search


def test_shapes_beyond_the_compiled_bounds_run_in_numpy(
    both: Both,
) -> None:
    """A shard server may be asked for up to 1 024 context tokens or 256-token continuations."""
    rng = np.random.default_rng(5)
    tokens = corpus(rng, 3, 20)
    idx = SuffixIndex.build(tokens, 3)
    context = rng.integers(0, 3, size=200)
    for cfg in (RetrievalConfig(c_max=100), RetrievalConfig(max_length=200, max_occurrences=100)):
        assert not native.fits((cfg.c_min, cfg.c_max, cfg.max_occurrences, cfg.max_length, 1, 1))

        compiled, reference = both(retrieve, idx, 3, context, cfg)
        assert compiled == reference
        compiled, reference = both(context_retrieval, context, 3, cfg)
        assert compiled == reference


def test_turned_off_or_without_a_compiler_retrieval_runs_in_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPECDRAFT_NATIVE_DIR", str(tmp_path / "native"))
    monkeypatch.setenv("SPECDRAFT_NATIVE", "0")
    assert native._load() is None
    monkeypatch.setenv("SPECDRAFT_NATIVE", "1")
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert native._load() is None
    assert "no C compiler" in caplog.text
    assert not list((tmp_path / "native").rglob("*.so"))


def test_a_failed_build_leaves_no_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails (here: one that rejects every file) writes nothing a later process
    would load; a working one then builds it whole."""
    monkeypatch.setenv("SPECDRAFT_NATIVE_DIR", str(tmp_path / "native"))
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'error: simulated' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert native._load() is None
    assert not [p for p in (tmp_path / "native").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    monkeypatch.delenv("CC")
    lib = native._load()
    assert lib is not None and (tmp_path / "native" / native.build_name() / "libretrieval.so").is_file()


def test_describe_says_whether_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDRAFT_NATIVE_DIR", str(tmp_path))
    assert native.describe() == "yes (compiled on first use, about a second)"
    monkeypatch.setenv("CC", "no-such-compiler")
    assert native.describe().startswith("no: no C compiler")
    monkeypatch.setenv("SPECDRAFT_NATIVE", "0")
    assert native.describe().startswith("no: turned off")


def dense_version(
    rng: np.random.Generator, dims: int, kind: str = "ivf", residual: bool = True, wide: bool = False
) -> DatastoreVersion:
    """A version of 1-3 shards over a 5-token vocabulary (many keys share a next token), each with
    a FAISS index of random unit keys, read back as a worker loads it. ``residual=False``: keys
    stored as they are, not as their distance to a centroid, a tenth of their components 1e-6
    (half-precision subnormals); ``wide``: 8-byte key positions."""
    import faiss

    vocab, shards = 5, []
    for position in range(int(rng.integers(1, 4))):
        tokens = corpus(rng, vocab, int(rng.integers(30, 80)))
        keyed = np.flatnonzero((tokens[:-1] < vocab) & (np.r_[tokens[1:-1], vocab] < vocab))
        keys = rng.normal(size=(len(keyed), dims)).astype(np.float32)
        keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        params = IndexParams(ivf_lists=int(rng.integers(1, 12)), ivf_probe=int(rng.integers(1, 6)))
        if residual or kind != "ivf":
            built = build_faiss_index(keys, kind, params)
        else:
            keys[rng.random(keys.shape) < 0.1] = 1e-6
            fp16, ip = faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT
            built = faiss.IndexIVFScalarQuantizer(
                faiss.IndexFlatIP(dims), dims, params.ivf_lists, fp16, ip, False
            )
            built.train(keys)
            built.add(keys)
        index = faiss.deserialize_index(faiss.serialize_index(built))
        shard = Shard(position + 2, SuffixIndex.build(tokens, vocab), document_starts(tokens, vocab), vocab)
        shard.dense = DenseIndex(index, keyed.astype(np.int64 if wide else np.int32), params)
        shards.append(shard)
    version = DatastoreVersion.__new__(DatastoreVersion)
    version.shards, version._table, version._docs = shards, None, []
    version._dense_table, version._dense_asked = None, False
    return version


def well_separated(version: DatastoreVersion, query: np.ndarray, k: int) -> bool:
    """Whether FAISS's choice for ``query`` is unambiguous: no two of the scores that decide it
    (the probed lists', the kept keys') within rounding of each other, so any correct search
    keeps the same keys in the same order."""
    import faiss

    for shard in version.shards:
        assert shard.dense is not None
        ivf = faiss.extract_index_ivf(shard.dense.index)
        lists, _ = ivf.quantizer.search(query[None], min(ivf.nprobe + 1, ivf.nlist))
        keys, _ = shard.dense.index.search(query[None], k + 1)
        for scores in (lists[0], keys[0][keys[0] > -1e30]):
            if len(scores) > 1 and np.min(np.abs(np.diff(scores))) < 1e-4:
                return False
    return True


@pytest.mark.parametrize(
    "seed,residual,wide,simd",
    [(0, True, False, True), (1, True, True, True), (2, False, False, True), (3, False, True, False)],
    ids=["residual", "wide-positions", "subnormal-keys", "plain-c"],
)
def test_dense_search_equals_faiss_and_the_python_drafts(
    seed: int, residual: bool, wide: bool, simd: bool, both: Both
) -> None:
    """One compiled call over every shard's inverted lists gives what FAISS's search per shard,
    ``drafts_from_hits`` and ``merge_dense`` give: drafts, counts, sources, searched and matched
    keys, scores to rounding. Keys stored as residuals or as they are (then with half-precision
    subnormal components), 4- or 8-byte positions, dimensions not a multiple of 8 (the vectorised
    loop's tail), and the plain C dot products."""
    rng = np.random.default_rng(200 + seed)
    compared = 0
    native.dense_simd(simd)
    try:
        compared = compare_dense(rng, residual, wide, both)
    finally:
        native.dense_simd(True)
    assert compared > 100  # most queries are unambiguous


def compare_dense(rng: np.random.Generator, residual: bool, wide: bool, both: Both) -> int:
    compared = 0
    for _ in range(12):
        dims = int(rng.choice([8, 12, 64]))
        version = dense_version(rng, dims, residual=residual, wide=wide)
        assert version._dense_native() is not None
        for _ in range(25):
            query = rng.normal(size=dims).astype(np.float32)
            query /= np.linalg.norm(query)
            cfg = DenseConfig(int(rng.integers(1, 40)), int(rng.integers(1, 6)), int(rng.integers(1, 9)))
            if not well_separated(version, query, cfg.top_k):
                continue
            compiled, reference = both(version.retrieve_dense, query, int(rng.integers(0, 5)), cfg)
            assert (compiled.searched, compiled.matched) == (reference.searched, reference.matched)
            assert [(c.tokens, c.count, c.source) for c in compiled.candidates] == [
                (c.tokens, c.count, c.source) for c in reference.candidates
            ]
            assert [c.score for c in compiled.candidates] == pytest.approx(
                [c.score for c in reference.candidates], abs=1e-5
            )
            compared += 1
    return compared


def test_dense_indexes_it_cannot_search_run_in_faiss(both: Both) -> None:
    """Flat and HNSW indexes (and shapes beyond its bounds) are searched by FAISS, as before."""
    rng = np.random.default_rng(9)
    for kind in ("flat", "hnsw"):
        version = dense_version(rng, 8, kind)
        assert version._dense_native() is None
        query = np.full(8, 8**-0.5, dtype=np.float32)
        compiled, reference = both(version.retrieve_dense, query, 1, DenseConfig(16, 3, 4))
        assert compiled == reference
    assert not native.dense_fits(5000, 3, 10) and not native.dense_fits(64, 3, 200)
    with pytest.raises(DenseError, match="query of 7 dimensions; this index has 8"):
        dense_version(rng, 8).retrieve_dense(np.ones(7, dtype=np.float32), 1, DenseConfig())
    assert native.dense_fits(64, 3, 10)
