"""Suffix arrays over token arrays: construction (a library) and pattern search (pure functions).

A shard's corpus is one int32 array: documents' token ids one after another, each document
followed by ``separator`` — a value above every token id, so no pattern ever matches across a
document boundary and a continuation stops at the end of its document.

``sa`` is the suffix array: ``sa[i]`` is the start of the i-th smallest suffix. All suffixes
that begin with a pattern form one contiguous range ``[lo, hi)`` of ``sa``; ``bucket[v]`` is the
first index of ``sa`` whose suffix starts with token v, so a search starts inside the range of
the pattern's first token.

Example: tokens [5, 6, 5, 7, SEP] → suffixes sorted: [5,6,5,7,SEP] (0), [5,7,SEP] (2), [6,5,7,SEP]
(1), [7,SEP] (3), [SEP] (4) → sa = [0, 2, 1, 3, 4]; pattern [5] occupies sa[0:2] (positions 0, 2).
"""

from __future__ import annotations

import numpy as np

SA_LIBRARY = "pydivsufsort"


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[n] int32 suffix array of ``tokens`` ([n] int32, values ≥ 0), built by libdivsufsort."""
    import pydivsufsort

    if tokens.dtype != np.int32:
        raise TypeError(f"tokens must be int32, not {tokens.dtype}")
    if len(tokens) >= 2**31 - 1:
        raise ValueError(f"a shard holds at most 2^31 - 2 tokens, not {len(tokens)}: use more shards")
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int32)
    sa = pydivsufsort.divsufsort(np.ascontiguousarray(tokens))
    return np.asarray(sa, dtype=np.int32)


def build_buckets(tokens: np.ndarray, sa: np.ndarray, num_values: int) -> np.ndarray:
    """[num_values + 1] int64: suffixes starting with value v are sa[bucket[v] : bucket[v + 1]]."""
    counts = np.bincount(tokens, minlength=num_values)[:num_values]
    bucket = np.zeros(num_values + 1, dtype=np.int64)
    np.cumsum(counts, out=bucket[1:])
    return bucket


def compare_at(tokens: np.ndarray, start: int, pattern: np.ndarray) -> int:
    """Compare the suffix at ``start``, cut to len(pattern), with ``pattern``: -1, 0 or 1.

    A suffix shorter than the pattern that agrees on its whole length is smaller.
    """
    m = len(pattern)
    window = tokens[start : start + m]
    k = len(window)
    differ = np.flatnonzero(window != pattern[:k])
    if differ.size:
        j = int(differ[0])
        return -1 if window[j] < pattern[j] else 1
    return 0 if k == m else -1


def find_range(
    tokens: np.ndarray, sa: np.ndarray, bucket: np.ndarray, pattern: np.ndarray
) -> tuple[int, int]:
    """The range ``[lo, hi)`` of ``sa`` whose suffixes start with ``pattern`` (empty: lo == hi)."""
    if len(pattern) == 0:
        return 0, len(sa)
    first = int(pattern[0])
    if not 0 <= first < len(bucket) - 1:
        return 0, 0
    lo, hi = int(bucket[first]), int(bucket[first + 1])
    if len(pattern) == 1 or lo == hi:
        return lo, hi
    # lower bound: first suffix ≥ pattern
    a, b = lo, hi
    while a < b:
        mid = (a + b) // 2
        if compare_at(tokens, int(sa[mid]), pattern) < 0:
            a = mid + 1
        else:
            b = mid
    start = a
    # upper bound: first suffix > pattern (a suffix starting with the pattern compares equal)
    b = hi
    while a < b:
        mid = (a + b) // 2
        if compare_at(tokens, int(sa[mid]), pattern) <= 0:
            a = mid + 1
        else:
            b = mid
    return start, a


def longest_suffix_match(
    tokens: np.ndarray, sa: np.ndarray, bucket: np.ndarray, context: np.ndarray, c_min: int, c_max: int
) -> tuple[int, int, int]:
    """The longest c in [c_min, c_max] whose last-c-token suffix of ``context`` occurs: (c, lo, hi).

    Occurrence is monotone in c (a longer suffix occurs only where a shorter one does), so c is
    found by binary search. No match: (0, 0, 0).
    """
    c_max = min(c_max, len(context))
    best = (0, 0, 0)
    a, b = c_min, c_max
    while a <= b:
        c = (a + b) // 2
        lo, hi = find_range(tokens, sa, bucket, context[len(context) - c :])
        if hi > lo:
            best = (c, lo, hi)
            a = c + 1
        else:
            b = c - 1
    return best
