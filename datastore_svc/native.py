"""Retrieval compiled (``csrc/retrieval.c``): a shard's or the context's candidates in one call,
the same as ``retrieval.py``'s numpy steps, which stay the reference and the fallback; and DReSD's
dense search of every shard with its drafts in one call (``dense_candidates``), the same as FAISS
and ``dense.py``'s drafts, which stay the reference and the fallback.

Between two target forwards of a 135M model on 2 cores (about 14 ms each), the numpy retrieval
(a suffix-array match, a dozen array operations for the continuations' trie, more for the
context's own) took about 1 ms a step: numpy's per-call overhead, not the work, and three times
what the same calls cost in a tight loop. The C version does the same steps in one call per shard.
A dense step (two FAISS searches, then reading the hits in Python) took 0.55 ms; one call over
FAISS's own arrays (no copy; AVX2 with F16C where the CPU has them) takes 0.36 ms.

The library is plain C called through ``ctypes`` (no Python API, so no build against this
interpreter), compiled by the system's C compiler on first use into
``specdraft.common.native_dir()`` under a name made of the digest of its source and flags; a
build in advance (``make setup``, the container images) is loaded without a compiler. Without a
compiler, or with ``SPECDRAFT_NATIVE=0``, ``library()`` is None and retrieval runs in numpy.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specdraft.common import file_lock, native_dir, temp_sibling

if TYPE_CHECKING:
    from datastore_svc.suffix import SuffixIndex

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "retrieval.c"
CFLAGS = ("-O2", "-std=c11", "-fPIC", "-shared")

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def build_name() -> str:
    """The build's name: a digest of the source and the flags."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    return f"specdraft_retrieval_{digest}"


def _library_path() -> Path:
    return native_dir() / build_name() / "libretrieval.so"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(library: Path) -> None:
    """Compile into ``library`` (atomically: a process that loads it sees all of it or none)."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    with file_lock(library.with_suffix(".lock")):
        if library.is_file():  # another process built it while this one waited
            return
        tmp = temp_sibling(library)
        try:
            subprocess.run(
                [compiler, *CFLAGS, "-o", str(tmp), str(SOURCE)], check=True, capture_output=True, text=True
            )
            os.replace(tmp, library)
        except subprocess.CalledProcessError as exc:
            raise OSError(f"cc failed: {(exc.stderr or '').strip()[-300:]}") from None
        finally:
            tmp.unlink(missing_ok=True)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("SPECDRAFT_NATIVE", "1") == "0":
        log.info("compiled retrieval turned off by SPECDRAFT_NATIVE=0: retrieval runs in numpy")
        return None
    library = _library_path()
    try:
        if not library.is_file():
            library.parent.mkdir(parents=True, exist_ok=True)
            _build(library)
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        log.warning("compiled retrieval unavailable (%s): retrieval runs in numpy", exc)
        return None
    lib.sd_shards_candidates.argtypes = [_I64, _PTR, _PTR, _I64, _PTR, *[_PTR] * 6]
    lib.sd_shards_candidates.restype = ctypes.c_int
    lib.sd_context_candidates.argtypes = [_PTR, _I64, _I64, _PTR, *[_PTR] * 5]
    lib.sd_context_candidates.restype = ctypes.c_int
    lib.sd_dense_candidates.argtypes = [_I64, _PTR, _PTR, _PTR, *[_PTR] * 7]
    lib.sd_dense_candidates.restype = ctypes.c_int
    lib.sd_dense_simd.argtypes = [ctypes.c_int]
    lib.sd_dense_simd.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled retrieval (built on first use), or None where it cannot run (logged once)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


@dataclass(frozen=True)
class RawCandidates:
    """What one call found: the match, and the candidates' tokens, prefix counts and start
    positions as lists (most frequent first)."""

    match_length: int
    occurrences: int
    sampled: int
    tokens: list[list[int]]  # [candidates][length of each]
    counts: list[list[int]]  # [candidates][length of each]
    starts: list[int]  # [candidates] token position of each continuation
    shards: list[int]  # [candidates] which of the shards asked the continuation is in (0: one shard)


class _Buffers(threading.local):
    """One thread's input and output arrays (ctypes: reading one back is a slice, no numpy call),
    reused while the shape stays (gRPC serves on a pool).

    Between two target forwards every library's code and data are cold: the first numpy call
    after a forward took 20-120 µs on a 2-core Xeon (a ``.ctypes`` pointer 116 µs), against 1-2 µs
    in a loop, so a step's retrieval makes as few distinct calls as it can."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.cfg = (ctypes.c_int64 * 6)()
        self.tail = (ctypes.c_int64 * MAX_TAIL)()
        self.meta = (ctypes.c_int64 * 4)()  # c, occurrences, sampled, candidates
        self.tokens = (ctypes.c_int32 * 0)()  # [candidates, length]
        self.counts = (ctypes.c_int32 * 0)()  # [candidates, length]
        self.lengths = (ctypes.c_int32 * 0)()  # [candidates]
        self.starts = (ctypes.c_int64 * 0)()  # [candidates]
        self.shards = (ctypes.c_int64 * 0)()  # [candidates]
        self.pointers: tuple[int, ...] = ()

    def get(self, shape: tuple[int, int, int, int, int, int]) -> _Buffers:
        if self.shape != shape:
            candidates, length = shape[5], shape[3]
            self.cfg[:] = list(shape)
            self.tokens = (ctypes.c_int32 * (candidates * length))()
            self.counts = (ctypes.c_int32 * (candidates * length))()
            self.lengths = (ctypes.c_int32 * candidates)()
            self.starts = (ctypes.c_int64 * candidates)()
            self.shards = (ctypes.c_int64 * candidates)()
            arrays = (self.meta, self.tokens, self.counts, self.lengths, self.starts, self.shards)
            self.pointers = tuple(ctypes.addressof(a) for a in arrays)
            self.shape = shape
        return self

    def result(self, several: bool) -> RawCandidates:
        c, occurrences, sampled, found = self.meta[:4]
        length = self.shape[3]
        sizes = self.lengths[:found]
        flat_tokens = self.tokens[: found * length]
        flat_counts = self.counts[: found * length]
        rows = range(0, found * length, length)
        return RawCandidates(
            c,
            occurrences,
            sampled,
            [flat_tokens[r : r + k] for r, k in zip(rows, sizes, strict=True)],
            [flat_counts[r : r + k] for r, k in zip(rows, sizes, strict=True)],
            self.starts[:found],
            self.shards[:found] if several else [0] * found,
        )


MAX_TAIL = 64
"""The most context tokens a compiled shard search reads (``c_max``)."""
MAX_LENGTH = 128
"""The longest continuation the compiled merge reads (``max_length``)."""


def fits(shape: tuple[int, int, int, int, int, int]) -> bool:
    """Whether the compiled retrieval takes this shape (a shard server's requests may ask more:
    those run in numpy)."""
    return shape[1] <= MAX_TAIL and shape[3] <= MAX_LENGTH


_buffers = _Buffers()


def _address(tokens: np.ndarray) -> tuple[int, np.ndarray]:
    """The address of ``tokens`` as contiguous int64, and the array that holds it (keep it alive)."""
    if tokens.dtype != np.int64 or not tokens.flags.c_contiguous:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    return tokens.__array_interface__["data"][0], tokens


def shard_table(shards: Sequence[tuple[SuffixIndex, int]]) -> np.ndarray:
    """[shards, 6] int64 for ``shards_candidates``: per (index, separator), the index's arrays
    (``SuffixIndex.native_row``). The caller keeps the indexes alive while it uses the table."""
    return np.array([index.native_row(separator) for index, separator in shards], dtype=np.int64).reshape(
        len(shards), 6
    )


def shards_candidates(
    lib: ctypes.CDLL, table: np.ndarray, context: np.ndarray, shape: tuple[int, int, int, int, int, int]
) -> RawCandidates:
    """Every shard of ``table`` (``shard_table``) searched for ``context`` ([T] ints; its last
    ``c_max`` read) and merged as ``retrieval.merge`` merges their answers (one shard: its own).
    ``shape``: (c_min, c_max, N, L, max_nodes, max_candidates)."""
    buffers = _buffers.get(shape)
    tail = context[-shape[1] :].tolist()
    buffers.tail[: len(tail)] = tail
    rc = lib.sd_shards_candidates(
        len(table),
        table.__array_interface__["data"][0],
        ctypes.addressof(buffers.tail),
        len(tail),
        ctypes.addressof(buffers.cfg),
        *buffers.pointers,
    )
    if rc != 0:
        raise MemoryError("compiled retrieval ran out of memory")
    return buffers.result(several=True)


def context_candidates(
    lib: ctypes.CDLL, context: np.ndarray, separator: int, shape: tuple[int, int, int, int, int, int]
) -> RawCandidates:
    """The context's own candidates (``retrieval.context_retrieval``) for ``context`` ([T] ints)."""
    buffers = _buffers.get(shape)
    address, held = _address(context)
    rc = lib.sd_context_candidates(
        address, len(held), separator, ctypes.addressof(buffers.cfg), *buffers.pointers[:5]
    )
    if rc != 0:
        raise MemoryError("compiled retrieval ran out of memory")
    return buffers.result(several=False)


DENSE_ROW = 15
"""Values per shard in a dense table: ``DenseIndex.native_row``'s eleven, then the shard's tokens
(address, count, width) and separator."""
MAX_DENSE_KEYS = 4096
"""The most nearest keys a compiled dense search keeps (``top_k``)."""
MAX_DENSE_CANDIDATES = 256
"""The most drafts it returns (``max_candidates``)."""


@dataclass(frozen=True)
class RawDense:
    """What one compiled dense search found, as lists (best score first)."""

    searched: int
    matched: int
    tokens: list[list[int]]  # [candidates][length of each]
    counts: list[int]  # [candidates] keys that drafted exactly these tokens
    scores: list[float]  # [candidates] the best such key's inner product with the query
    starts: list[int]  # [candidates] token position of the draft's first token
    shards: list[int]  # [candidates] which of the shards asked it came from


def dense_fits(top_k: int, max_candidates: int, max_length: int) -> bool:
    """Whether the compiled dense search takes this configuration (else FAISS and numpy)."""
    return (
        0 <= top_k <= MAX_DENSE_KEYS
        and 0 <= max_candidates <= MAX_DENSE_CANDIDATES
        and 0 <= max_length <= MAX_LENGTH
    )


def dense_simd(enabled: bool | None = None) -> bool:
    """Whether the compiled dense search uses vector instructions (AVX2 with FMA and F16C, where
    the CPU has them); ``enabled=False`` makes it use plain C (tests), ``True`` allows them again."""
    lib = library()
    if lib is None:
        return False
    return bool(lib.sd_dense_simd(-1 if enabled is None else int(enabled)))


class _DenseBuffers(threading.local):
    """One thread's arrays for ``dense_candidates``, reused while the shape stays."""

    def __init__(self) -> None:
        self.shape: tuple[int, int, int] = (0, 0, 0)
        self.cfg = (ctypes.c_int64 * 4)()
        self.query = (ctypes.c_float * 0)()
        self.meta = (ctypes.c_int64 * 3)()
        self.tokens = (ctypes.c_int32 * 0)()
        self.counts = (ctypes.c_int32 * 0)()
        self.lengths = (ctypes.c_int32 * 0)()
        self.scores = (ctypes.c_float * 0)()
        self.starts = (ctypes.c_int64 * 0)()
        self.shards = (ctypes.c_int64 * 0)()
        self.pointers: tuple[int, ...] = ()

    def get(self, dims: int, candidates: int, length: int) -> _DenseBuffers:
        if self.shape != (dims, candidates, length):
            self.query = (ctypes.c_float * dims)()
            self.tokens = (ctypes.c_int32 * (candidates * length))()
            self.counts = (ctypes.c_int32 * candidates)()
            self.lengths = (ctypes.c_int32 * candidates)()
            self.scores = (ctypes.c_float * candidates)()
            self.starts = (ctypes.c_int64 * candidates)()
            self.shards = (ctypes.c_int64 * candidates)()
            arrays = (self.tokens, self.counts, self.lengths, self.scores, self.starts, self.shards)
            self.pointers = tuple(ctypes.addressof(a) for a in (self.meta, *arrays))
            self.shape = (dims, candidates, length)
        return self


_dense_buffers = _DenseBuffers()


def dense_table(rows: Sequence[tuple[int, ...]]) -> np.ndarray:
    """[shards, DENSE_ROW] int64 for ``dense_candidates`` from each shard's row (the caller keeps
    the indexes and token arrays alive while it uses the table)."""
    return np.array(rows, dtype=np.int64).reshape(len(rows), DENSE_ROW)


def dense_candidates(
    lib: ctypes.CDLL,
    table: np.ndarray,
    query: np.ndarray | Sequence[float],
    next_token: int,
    cfg: tuple[int, int, int],
) -> RawDense:
    """Every shard of ``table`` (``dense_table``) searched for ``query`` [dims] (unit norm), the
    hits followed by ``next_token`` read as drafts, and the shards' drafts merged, as
    ``dense.dense_retrieve`` and ``dense.merge_dense`` do with FAISS. ``cfg``: (top_k,
    max_candidates, max_length)."""
    top_k, candidates, length = cfg
    values = query.tolist() if isinstance(query, np.ndarray) else list(query)
    buffers = _dense_buffers.get(len(values), candidates, length)
    buffers.query[:] = values
    buffers.cfg[:] = [candidates, length, next_token, top_k]
    rc = lib.sd_dense_candidates(
        len(table),
        table.__array_interface__["data"][0],
        ctypes.addressof(buffers.query),
        ctypes.addressof(buffers.cfg),
        *buffers.pointers,
    )
    if rc != 0:
        raise MemoryError("compiled dense retrieval ran out of memory")
    searched, matched, found = buffers.meta[:3]
    sizes = buffers.lengths[:found]
    flat = buffers.tokens[: found * length]
    return RawDense(
        searched,
        matched,
        [flat[r : r + k] for r, k in zip(range(0, found * length, length), sizes, strict=True)],
        buffers.counts[:found],
        buffers.scores[:found],
        buffers.starts[:found],
        buffers.shards[:found],
    )


def describe() -> str:
    """Whether the compiled retrieval can run here, without building it (``specdraft --version``)."""
    if os.environ.get("SPECDRAFT_NATIVE", "1") == "0":
        return "no: turned off by SPECDRAFT_NATIVE=0 (numpy)"
    library = _library_path()
    if library.is_file():
        return f"yes (built in {library.parent})"
    if _compiler() is None:
        return "no: no C compiler (cc) on PATH (numpy)"
    return "yes (compiled on first use, about a second)"


def main() -> int:
    """Build the library now (``make setup``, container images): prints its path, or why it
    cannot be built here (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if library() is None:
        print("compiled retrieval not built (see the warning above)", file=sys.stderr)
        return 1
    print(native_dir() / build_name())
    return 0
