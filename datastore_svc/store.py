"""Datastore versions on disk: build (atomic), open (checksums verified, memory-mapped), retrieve.

A version is an immutable directory::

    VERSION/
      manifest.json          format, version name, tokenizer identity, sizes, checksums, build
      shard-0000/tokens.npy  [n] >u2 (or >u4)  documents' token ids, each followed by the separator
      shard-0000/sa.npy      [n] int32  suffix array: the sorted suffixes' byte offsets in tokens
      shard-0000/docs.npy    [documents] int64  where each document starts in tokens (token index)
      shard-0000/dense.faiss  (dense versions) FAISS index of the reduced hidden-state keys
      shard-0000/positions.npy (dense versions) [keys] token position of each key
      shard-0001/...

A dense version's manifest also holds the z-score / PCA statistics that turn the target's
hidden state into a query (``datastore_svc.dense``, built by ``datastore_svc.dense_build``).
The manifest's fields and their types: ``datastore_svc.manifest``.

A build writes everything into a hidden temporary directory beside ``VERSION``, flushes it to
disk and renames it into place last, so a crashed build never leaves a half-written version; an
existing version is never overwritten. Builds into one directory take turns (a lock file,
``BUILD_LOCK``), and each removes the temporary directories that killed builds left there.
Opening a version checks the format, that every file lies inside the version's directory (no
symlink out of it), every file's size and SHA-256, the arrays' shapes and (when asked) that the
tokenizer is the one the caller uses.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from datastore_svc import native
from datastore_svc.corpus import read_documents
from datastore_svc.dense import (
    NPY_HEADERS,
    DenseConfig,
    DenseError,
    DenseIndex,
    DenseRetrieval,
    DenseStats,
    dense_retrieve,
    index_to_gpu,
    merge_dense,
    of_raw_dense,
)
from datastore_svc.manifest import (
    BuildInfo,
    DenseEntry,
    FileEntry,
    Manifest,
    ShardEntry,
    TokenizerIdentity,
    check_manifest,
)
from datastore_svc.protocols import DenseAnswer, DenseDescription, RetrievalTimes, SparseAnswer
from datastore_svc.retrieval import Retrieval, RetrievalConfig, merge, of_raw, retrieve, shape_of
from datastore_svc.suffix import SA_LIBRARY, SuffixIndex, token_dtype
from specdraft.common import file_lock, fsync_path, fsync_tree, sha256_file, temp_sibling
from specdraft.tokenizer import Tokenizer

FORMAT = "specdraft-datastore"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
ARRAYS = ("tokens", "sa", "docs")
DENSE_FILES = ("dense.faiss", "positions.npy")
BUILD_LOCK = ".specdraft-build.lock"
"""The lock file builds into one directory take turns on (``_building``)."""

Extend = Callable[[Path, Manifest], DenseEntry]
"""The build step after the token arrays exist in the temporary directory: the dense index. It
adds its files to each shard directory and returns the manifest's ``dense`` entry."""


class DatastoreError(Exception):
    """A datastore version that cannot be used: missing, corrupt, partial or mismatched."""


def tokenizer_identity(tokenizer: Tokenizer) -> TokenizerIdentity:
    """Name, size and a fingerprint of the vocabulary (token → id) and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    digest = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()
    name = Path(str(getattr(tokenizer, "name_or_path", "") or "unknown")).name
    return {"name": name, "vocab_size": len(tokenizer), "fingerprint": digest[:16]}


def shard_dir(index: int) -> str:
    return f"shard-{index:04d}"


# -- build ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildReport:
    path: Path
    version: str
    documents: int
    tokens: int
    seconds: dict[str, float]  # tokenize, suffix_array, write
    bytes: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)


def tokenize_documents(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    batch: int = 256,
    progress: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Token ids of each document (no special tokens added; chat templates carry their own)."""
    docs: list[np.ndarray] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            for ids in tokenizer(pending, add_special_tokens=False)["input_ids"]:
                if ids:
                    docs.append(np.asarray(ids, dtype=np.int32))
            if progress is not None:
                progress(len(pending))
            pending.clear()

    for text in texts:
        pending.append(text)
        if len(pending) >= batch:
            flush()
    flush()
    return docs


def assign_shards(lengths: Sequence[int], shards: int) -> list[list[int]]:
    """Documents to shards, longest first onto the lightest shard (balanced token counts)."""
    loads = [0] * shards
    members: list[list[int]] = [[] for _ in range(shards)]
    for doc in sorted(range(len(lengths)), key=lambda d: -lengths[d]):
        s = loads.index(min(loads))
        members[s].append(doc)
        loads[s] += lengths[doc] + 1
    return [sorted(m) for m in members]


def build_suffix_index(tokens: np.ndarray, separator: int) -> SuffixIndex:
    return SuffixIndex.build(tokens, separator)


def shard_arrays(docs: Sequence[np.ndarray], separator: int) -> dict[str, np.ndarray]:
    """tokens / sa / docs of one shard (see the module docstring)."""
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    starts = np.zeros(len(docs), dtype=np.int64)
    if len(docs):
        np.cumsum(lengths[:-1], out=starts[1:])
    tokens = np.full(int(lengths.sum()), separator, dtype=np.int32)
    for start, doc in zip(starts, docs, strict=True):
        tokens[start : start + len(doc)] = doc
    index = build_suffix_index(tokens, separator)
    return {"tokens": index.tokens, "sa": index.sa, "docs": starts}


def build(
    corpus: str | Path,
    tokenizer: Tokenizer,
    out: str | Path,
    shards: int = 1,
    model_name: str = "",
    progress: bool = True,
    extend: Extend | None = None,
) -> BuildReport:
    """Build a new version at ``out`` from a JSONL corpus (see ``datastore_svc.corpus``);
    ``extend`` adds more before the version appears (``dense_build.dense_step``)."""
    from tqdm import tqdm

    out = Path(out)
    _check_new(out, shards)
    t0 = time.perf_counter()
    with tqdm(desc="tokenize", unit="doc", disable=not progress) as bar:
        docs = tokenize_documents(read_documents(corpus, tokenizer), tokenizer, progress=bar.update)
    if not docs:
        raise DatastoreError(f"{corpus}: no documents")
    tokenize_seconds = time.perf_counter() - t0
    source: BuildInfo = {"corpus": str(corpus), "corpus_sha256": sha256_file(Path(corpus))}
    report = write_version(
        docs, out, len(tokenizer), tokenizer_identity(tokenizer), shards, model_name, source, progress, extend
    )
    report.seconds["tokenize"] = tokenize_seconds
    return report


def _check_new(out: Path, shards: int) -> None:
    if shards < 1:
        raise DatastoreError("--shards must be at least 1")
    if out.exists():
        raise DatastoreError(f"{out} exists: versions are immutable, build into a new directory")


def write_version(
    docs: Sequence[np.ndarray],
    out: str | Path,
    separator: int,
    tokenizer: TokenizerIdentity,
    shards: int = 1,
    model_name: str = "",
    source: BuildInfo | None = None,
    progress: bool = False,
    extend: Extend | None = None,
) -> BuildReport:
    """Write token documents as a new version at ``out``: temporary directory, then one rename.

    ``separator`` must exceed every token id (the tokenizer's size); ``tokenizer`` is its
    identity (``tokenizer_identity``); ``extend`` adds more (the dense index) before the rename.
    """
    out = Path(out)
    _check_new(out, shards)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _building(out.parent):
        return _write_version(docs, out, separator, tokenizer, shards, model_name, source, progress, extend)


def _write_version(
    docs: Sequence[np.ndarray],
    out: Path,
    separator: int,
    tokenizer: TokenizerIdentity,
    shards: int,
    model_name: str,
    source: BuildInfo | None,
    progress: bool,
    extend: Extend | None,
) -> BuildReport:
    from tqdm import tqdm

    _check_new(out, shards)  # again, under the lock: another build may have made it meanwhile
    tmp = temp_sibling(out)
    seconds = {"suffix_array": 0.0, "write": 0.0}
    try:
        groups = assign_shards([len(d) for d in docs], shards)
        manifest_shards: list[ShardEntry] = []
        total_bytes = 0
        bar = tqdm(groups, desc="suffix arrays", unit="shard", disable=not progress)
        for index, members in enumerate(bar):
            t1 = time.perf_counter()
            arrays = shard_arrays([docs[d] for d in members], separator)
            t2 = time.perf_counter()
            sdir = tmp / shard_dir(index)
            sdir.mkdir(parents=True)
            files: dict[str, FileEntry] = {}
            for name in ARRAYS:
                path = sdir / f"{name}.npy"
                np.save(path, arrays[name])
                files[path.name] = _file_entry(path)
                total_bytes += path.stat().st_size
            seconds["write"] += time.perf_counter() - t2
            seconds["suffix_array"] += t2 - t1
            manifest_shards.append(
                {"index": index, "tokens": len(arrays["tokens"]), "documents": len(members), "files": files}
            )
        num_tokens = int(sum(len(d) for d in docs))
        manifest: Manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": out.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tokenizer": tokenizer,
            "model": model_name,
            "separator": int(separator),
            "documents": len(docs),
            "tokens": num_tokens,
            "shards": manifest_shards,
            "build": {
                **(source or {}),
                "sa_library": _library_version(),
                "seconds": {k: round(v, 3) for k, v in seconds.items()},
            },
        }
        if extend is not None:
            total_bytes += _extend(tmp, manifest, extend)
        _finish(tmp, out, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildReport(out, out.name, len(docs), num_tokens, seconds, total_bytes)


def _extend(tmp: Path, manifest: Manifest, extend: Extend) -> int:
    """Run ``extend`` on the temporary version; checksum the files it added. Returns their bytes."""
    manifest["dense"] = extend(tmp, manifest)
    added = 0
    for entry in manifest["shards"]:
        sdir = tmp / shard_dir(int(entry["index"]))
        for name in DENSE_FILES:
            path = sdir / name
            if path.exists():
                entry["files"][name] = _file_entry(path)
                added += path.stat().st_size
    return added


def _file_entry(path: Path) -> FileEntry:
    """A file's manifest entry: its size and SHA-256 (checked when a version is opened)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _finish(tmp: Path, out: Path, manifest: Manifest) -> None:
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    fsync_tree(tmp)  # on disk before the name appears: a crash never leaves empty or short files
    os.rename(tmp, out)  # the version appears whole, or not at all
    fsync_path(out.parent)


@contextmanager
def _building(parent: Path) -> Iterator[None]:
    """Hold ``parent``'s build lock for the block, after removing the hidden temporary
    directories (``.NAME.tmp-PID-RANDOM``, ``temp_sibling``) of builds that were killed there:
    a build still running would hold the lock, so any found now is a leftover."""
    with file_lock(parent / BUILD_LOCK):
        for leftover in parent.glob(".*.tmp-*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
        yield


def derive_version(source: str | Path, out: str | Path, extend: Extend) -> Path:
    """A new version at ``out`` with the token arrays of ``source`` and what ``extend`` adds.

    The arrays are hard-linked when both lie on one file system (versions are immutable, so
    sharing them is safe), copied otherwise; the source's dense files are not carried over.
    """
    source, out = Path(source).resolve(), Path(out)
    manifest = read_manifest(source)
    for entry in manifest["shards"]:  # the source must be whole before anything derives from it
        open_shard(source, manifest, int(entry["index"]), verify=True, dense=False)
    _check_new(out, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _building(out.parent):
        _check_new(out, 1)
        _derive(source, out, manifest, extend)
    return out


def _derive(source: Path, out: Path, manifest: Manifest, extend: Extend) -> None:
    tmp = temp_sibling(out)
    try:
        for entry in manifest["shards"]:
            sdir = shard_dir(int(entry["index"]))
            (tmp / sdir).mkdir(parents=True)
            for name in ARRAYS:
                src, dst = source / sdir / f"{name}.npy", tmp / sdir / f"{name}.npy"
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
            entry["files"] = {k: v for k, v in entry["files"].items() if k not in DENSE_FILES}
        manifest.pop("dense", None)
        manifest["build"] = {**manifest.get("build", {}), "derived_from": manifest["version"]}
        manifest["version"] = out.name
        manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _extend(tmp, manifest, extend)
        _finish(tmp, out, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _library_version() -> str:
    from importlib.metadata import version

    return f"{SA_LIBRARY} {version(SA_LIBRARY)}"


# -- open -------------------------------------------------------------------------------------------


def read_manifest(path: Path) -> Manifest:
    """The version's manifest, checked by type (``check_manifest``); DatastoreError names what
    is wrong."""
    file = path / MANIFEST
    if not path.is_dir():
        raise DatastoreError(f"{path} is not a datastore version directory")
    try:
        _inside(path, file)
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise DatastoreError(f"{path} has no {MANIFEST} (a partial or foreign directory)") from None
    except OSError as exc:
        raise DatastoreError(f"{file} is not a readable file ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatastoreError(f"{file} is corrupt: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatastoreError(f"{file} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DatastoreError(
            f"{file}: format version {manifest.get('format_version')} (this build reads {FORMAT_VERSION})"
        )
    problem = check_manifest(manifest)
    if problem:
        raise DatastoreError(f"{file}: {problem}")
    return cast(Manifest, manifest)  # checked by type just above


@dataclass
class Shard:
    """One shard's arrays, memory-mapped, and its dense index if the version has one."""

    index: int
    suffixes: SuffixIndex
    docs: np.ndarray  # [documents] int64
    separator: int
    dense: DenseIndex | None = None

    @property
    def tokens(self) -> np.ndarray:
        return self.suffixes.tokens

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig) -> Retrieval:
        return retrieve(self.suffixes, self.separator, context, cfg, self.docs, self.index)

    def retrieve_dense(self, query: np.ndarray, next_token: int, cfg: DenseConfig) -> DenseRetrieval:
        if self.dense is None:
            raise DatastoreError("this datastore version has no dense index (build it with --dense)")
        return dense_retrieve(
            self.dense, self.tokens, self.separator, query, next_token, cfg, self.docs, self.index
        )


def _inside(path: Path, file: Path) -> None:
    """Refuse ``file`` unless it resolves inside the version directory ``path``: a version is
    one self-contained directory, and a symlink out of it (to another version, or anywhere on
    the disk) would load what no build of this version wrote."""
    if not file.resolve().is_relative_to(path.resolve()):
        raise DatastoreError(f"{file} leads outside its version directory (a symlink); not loaded")


def _checked_file(path: Path, entry: ShardEntry, index: int, name: str, verify: bool) -> Path:
    sdir = path / shard_dir(index)
    file = sdir / name
    expected = entry.get("files", {}).get(name)
    if expected is None:
        raise DatastoreError(f"{path}: the manifest lists no {name} for shard {index}")
    if not file.exists():
        raise DatastoreError(f"{file} is missing (a partial version)")
    _inside(path, file)
    if file.stat().st_size != expected["bytes"]:
        raise DatastoreError(f"{file}: {file.stat().st_size} bytes, the manifest says {expected['bytes']}")
    if verify and sha256_file(file) != expected["sha256"]:
        raise DatastoreError(f"{file}: checksum mismatch (corrupt)")
    return file


def _load_array(file: Path) -> np.ndarray:
    try:
        # a plain ndarray view of the mapping: np.memmap's per-slice bookkeeping costs µs per access
        with NPY_HEADERS:
            return np.load(file, mmap_mode="r", allow_pickle=False).view(np.ndarray)
    except (ValueError, OSError) as exc:
        raise DatastoreError(f"{file} is not a readable array: {exc}") from None


def load_shard_arrays(path: Path, index: int) -> dict[str, np.ndarray]:
    """A shard's token arrays, memory-mapped, without checks (for build steps on a version being written)."""
    return {name: _load_array(path / shard_dir(index) / f"{name}.npy") for name in ARRAYS}


def _open_dense(path: Path, entry: ShardEntry, index: int, verify: bool, tokens: int) -> DenseIndex:
    import faiss

    index_file = _checked_file(path, entry, index, DENSE_FILES[0], verify)
    positions = _load_array(_checked_file(path, entry, index, DENSE_FILES[1], verify))
    try:
        faiss_index = faiss.read_index(str(index_file))
    except RuntimeError as exc:
        raise DatastoreError(
            f"{index_file} is not a readable FAISS index: {str(exc).splitlines()[0]}"
        ) from None
    if (
        positions.ndim != 1
        or positions.dtype.kind != "i"
        or (len(positions) and positions.max() >= tokens - 1)
    ):
        raise DatastoreError(f"{path / shard_dir(index)}: positions.npy does not fit the token array")
    try:
        return DenseIndex(faiss_index, positions)
    except DenseError as exc:
        raise DatastoreError(f"{path / shard_dir(index)}: {exc}") from None


def open_shard(path: Path, manifest: Manifest, index: int, verify: bool = True, dense: bool = True) -> Shard:
    entries = {s.get("index"): s for s in manifest["shards"] if isinstance(s, dict)}
    if index not in entries:
        raise DatastoreError(f"{path}: no shard {index} (the version has {len(entries)})")
    entry = entries[index]
    sdir = path / shard_dir(index)
    arrays = {name: _load_array(_checked_file(path, entry, index, f"{name}.npy", verify)) for name in ARRAYS}
    separator = int(manifest["separator"])
    n = int(entry.get("tokens", -1))
    tokens, sa = arrays["tokens"], arrays["sa"]
    if tokens.shape != (n,) or sa.shape != (n,):
        raise DatastoreError(f"{sdir}: array shapes disagree with the manifest")
    if tokens.dtype != token_dtype(separator) or sa.dtype != np.int32:
        raise DatastoreError(f"{sdir}: tokens must be {token_dtype(separator)} and sa int32")
    dense_index = _open_dense(path, entry, index, verify, n) if dense and "dense" in manifest else None
    return Shard(index, SuffixIndex(tokens, sa), arrays["docs"], separator, dense_index)


HUGE_PAGE_BYTES = 2 << 20
RESIDENT_MAX_BYTES = 1 << 30
"""A version whose shards' tokens and suffix arrays take at most this many bytes in all is
searched from a copy on huge pages (``resident_copy``); a larger one from its memory map."""


def huge_pages_offered() -> bool:
    """Whether the kernel backs an anonymous mapping with transparent huge pages on request."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


TABLES_LOCK = threading.Lock()
"""Held while a version makes its tables for the compiled retrieval (once each)."""


def resident_copy(array: np.ndarray) -> np.ndarray:
    """``array`` copied into an anonymous mapping that asks for transparent huge pages.

    A suffix-array search is a chain of dependent reads at random places of two arrays, and once
    a target forward has streamed its weights through the caches every read of a 4 KiB-page
    memory map also misses the TLB: after a forward, one in-process sparse retrieval took 327 µs
    from the memory-mapped files and 203 µs from huge-page copies (2-core Xeon KVM guest, 6.1 M
    tokens in 2 shards). The copy takes the arrays' size in private memory."""
    size = array.nbytes + HUGE_PAGE_BYTES
    size += -size % HUGE_PAGE_BYTES
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)
    skip = -raw.__array_interface__["data"][0] % HUGE_PAGE_BYTES  # start on a huge-page boundary
    copy = raw[skip : skip + array.nbytes].view(array.dtype)
    copy[:] = array
    copy.flags.writeable = False
    return copy


class DatastoreVersion:
    """A version opened for retrieval: all its shards (in process) or some (a shard server)."""

    def __init__(
        self,
        path: str | Path,
        shards: Iterable[int] | None = None,
        verify: bool = True,
        tokenizer_fingerprint: str | None = None,
        faiss_gpu: int | None = None,
    ) -> None:
        """``faiss_gpu``: move the dense indexes to this GPU (needs faiss-gpu; None = CPU)."""
        self.path = Path(path).resolve()
        t0 = time.perf_counter()
        self.manifest = read_manifest(self.path)
        found = self.manifest["tokenizer"].get("fingerprint")
        if tokenizer_fingerprint is not None and found != tokenizer_fingerprint:
            raise DatastoreError(
                f"{self.path} was built with another tokenizer ({self.manifest['tokenizer'].get('name')}, "
                f"fingerprint {found}; this model's is {tokenizer_fingerprint})"
            )
        indexes = list(range(self.num_shards)) if shards is None else list(shards)
        self.dense_stats: DenseStats | None = None
        if "dense" in self.manifest:
            try:
                self.dense_stats = DenseStats.from_manifest(self.manifest["dense"].get("stats", {}))
            except (DenseError, AttributeError) as exc:
                raise DatastoreError(f"{self.path / MANIFEST}: {exc}") from None
        self.shards = [open_shard(self.path, self.manifest, i, verify) for i in indexes]
        for shard in self.shards:
            if shard.dense is not None and self.dense_stats is not None:
                dims = shard.dense.index.d
                if dims != self.dense_stats.dims:
                    raise DatastoreError(
                        f"{self.path / shard_dir(shard.index)}: the dense index has {dims} dimensions, "
                        f"its statistics {self.dense_stats.dims}"
                    )
        if faiss_gpu is not None:
            for shard in self.shards:
                if shard.dense is not None:
                    try:
                        shard.dense.index = index_to_gpu(shard.dense.index, faiss_gpu)
                    except DenseError as exc:
                        raise DatastoreError(str(exc)) from None
        sparse_bytes = sum(s.suffixes.tokens.nbytes + s.suffixes.sa.nbytes for s in self.shards)
        self.resident = sparse_bytes <= RESIDENT_MAX_BYTES and huge_pages_offered()
        """Whether the shards are searched from huge-page copies (``resident_copy``)."""
        if self.resident:
            for shard in self.shards:
                shard.suffixes = SuffixIndex(
                    resident_copy(shard.suffixes.tokens), resident_copy(shard.suffixes.sa)
                )
        self._table: np.ndarray | None = None
        """[shards, 6] the shards' arrays for the compiled retrieval (``native.shard_table``)."""
        self._docs: list[tuple[list[int], int]] = []
        """Per shard, its document starts as a list and its index (``of_raw``'s sources)."""
        self._dense_table: np.ndarray | None = None
        """[shards, DENSE_ROW] the dense indexes' arrays for the compiled search (None where it
        cannot run), made on first use (``_dense_native``)."""
        self._dense_asked = False
        self._dense_dims = 0
        self.load_seconds = time.perf_counter() - t0

    @property
    def version(self) -> str:
        return str(self.manifest["version"])

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.shards)

    @property
    def dense_model(self) -> str:
        """Fingerprint of the model whose hidden states the dense keys are ("" = no dense index)."""
        return str(self.manifest.get("dense", {}).get("model_fingerprint", ""))

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig) -> Retrieval:
        """Every shard's candidates merged (``merge``); compiled in one call where the library
        loads (``native``), the same result."""
        lib = native.library()
        if lib is not None and self.shards and native.fits(shape_of(cfg)):
            if self._table is None:
                with TABLES_LOCK:
                    if self._table is None:  # the docs first: a thread that sees the table sees them
                        self._shard_docs()
                        self._table = native.shard_table([(s.suffixes, s.separator) for s in self.shards])
            raw = native.shards_candidates(lib, self._table, context, shape_of(cfg))
            return of_raw(raw, self._docs)
        results = [s.retrieve(context, cfg) for s in self.shards]
        return merge(results, cfg.max_nodes, cfg.max_candidates)

    def retrieve_dense(self, query: np.ndarray, next_token: int, cfg: DenseConfig) -> DenseRetrieval:
        """Every shard's dense drafts merged (``merge_dense``); compiled in one call where the
        library loads and every shard's index is one it searches (``DenseIndex.native_row``),
        else FAISS per shard. The two agree but for keys whose scores differ by rounding."""
        lib = native.library()
        if lib is not None and native.dense_fits(cfg.top_k, cfg.max_candidates, cfg.max_length):
            table = self._dense_native()
            if table is not None:
                if query.ndim != 1:  # one query, as FAISS's path takes it: [dims] or [1, dims]
                    query = np.reshape(query, -1)
                if len(query) != self._dense_dims:  # the library reads exactly that many
                    raise DenseError(f"query of {len(query)} dimensions; this index has {self._dense_dims}")
                raw = native.dense_candidates(
                    lib, table, query, next_token, (cfg.top_k, cfg.max_candidates, cfg.max_length)
                )
                return of_raw_dense(raw, self._shard_docs())
        results = [s.retrieve_dense(query, next_token, cfg) for s in self.shards]
        return merge_dense(results, cfg.max_candidates)

    def _shard_docs(self) -> list[tuple[list[int], int]]:
        if not self._docs:
            self._docs = [(s.docs.tolist(), s.index) for s in self.shards]
        return self._docs

    def _dense_native(self) -> np.ndarray | None:
        """[shards, DENSE_ROW] for the compiled dense search, made once (None: it cannot run)."""
        if not self._dense_asked:
            with TABLES_LOCK:
                if not self._dense_asked:
                    self._make_dense_table()
        return self._dense_table

    def _make_dense_table(self) -> None:
        rows: list[tuple[int, ...]] = []
        for shard in self.shards:
            row = shard.dense.native_row() if shard.dense is not None else None
            if row is None:
                rows = []
                break
            tokens, num_tokens, width, _, separator, _ = shard.suffixes.native_row(shard.separator)
            rows.append((*row, tokens, num_tokens, width, separator))
        if len({row[1] for row in rows}) > 1:  # shards of other widths: FAISS names the one refused
            rows = []
        self._shard_docs()  # the docs first: a thread that sees the table sees them
        self._dense_table = native.dense_table(rows) if rows else None
        self._dense_dims = rows[0][1] if rows else 0
        self._dense_asked = True


class LocalRetriever:
    """The embedded datastore: every shard of one version, in this process (``protocols``:
    ``SparseRetriever`` and ``DenseRetriever``)."""

    def __init__(self, version: DatastoreVersion) -> None:
        self.current = version
        self.times = RetrievalTimes("in-process")
        """How long each retrieval took, in this process (benchmarks report its percentiles)."""

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> SparseAnswer:
        with self.times.timed("sparse"):
            return SparseAnswer(self.current.retrieve(context, cfg), self.current.version)

    def current_version(self) -> str:
        return self.current.version

    def dense_stats(self, version: str) -> DenseDescription:
        """(statistics of the version, its dense model fingerprint); None if it has no dense index."""
        if version and version != self.current.version:
            raise DatastoreError(f"version {version} is not loaded here (current: {self.current.version})")
        return DenseDescription(self.current.dense_stats, self.current.dense_model)

    def retrieve_dense(
        self, query: np.ndarray, next_token: int, cfg: DenseConfig, version: str = ""
    ) -> DenseAnswer:
        with self.times.timed("dense"):
            return DenseAnswer(self.current.retrieve_dense(query, next_token, cfg), self.current.version)
