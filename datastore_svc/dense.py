"""Dense retrieval (DReSD) as pure functions: hidden state → query → nearest keys → drafts.

A key is the target model's last hidden state (after the final norm, before the LM head) at a
corpus position p, reduced: z-score with the corpus statistics, project with PCA to ``dims``
dimensions, L2-normalise. Its value is p itself — the drafts are read from the shard's token
array, so no token sequence is stored twice: the hidden state at p predicted ``tokens[p + 1]``,
and the draft after it is ``tokens[p + 2 : p + 2 + L]``.

At decode time the worker reduces the hidden state of its last verified token the same way
(``DenseStats.project``) and sends it with the verified next token; the shard searches the
``top_k`` nearest keys by inner product, keeps those whose stored next token is that token, and
returns up to D distinct drafts of up to L tokens, best score first (``dense_retrieve``). No
match means no drafts: nothing is guessed.

Example: tokens [5, 6, 7, 8, SEP], keys at p = 0, 1, 2, 3 (p = 3 has no next token inside its
document, so it gets no key); a query nearest to p = 1 with next token 7 drafts [8].
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import io
import math
import threading
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore_svc.manifest import DenseStatsEntry
from datastore_svc.native import RawDense
from datastore_svc.suffix import NATIVE_ROWS_LOCK

INDEX_KINDS = ("auto", "flat", "hnsw", "ivf", "ivfpq")
FLAT_MAX_KEYS = 50_000
"""``auto`` searches exactly up to this many keys per shard, approximately (IVF) above. Exact
search reads every key for every query: 2 shards of 200k keys took 1.74 ms p50 in process, a
quarter of the default model's 7 ms step on a 2-core EPYC (IVF: 0.14 ms at recall@8 0.97); at
50k keys a shard it costs a quarter of that, and IVF still has about 56 keys a list to train on."""


class DenseError(ValueError):
    """Dense statistics or an index that cannot be used."""


NPY_HEADERS = threading.Lock()
"""Held while ``np.load`` parses headers: it uses ``ast.literal_eval``, and CPython 3.11's AST
constructor keeps its recursion depth in state shared by threads, so two loads at once (two
shards of one process loading a version, statistics read beside a load) could fail with a
spurious "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905).
Headers are small: nothing waits long."""

STATS_ARRAYS = ("mean", "std", "components", "offset")
MAX_STATS_BYTES = 32 << 20
"""The most bytes dense statistics may take, packed and unpacked (a hidden size of 8 192 with 1 024
PCA dimensions in float32). Statistics come from Redis, a shard or a manifest, none trusted: a
value over it is refused before anything is decompressed."""


# -- statistics: z-score, PCA, L2 ---------------------------------------------------------------


@dataclass(frozen=True)
class DenseStats:
    """What turns a hidden state into a query: ``normalise(pca(zscore(h)))``.

    ``components`` [dims, hidden] and ``offset`` [dims] are FAISS's PCA transform (y = A z + b,
    b = -A · mean(z)); ``mean`` / ``std`` [hidden] are the z-score statistics of the corpus.
    """

    mean: np.ndarray
    std: np.ndarray
    components: np.ndarray
    offset: np.ndarray

    @property
    def hidden_size(self) -> int:
        return int(self.mean.shape[0])

    @property
    def dims(self) -> int:
        return int(self.components.shape[0])

    def project(self, hidden: np.ndarray) -> np.ndarray:
        """[n, hidden] (or [hidden]) → [n, dims] (or [dims]) unit-norm float32 queries."""
        h = np.asarray(hidden, dtype=np.float32)
        if h.shape[-1] != self.hidden_size:
            raise DenseError(
                f"hidden state of size {h.shape[-1]}; these statistics expect {self.hidden_size}"
            )
        weight, bias = self._folded()
        y = h @ weight + bias
        if y.ndim == 1:  # one query (a decode step): few numpy calls, each costly between forwards
            return (y / max(math.sqrt(float(y @ y)), 1e-12)).astype(np.float32, copy=False)
        norm = np.linalg.norm(y, axis=-1, keepdims=True)
        return (y / np.maximum(norm, 1e-12)).astype(np.float32)

    def _folded(self) -> tuple[np.ndarray, np.ndarray]:
        """The z-score folded into the projection, once: y = h · W + b with W = (A / std)ᵀ
        [hidden, dims] and b = offset − A · (mean / std) [dims], in float32."""
        folded = self.__dict__.get("_weight_bias")
        if folded is None:
            scaled = np.asarray(self.components, dtype=np.float64) / np.asarray(self.std, dtype=np.float64)
            bias = np.asarray(self.offset, dtype=np.float64) - scaled @ np.asarray(
                self.mean, dtype=np.float64
            )
            folded = (np.ascontiguousarray(scaled.T, dtype=np.float32), bias.astype(np.float32))
            object.__setattr__(self, "_weight_bias", folded)
        return folded

    def to_bytes(self) -> bytes:
        """A self-describing binary form (``.npz``), for the manifest, Redis and ShardInfo."""
        buf = io.BytesIO()
        np.savez(buf, mean=self.mean, std=self.std, components=self.components, offset=self.offset)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> DenseStats:
        """Parse ``to_bytes``'s form, refusing anything else with ``DenseError`` (never another
        exception): the ``.npz`` is read member by member, each member's declared size checked
        against ``MAX_STATS_BYTES`` before it is decompressed (and decompression stops there),
        each array's header checked against its bytes before an array exists.

        Example: a 183 KiB value whose member unpacks to 183 MiB is refused without unpacking it.
        """
        arrays = read_npz(data, STATS_ARRAYS, MAX_STATS_BYTES)
        stats = cls(**{k: v.astype(np.float32) for k, v in arrays.items()})
        stats.check()
        return stats

    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    def to_manifest(self) -> DenseStatsEntry:
        data = self.to_bytes()
        return {
            "hidden_size": self.hidden_size,
            "dims": self.dims,
            "npz_base64": base64.b64encode(data).decode("ascii"),
            "sha256": hashlib.sha256(data).hexdigest(),
        }

    @classmethod
    def from_manifest(cls, entry: DenseStatsEntry) -> DenseStats:
        try:
            data = base64.b64decode(entry["npz_base64"], validate=True)
        except (KeyError, TypeError, ValueError) as exc:
            raise DenseError(f"dense statistics missing or not base64: {exc}") from None
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise DenseError("dense statistics: checksum mismatch (corrupt)")
        return cls.from_bytes(data)

    def check(self) -> None:
        if self.mean.ndim != 1 or self.components.ndim != 2 or 0 in self.components.shape:
            raise DenseError("dense statistics: inconsistent shapes")
        h, d = self.hidden_size, self.dims
        if self.std.shape != (h,) or self.components.shape != (d, h) or self.offset.shape != (d,):
            raise DenseError("dense statistics: inconsistent shapes")
        if not all(np.isfinite(a).all() for a in (self.mean, self.std, self.components, self.offset)):
            raise DenseError("dense statistics: non-finite values")
        if (self.std <= 0).any():
            raise DenseError("dense statistics: non-positive standard deviations")


def read_npz(data: bytes, names: Sequence[str], max_bytes: int) -> dict[str, np.ndarray]:
    """The float arrays ``names`` of an untrusted ``.npz`` (``np.savez``'s ``NAME.npy`` members,
    stored or compressed), in at most ``max_bytes`` packed and unpacked; any other content, a
    member missing or extra, a size over the bound or a header that does not match its data is a
    ``DenseError``. ``np.load`` is not used: it allocates what a header declares and decompresses
    what a member declares, and raises half a dozen exception types on malformed input.
    """
    if len(data) > max_bytes:
        raise DenseError(f"dense statistics of {len(data)} bytes: more than {max_bytes}")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = {info.filename: info for info in archive.infolist()}
            if sorted(members) != sorted(f"{name}.npy" for name in names):
                expected = ", ".join(f"{name}.npy" for name in names)
                raise DenseError(f"unreadable dense statistics: members other than {expected}")
            declared = sum(info.file_size for info in members.values())
            if declared > max_bytes:
                raise DenseError(f"dense statistics unpack to {declared} bytes: more than {max_bytes}")
            packed = {info.compress_type for info in members.values()}
            if not packed <= {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED}:  # lzma, bz2: unbounded steps
                raise DenseError("dense statistics: packed other than stored or deflated")
            return {name: _read_npy(_read_member(archive, members[f"{name}.npy"])) for name in names}
    except DenseError:
        raise
    except Exception as exc:  # zipfile, zlib, lzma, bz2, numpy headers: every parse error is one
        raise DenseError(f"unreadable dense statistics: {type(exc).__name__}") from None


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A member's bytes, decompressed 64 KiB at a time: ``ZipExtFile`` cuts its output at the
    declared size (checked by the caller) and checks the CRC at the end, but a single ``read()``
    would inflate a member whose declared size lies in one piece first."""
    out = bytearray()
    with archive.open(info) as member:
        while chunk := member.read(1 << 16):
            out += chunk
    return bytes(out)


def _read_npy(raw: bytes) -> np.ndarray:
    """One ``.npy`` of floats whose header's shape and dtype account for exactly its bytes."""
    fp = io.BytesIO(raw)
    with NPY_HEADERS:
        major, _ = np.lib.format.read_magic(fp)
        header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = header(fp)
    body = raw[fp.tell() :]
    if dtype.kind != "f" or dtype.itemsize not in (4, 8) or dtype.hasobject:
        raise DenseError(f"dense statistics: {dtype} arrays, not float32 or float64")
    if math.prod(shape) * dtype.itemsize != len(body):
        raise DenseError(f"dense statistics: a {shape} array in {len(body)} bytes")
    return np.frombuffer(body, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def fit_stats(sample: np.ndarray, dims: int, eps: float = 1e-6) -> DenseStats:
    """z-score statistics and a ``dims``-dimensional PCA (FAISS's ``PCAMatrix``) of ``sample`` [n, hidden]."""
    import faiss

    x = np.ascontiguousarray(sample, dtype=np.float32)
    n, hidden = x.shape
    if not 1 <= dims <= hidden:
        raise DenseError(f"PCA to {dims} dimensions: need 1 <= dims <= {hidden}")
    if n < 2:
        raise DenseError(f"PCA needs at least 2 vectors, got {n}")
    mean = x.mean(axis=0, dtype=np.float64).astype(np.float32)
    std = (x.std(axis=0, dtype=np.float64) + eps).astype(np.float32)
    z = np.ascontiguousarray((x - mean) / std)
    pca = faiss.PCAMatrix(hidden, dims)
    pca.train(z)
    components = faiss.vector_to_array(pca.A).reshape(dims, hidden).astype(np.float32)
    offset = faiss.vector_to_array(pca.b).astype(np.float32)
    stats = DenseStats(mean, std, components, offset)
    stats.check()
    return stats


# -- keys and their index ------------------------------------------------------------------------


def choose_kind(num_keys: int, requested: str = "auto") -> str:
    """The index type a shard of ``num_keys`` keys gets: ``requested`` unless it is ``auto``, which
    is exact search (``flat``) up to ``FLAT_MAX_KEYS`` keys and inverted lists (``ivf``) above.

    IVF because it was measured best above the bound (docs/measurements/2026-11-27-own-datastore.md,
    400k keys of the target's own datastore): against HNSW a third of the memory, half the
    latency and a higher recall of exact search. HNSW stays available by name.

    Example: ``choose_kind(1000)`` → ``"flat"``; ``choose_kind(50_001)`` → ``"ivf"``;
    ``choose_kind(50_001, "hnsw")`` → ``"hnsw"``.
    """
    if requested not in INDEX_KINDS:
        raise DenseError(f"index type {requested!r}: choose one of {', '.join(INDEX_KINDS)}")
    if requested != "auto":
        return requested
    return "flat" if num_keys <= FLAT_MAX_KEYS else "ivf"


@dataclass(frozen=True)
class IndexParams:
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    hnsw_ef_search: int = 128
    ivf_lists: int = 0  # 0 = about 4·sqrt(keys)
    ivf_probe: int = 16
    pq_bytes: int = 0  # ivfpq: bytes per key (0 = dims / 2)


PQ_CENTROIDS = 256
"""Centroids of each 8-bit product-quantiser codebook: an ``ivfpq`` index trains on at least as many keys."""


def ivf_lists(num_keys: int, params: IndexParams = IndexParams()) -> int:
    """The inverted lists of an IVF index over ``num_keys`` keys: ``params.ivf_lists``, or with 0
    about 4 √n but never more than n / 39 (``build_faiss_index``). Example: ``ivf_lists(200_001)``
    → 1 788; ``ivf_lists(100)`` → 2; ``ivf_lists(100, IndexParams(ivf_lists=8))`` → 8."""
    return params.ivf_lists or max(1, min(int(4 * np.sqrt(max(num_keys, 1))), num_keys // 39 or 1))


def check_index(num_keys: int, kind: str, params: IndexParams = IndexParams()) -> None:
    """Refuse (``DenseError``) an index of type ``kind`` that cannot be trained on a shard of
    ``num_keys`` keys, so that a build fails before it runs the model rather than in FAISS's
    k-means after it: IVF needs at least one key per inverted list, ``ivfpq`` also ``PQ_CENTROIDS``
    keys. A shard without keys trains nothing and passes. Example: ``check_index(120, "ivf",
    IndexParams(ivf_lists=500))`` → "ivf: 500 inverted lists need at least as many keys to train
    on, but a shard has 120 ..."."""
    if params.ivf_lists < 0 or params.pq_bytes < 0:
        raise DenseError(f"ivf_lists and pq_bytes must be >= 0 (0 = automatic), not {params}")
    if kind not in ("ivf", "ivfpq") or num_keys == 0:
        return
    lists = ivf_lists(num_keys, params)
    if lists > num_keys:
        raise DenseError(
            f"{kind}: {lists} inverted lists need at least as many keys to train on, but a shard has "
            f"{num_keys}: lower --ivf-lists (0 = about 4 sqrt(keys)) or use --index flat"
        )
    if kind == "ivfpq" and num_keys < PQ_CENTROIDS:
        raise DenseError(
            f"ivfpq: its product quantiser trains on at least {PQ_CENTROIDS} keys, but a shard has "
            f"{num_keys}: use --index ivf or flat"
        )


def build_faiss_index(keys: np.ndarray, kind: str, params: IndexParams = IndexParams()) -> Any:
    """A FAISS inner-product index over ``keys`` [n, dims] (unit-norm float32), ids = row numbers.

    ``flat``: exact search over float16 keys; ``hnsw``: HNSW graph over float16 keys; ``ivf``:
    inverted lists of float16 keys; ``ivfpq``: inverted lists of product-quantised keys. Unless
    ``params.ivf_lists`` says otherwise, IVF keeps about 4 √n lists but never more than n / 39, the
    fewest training points per centroid FAISS's k-means accepts without a warning: 200 001 keys
    (the fewest ``auto`` sends to IVF) train 1 788 lists of about 112 keys.
    """
    import faiss

    x = np.ascontiguousarray(keys, dtype=np.float32)
    n, dims = x.shape
    check_index(n, kind, params)
    ip, fp16 = faiss.METRIC_INNER_PRODUCT, faiss.ScalarQuantizer.QT_fp16
    index: Any
    if kind == "flat":
        index = faiss.IndexScalarQuantizer(dims, fp16, ip)
    elif kind == "hnsw":
        index = faiss.IndexHNSWSQ(dims, fp16, params.hnsw_m, ip)  # type: ignore[arg-type]  # stubs: the qtype enum
        index.hnsw.efConstruction = params.hnsw_ef_construction
    elif kind in ("ivf", "ivfpq"):
        lists = ivf_lists(n, params)
        quantizer = faiss.IndexFlatIP(dims)
        if kind == "ivf":
            index = faiss.IndexIVFScalarQuantizer(quantizer, dims, lists, fp16, ip)
        else:
            m = params.pq_bytes or max(1, dims // 2)
            if dims % m:
                raise DenseError(f"ivfpq: {dims} dimensions are not divisible into {m} sub-quantisers")
            index = faiss.IndexIVFPQ(quantizer, dims, lists, m, 8, ip)
    else:
        raise DenseError(f"unknown index type {kind!r}")
    if n:
        if not index.is_trained:
            index.train(x)
        index.add(x)
    tune_index(index, params)
    return index


def tune_index(index: Any, params: IndexParams = IndexParams()) -> None:
    """Search-time parameters (not stored by every index type): HNSW ef, IVF probes."""
    import faiss

    inner = faiss.downcast_index(index)
    if hasattr(inner, "hnsw"):
        inner.hnsw.efSearch = params.hnsw_ef_search
    if hasattr(inner, "nprobe"):
        inner.nprobe = params.ivf_probe


def faiss_gpus() -> int:
    """GPUs FAISS can use here (0 with faiss-cpu)."""
    import faiss

    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


def index_to_gpu(index: Any, device: int = 0) -> Any:
    """The index on a GPU (faiss-gpu installed and a GPU present), else a clear error."""
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss_gpus() == 0:
        raise DenseError("a GPU index was configured but faiss has no GPU here (install faiss-gpu)")
    return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), device, index)


def exact_search(keys: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of the k largest inner products, exactly (the reference for recall)."""
    import faiss

    index = faiss.IndexFlatIP(keys.shape[1])
    index.add(np.ascontiguousarray(keys, dtype=np.float32))
    return index.search(np.ascontiguousarray(queries, dtype=np.float32), k)


def recall_at(approx: np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each query's exact top-k rows that the approximate top-k found."""
    hits = [
        len(set(a[a >= 0].tolist()) & set(e[e >= 0].tolist())) for a, e in zip(approx, exact, strict=True)
    ]
    total = sum(int((e >= 0).sum()) for e in exact)
    return sum(hits) / max(total, 1)


# -- retrieval ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseConfig:
    top_k: int = 64
    """Keys searched (before keeping those that continue with the verified next token)."""
    max_candidates: int = 3
    """D: distinct drafts returned at most."""
    max_length: int = 10
    """L: tokens per draft at most."""

    def __post_init__(self) -> None:
        for name in ("top_k", "max_candidates", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass(frozen=True)
class DenseSource:
    shard: int
    document: int
    offset: int  # token offset in the document where the draft starts


@dataclass(frozen=True)
class DenseCandidate:
    tokens: tuple[int, ...]
    score: float  # inner product of the query and the best key with this draft
    count: int  # keys among the matches that drafted exactly these tokens
    source: DenseSource | None = None


@dataclass(frozen=True)
class DenseRetrieval:
    candidates: tuple[DenseCandidate, ...]
    searched: int  # keys returned by the search
    matched: int  # of those, keys whose next token is the verified one


NO_DENSE = DenseRetrieval((), 0, 0)


def drafts_from_hits(
    tokens: np.ndarray,
    separator: int,
    positions: np.ndarray | list[int],
    scores: np.ndarray | list[float],
    next_token: int,
    cfg: DenseConfig,
    doc_starts: np.ndarray | None = None,
    shard: int = 0,
) -> DenseRetrieval:
    """Drafts from the search hits (``positions``: key positions best first, -1 = no hit).

    A hit is read token by token in plain Python: between two target forwards each distinct
    numpy operation costs tens of microseconds however small, and the few hits whose next token
    matches are all that is read after it."""
    positions = positions.tolist() if isinstance(positions, np.ndarray) else positions
    scores = scores.tolist() if isinstance(scores, np.ndarray) else scores
    n = len(tokens)
    searched = matched = 0
    by_draft: dict[tuple[int, ...], list[Any]] = {}
    for p, s in zip(positions, scores, strict=True):
        if p < 0:
            continue
        searched += 1
        if p + 1 >= n or int(tokens[p + 1]) != next_token:
            continue
        matched += 1
        window = tokens[p + 2 : p + 2 + cfg.max_length].tolist()
        end = next((j for j, t in enumerate(window) if t >= separator), len(window))
        draft = tuple(window[:end])
        if not draft:
            continue
        entry = by_draft.get(draft)
        if entry is None:
            by_draft[draft] = [s, 1, p + 2]
        else:
            entry[1] += 1
    best = sorted(by_draft.items(), key=lambda kv: -kv[1][0])[: cfg.max_candidates]
    candidates = []
    for draft, (score, count, start) in best:
        source = dense_source(doc_starts, start, shard) if doc_starts is not None else None
        candidates.append(DenseCandidate(draft, float(score), count, source))
    return DenseRetrieval(tuple(candidates), searched, matched)


def dense_source(doc_starts: Sequence[int] | np.ndarray, start: int, shard: int) -> DenseSource | None:
    """Where a draft starting at token ``start`` of ``shard`` came from: its document (by the
    shard's ``doc_starts``) and offset in it; None without document starts."""
    if not len(doc_starts):
        return None
    doc = bisect.bisect_right(doc_starts, start) - 1
    return DenseSource(shard, doc, start - int(doc_starts[doc]))


def of_raw_dense(raw: RawDense, shards: Sequence[tuple[Sequence[int], int]]) -> DenseRetrieval:
    """The compiled dense search's answer (``native.dense_candidates``) as ``dense_retrieve`` and
    ``merge_dense`` give it; ``shards``: per shard asked, its document starts and its index."""
    candidates = []
    for tokens, count, score, start, position in zip(
        raw.tokens, raw.counts, raw.scores, raw.starts, raw.shards, strict=True
    ):
        doc_starts, shard = shards[position]
        candidates.append(DenseCandidate(tuple(tokens), score, count, dense_source(doc_starts, start, shard)))
    return DenseRetrieval(tuple(candidates), raw.searched, raw.matched)


def merge_dense(results: Sequence[DenseRetrieval], max_candidates: int) -> DenseRetrieval:
    """One result from several shards': equal drafts merge (best score, counts add), best first."""
    if len(results) == 1:
        return results[0]
    merged: dict[tuple[int, ...], DenseCandidate] = {}
    for result in results:
        for cand in result.candidates:
            seen = merged.get(cand.tokens)
            if seen is None:
                merged[cand.tokens] = cand
            else:
                best = cand if cand.score > seen.score else seen
                merged[cand.tokens] = DenseCandidate(
                    cand.tokens, best.score, seen.count + cand.count, best.source
                )
    ranked = sorted(merged.values(), key=lambda c: -c.score)[:max_candidates]
    return DenseRetrieval(tuple(ranked), sum(r.searched for r in results), sum(r.matched for r in results))


class DenseIndex:
    """One shard's dense index: FAISS index over the keys, and each key's token position."""

    def __init__(self, index: Any, positions: np.ndarray, params: IndexParams = IndexParams()) -> None:
        if index.ntotal != len(positions):
            raise DenseError(f"the index holds {index.ntotal} keys but {len(positions)} positions")
        self.index = index
        self.positions = positions
        self.dims = int(index.d)
        tune_index(index, params)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, token positions) [n, k] of the k nearest keys of each query; -1 = none."""
        q, k = self._checked(np.atleast_2d(queries), k)
        scores, rows = self.index.search(q, k)
        positions = np.where(rows >= 0, self.positions[np.maximum(rows, 0)], -1)
        return scores, positions

    def _checked(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """[n, dims] contiguous float32 queries of this index's width, and k within its keys."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.shape[1] != self.dims:
            raise DenseError(f"query of {q.shape[1]} dimensions; this index has {self.dims}")
        return q, max(1, min(k, max(int(self.index.ntotal), 1)))

    def search_one(self, query: np.ndarray, k: int) -> tuple[list[float], list[int]]:
        """``search`` for one query [dims], as lists (scores, token positions; -1 = none)."""
        q, k = self._checked(np.reshape(query, (1, -1)), k)
        scores, rows = self.index.search(q, k)
        positions = self.positions
        return scores[0].tolist(), [int(positions[r]) if r >= 0 else -1 for r in rows[0].tolist()]

    def native_row(self) -> tuple[int, ...] | None:
        """What the compiled dense search (``native.dense_candidates``) reads of this index:
        (lists, dims, residual keys, probes, centroids, list sizes, list codes, list rows,
        positions, position width, keys; arrays as addresses), or None where it cannot search it: an
        index other than inverted lists of half-precision keys by inner product in this
        process's memory (flat, HNSW, PQ, a GPU index), or one without keys.

        The addresses are FAISS's own arrays (no copy): the index is never changed once loaded,
        and this object holds it and the small arrays of addresses made here."""
        cached = self.__dict__.get("_native_row", False)
        if cached is not False:
            return cached  # type: ignore[no-any-return]
        with NATIVE_ROWS_LOCK:  # made once: the arrays of a row another thread holds stay alive
            if "_native_row" not in self.__dict__:
                self.__dict__["_native_row"] = self._make_native_row()
            return self.__dict__["_native_row"]  # type: ignore[no-any-return]

    def _make_native_row(self) -> tuple[int, ...] | None:
        import faiss

        index = faiss.downcast_index(self.index)
        if (
            not isinstance(index, faiss.IndexIVFScalarQuantizer)
            or index.sq.qtype != faiss.ScalarQuantizer.QT_fp16
            or index.metric_type != faiss.METRIC_INNER_PRODUCT
            or index.ntotal == 0
            or index.invlists is None
        ):
            return None
        lists = faiss.downcast_InvertedLists(index.invlists)
        quantizer = faiss.downcast_index(index.quantizer)
        if (
            not isinstance(lists, faiss.ArrayInvertedLists)
            or not isinstance(quantizer, faiss.IndexFlat)
            or quantizer.metric_type != faiss.METRIC_INNER_PRODUCT
        ):
            return None
        nlist, dims = int(index.nlist), int(index.d)
        sizes = np.array([lists.list_size(i) for i in range(nlist)], dtype=np.int64)
        codes = np.zeros(nlist, dtype=np.int64)
        rows = np.zeros(nlist, dtype=np.int64)
        for i in np.flatnonzero(sizes).tolist():
            codes[i] = faiss.rev_swig_ptr(lists.get_codes(i), int(sizes[i]) * dims * 2).ctypes.data
            rows[i] = faiss.rev_swig_ptr(lists.get_ids(i), int(sizes[i])).ctypes.data
        centroids = faiss.rev_swig_ptr(quantizer.get_xb(), nlist * dims)
        positions = self.positions
        if positions.dtype not in (np.int32, np.int64) or not positions.flags.c_contiguous:
            positions = np.ascontiguousarray(positions, dtype=np.int64)
        self.__dict__["_native_arrays"] = (sizes, codes, rows, centroids, positions)  # kept alive
        return (
            nlist,
            dims,
            int(bool(index.by_residual)),
            int(index.nprobe),
            int(centroids.ctypes.data),
            int(sizes.ctypes.data),
            int(codes.ctypes.data),
            int(rows.ctypes.data),
            int(positions.ctypes.data),
            int(positions.itemsize),
            len(positions),
        )

    def keys(self) -> np.ndarray:
        """[n, dims] float32: every key, decoded from the index (for exact search and recall)."""
        return self.index.reconstruct_n(0, self.index.ntotal)


def dense_retrieve(
    dense: DenseIndex,
    tokens: np.ndarray,
    separator: int,
    query: np.ndarray,
    next_token: int,
    cfg: DenseConfig,
    doc_starts: np.ndarray | None = None,
    shard: int = 0,
) -> DenseRetrieval:
    """Search ``query`` [dims], keep keys followed by ``next_token``, read the drafts after it."""
    if dense.index.ntotal == 0:
        return NO_DENSE
    scores, positions = dense.search_one(query, cfg.top_k)
    return drafts_from_hits(tokens, separator, positions, scores, next_token, cfg, doc_starts, shard)
