"""Suffix arrays over token arrays: construction and search, both by libdivsufsort (pydivsufsort).

A shard's corpus is one array: documents' token ids one after another, each document followed by
``separator`` — a value above every token id, so no pattern matches across a document boundary
and a continuation stops at the end of its document.

Tokens are stored big-endian at a fixed width (2 bytes when the separator fits, else 4), so that
comparing their bytes compares the tokens: the suffix array of the tokens is then also sorted as
byte strings, and libdivsufsort's own C binary search (``sa_search``) finds a pattern's range in
microseconds. ``sa`` holds the suffixes' *byte* offsets (token position × width); all suffixes that
begin with a pattern form one contiguous range ``[lo, hi)`` of it.

Example: tokens [5, 6, 5, 7, SEP] → suffixes sorted: [5,6,5,7,SEP] (0), [5,7,SEP] (2), [6,5,7,SEP]
(1), [7,SEP] (3), [SEP] (4) → token-level suffix array [0, 2, 1, 3, 4]; with width 2 the stored
``sa`` is [0, 4, 2, 6, 8]; pattern [5] occupies sa[0:2] (token positions 0 and 2).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

SA_LIBRARY = "pydivsufsort"
MAX_SHARD_BYTES = 2**31 - 1  # int32 byte offsets


def token_dtype(separator: int) -> np.dtype:
    """Big-endian unsigned ints wide enough for token ids and the separator."""
    return np.dtype(">u2") if separator < 2**16 else np.dtype(">u4")


NATIVE_ROWS_LOCK = threading.Lock()
"""Held while an index makes its rows for the compiled retrieval (``SuffixIndex.native_row``,
``DenseIndex.native_row``): once made, a row's arrays live as long as the index."""
MAX_TABLE_TOKENS = 1 << 20
"""Above this separator (a vocabulary of a million tokens) an index has no first-token table."""

SMALL_ARRAY = 1 << 16
"""Arrays shorter than this (a context, not a shard) are sorted on their token ranks."""


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[n] int32 token-level suffix array of ``tokens`` ([n] non-negative ints), by libdivsufsort."""
    import pydivsufsort

    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int32)
    if int(tokens.min()) < 0:
        raise ValueError("token ids must be non-negative")
    values = np.ascontiguousarray(tokens, dtype=np.int32)
    if len(values) < SMALL_ARRAY:  # libdivsufsort's work grows with the alphabet: rank the tokens first
        values = np.unique(values, return_inverse=True)[1].astype(np.int32)  # order-preserving: same SA
    sa = pydivsufsort.divsufsort(values)
    return np.asarray(sa, dtype=np.int32)


def _search_function() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    from pydivsufsort.dll import libdivsufsort

    fn = libdivsufsort.sa_search
    fn.argtypes = [
        ctypes.c_void_p,  # T
        ctypes.c_int32,  # Tsize (bytes)
        ctypes.c_char_p,  # P
        ctypes.c_int32,  # Psize (bytes)
        ctypes.c_void_p,  # SA
        ctypes.c_int32,  # SAsize (entries)
        ctypes.POINTER(ctypes.c_int32),  # left
    ]
    fn.restype = ctypes.c_int32
    return fn


_SA_SEARCH = None


@dataclass(frozen=True)
class SuffixIndex:
    """A shard's tokens and suffix array, ready to search (arrays may be memory-mapped)."""

    tokens: np.ndarray  # [n] big-endian uint16 / uint32
    sa: np.ndarray  # [n] int32 byte offsets of the sorted suffixes

    def __post_init__(self) -> None:
        # the arrays' addresses and sizes, once: numpy's ``.ctypes`` builds helper objects on every
        # access, and a search is a few microseconds, so Python overheads show
        width = int(self.tokens.dtype.itemsize)
        n = len(self.sa)
        object.__setattr__(self, "_search_args", (self.tokens.ctypes.data, n * width, self.sa.ctypes.data, n))
        object.__setattr__(self, "_width", width)

    @staticmethod
    def build(tokens: np.ndarray, separator: int) -> SuffixIndex:
        """Index ``tokens`` ([n] ints < separator, or == separator between documents)."""
        dtype = token_dtype(separator)
        if len(tokens) * dtype.itemsize > MAX_SHARD_BYTES:
            raise ValueError(f"{len(tokens)} tokens are too many for one shard: use more shards")
        sa = build_suffix_array(tokens).astype(np.int64) * dtype.itemsize
        return SuffixIndex(np.ascontiguousarray(tokens, dtype=dtype), sa.astype(np.int32))

    def native_row(self, separator: int) -> tuple[int, int, int, int, int, int]:
        """What the compiled retrieval (``native``) reads of this index: (tokens address, tokens,
        width, suffix array address, separator, first-token table address or 0).

        The table (made on first use, kept with the index) gives for each token t the range of
        the suffix array whose suffixes start with t, so that a search starts inside it instead
        of over the whole array: about half the probes, each a cache miss into the arrays once a
        target forward has run. Example: tokens [5, 6, 5, 7, SEP] → token 5's suffixes are rows
        [0, 2). None (0) for vocabularies above ``MAX_TABLE_TOKENS``."""
        cached = getattr(self, "_native_rows", {})
        if separator not in cached:
            with NATIVE_ROWS_LOCK:  # one table per index: a table another thread holds stays alive
                cached = getattr(self, "_native_rows", {})
                if separator not in cached:
                    table = self.first_token_starts(separator) if separator <= MAX_TABLE_TOKENS else None
                    pointer = 0 if table is None else table.ctypes.data
                    tokens_ptr, _, sa_ptr, n = self._search_args  # type: ignore[attr-defined]
                    row = (tokens_ptr, n, self.width, sa_ptr, separator, pointer)
                    cached = {**cached, separator: (row, table)}  # readers see the old dict or this one
                    object.__setattr__(self, "_native_rows", cached)
        return cached[separator][0]  # type: ignore[no-any-return]

    def first_token_starts(self, separator: int) -> np.ndarray:
        """[separator + 1] int64: the first row of ``sa`` whose suffix starts with each token
        value (the rows of token t are ``[starts[t], starts[t + 1])``)."""
        first = np.asarray(self.tokens[self.positions(np.arange(len(self.sa)))], dtype=np.int64)
        return np.searchsorted(first, np.arange(separator + 1, dtype=np.int64), side="left").astype(np.int64)

    @property
    def width(self) -> int:
        return self._width  # type: ignore[attr-defined, no-any-return]

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """Token positions of the suffixes at ``rows`` of the suffix array."""
        return np.asarray(self.sa[rows], dtype=np.int64) // self.width

    def find_range(self, pattern: np.ndarray) -> tuple[int, int]:
        """The range ``[lo, hi)`` of ``sa`` whose suffixes start with ``pattern`` (empty: lo == hi)."""
        values = [int(t) for t in pattern]
        if values and (min(values) < 0 or max(values) >= 2 ** (8 * self.width)):
            return 0, 0
        return self._range_of_bytes(np.asarray(values, dtype=self.tokens.dtype).tobytes())

    def _range_of_bytes(self, key: bytes) -> tuple[int, int]:
        global _SA_SEARCH
        tokens_ptr, tokens_bytes, sa_ptr, n = self._search_args  # type: ignore[attr-defined]
        if not key:
            return 0, n
        if n == 0:
            return 0, 0
        if _SA_SEARCH is None:
            _SA_SEARCH = _search_function()
        left = ctypes.c_int32()
        count = _SA_SEARCH(tokens_ptr, tokens_bytes, key, len(key), sa_ptr, n, ctypes.byref(left))
        if count < 0:
            raise RuntimeError(f"libdivsufsort sa_search failed ({count})")
        return (left.value, left.value + count) if count else (0, 0)

    def longest_suffix_match(
        self, context: np.ndarray, c_min: int, c_max: int, separator: int | None = None
    ) -> tuple[int, int, int]:
        """The longest c in [c_min, c_max] whose last-c-token suffix of ``context`` occurs: (c, lo, hi).

        Occurrence is monotone in c (a longer suffix occurs only where a shorter one does), so c is
        found by binary search. No match: (0, 0, 0). A context token at or above ``separator`` (the
        index's document boundary) is no token of any document: only the suffix after it can match.
        """
        c_max = min(c_max, len(context))
        tail = np.asarray(context[len(context) - c_max :]).tolist()  # Python ints, quickly
        width = self.width
        limit = 2 ** (8 * width) if separator is None else min(separator, 2 ** (8 * width))
        if tail and (min(tail) < 0 or max(tail) >= limit):
            # a token this index cannot hold occurs nowhere: only the suffix after it can match
            bad = [i for i, t in enumerate(tail) if not 0 <= t < limit]
            tail = tail[bad[-1] + 1 :]
        c_max = len(tail)
        data = np.array(tail, dtype=self.tokens.dtype).tobytes()
        best = (0, 0, 0)
        a, b = c_min, c_max
        while a <= b:
            c = (a + b) // 2
            lo, hi = self._range_of_bytes(data[(c_max - c) * width :])
            if hi > lo:
                best = (c, lo, hi)
                a = c + 1
            else:
                b = c - 1
        return best
