"""Sparse retrieval (REST) as pure functions: suffix match → continuations → trie → top nodes.

1. Find the longest suffix of the context, c_min ≤ c ≤ c_max tokens, that occurs in the corpus:
   a range ``[lo, hi)`` of the suffix array.
2. Take up to N occurrences, evenly spaced over the range. Suffixes in the range are sorted, so
   the continuations after the match are sorted too and an even spacing is a stratified sample
   of them (frequent continuations keep their share).
3. Read the next L tokens after each occurrence (a continuation stops at its document's end).
4. Count every continuation prefix — a trie whose node count is how many continuations start with
   that node's path — and keep the ``max_nodes`` nodes with the highest counts. A child never
   counts more than its parent and ties go to the shallower node, so the kept nodes form a tree.
5. Return the kept tree's leaves as candidates: token paths with the count of every prefix.

Example: continuations [[4, 2], [4, 2], [4, 9], [7]] → counts (4,):3, (4,2):2, (4,9):1, (7,):1; with
max_nodes 3 the tree keeps (4,), (4,2), then (7,) (shallower than (4,9)) → candidates
[4, 2] (counts 3, 2) and [7] (count 1).

Candidates from several shards merge by adding the counts of equal paths (``merge``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from datastore_svc.suffix import longest_suffix_match

PAD = -1


@dataclass(frozen=True)
class RetrievalConfig:
    c_min: int = 1
    """Shortest context suffix worth matching."""
    c_max: int = 16
    """Longest context suffix tried."""
    max_occurrences: int = 256
    """N: occurrences read, evenly spaced over the matched range."""
    max_length: int = 16
    """L: tokens read after each occurrence."""
    max_nodes: int = 64
    """Trie nodes kept (highest counts)."""
    max_candidates: int = 32
    """D: leaves (candidates) returned at most."""

    def __post_init__(self) -> None:
        if not 1 <= self.c_min <= self.c_max:
            raise ValueError(f"need 1 <= c_min <= c_max, got {self.c_min}, {self.c_max}")
        for name in ("max_occurrences", "max_length", "max_nodes", "max_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass(frozen=True)
class Source:
    shard: int
    document: int
    offset: int  # token offset in the document where the continuation starts


@dataclass(frozen=True)
class Candidate:
    tokens: tuple[int, ...]
    counts: tuple[int, ...]  # counts[i]: occurrences whose continuation starts with tokens[: i + 1]
    source: Source | None = None

    @property
    def count(self) -> int:
        return self.counts[-1]


@dataclass(frozen=True)
class Retrieval:
    candidates: tuple[Candidate, ...]
    match_length: int  # c of the matched suffix, 0 = no match
    occurrences: int  # size of the matched range (before sampling)
    sampled: int  # continuations read


NO_MATCH = Retrieval((), 0, 0, 0)


def sample_range(lo: int, hi: int, n: int) -> np.ndarray:
    """Up to n indices of [lo, hi), evenly spaced, in order."""
    if hi - lo <= n:
        return np.arange(lo, hi, dtype=np.int64)
    return np.unique(np.linspace(lo, hi - 1, n).round().astype(np.int64))


def continuation_matrix(tokens: np.ndarray, starts: np.ndarray, length: int, separator: int) -> np.ndarray:
    """[len(starts), length] tokens following each start; PAD from the first separator or the end."""
    idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    inside = idx < len(tokens)
    mat = np.asarray(tokens[np.minimum(idx, len(tokens) - 1)], dtype=np.int64)
    ended = np.cumsum(~inside | (mat >= separator), axis=1) > 0
    mat[ended] = PAD
    return mat


@dataclass(frozen=True)
class _Nodes:
    depth: np.ndarray  # [num_nodes] 0 = first continuation token
    row: np.ndarray  # [num_nodes] first row of the node's group
    count: np.ndarray  # [num_nodes]
    parent: np.ndarray  # [num_nodes] -1 = hangs off the root


def trie_of_sorted(mat: np.ndarray) -> _Nodes:
    """The trie of the rows of ``mat`` ([N, L], rows in lexicographic order, PAD-padded)."""
    n, length = mat.shape
    depth, row, count, parent = [], [], [], []
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
    prev_node_of_group = np.zeros(0, dtype=np.int64)
    prev_gid = np.zeros(n, dtype=np.int64)
    total = 0
    for d in range(length):
        col = mat[:, d]
        new = new.copy()
        new[1:] |= col[1:] != col[:-1]
        gid = np.cumsum(new) - 1  # group of each row at depth d
        starts = np.flatnonzero(new)
        sizes = np.diff(np.append(starts, n))
        valid = col[starts] != PAD
        starts, sizes = starts[valid], sizes[valid]
        if not len(starts):
            break
        node_of_group = np.full(int(gid[-1]) + 1, -1, dtype=np.int64)
        node_of_group[gid[starts]] = np.arange(total, total + len(starts))
        depth.append(np.full(len(starts), d))
        row.append(starts)
        count.append(sizes)
        parent.append(prev_node_of_group[prev_gid[starts]] if d else np.full(len(starts), -1))
        total += len(starts)
        prev_node_of_group, prev_gid = node_of_group, gid
    if not depth:
        empty = np.zeros(0, dtype=np.int64)
        return _Nodes(empty, empty, empty, empty)
    return _Nodes(*(np.concatenate(a).astype(np.int64) for a in (depth, row, count, parent)))


def select_nodes(count: np.ndarray, depth: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k nodes with the highest counts, shallower first on ties (a closed tree)."""
    order = np.lexsort((np.arange(len(count)), depth, -count))
    return np.sort(order[:k])


def _leaves(parent: np.ndarray, keep: np.ndarray) -> np.ndarray:
    has_child = np.zeros(len(parent), dtype=bool)
    kept_parents = parent[keep]
    has_child[kept_parents[kept_parents >= 0]] = True
    return keep[~has_child[keep]]


def _path(parent: np.ndarray, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(parent[node])
    return path[::-1]


def retrieve(
    tokens: np.ndarray,
    sa: np.ndarray,
    bucket: np.ndarray,
    separator: int,
    context: np.ndarray,
    cfg: RetrievalConfig,
    doc_starts: np.ndarray | None = None,
    shard: int = 0,
) -> Retrieval:
    """Candidates for continuing ``context`` from one shard (see the module docstring)."""
    c, lo, hi = longest_suffix_match(tokens, sa, bucket, context, cfg.c_min, cfg.c_max)
    if c == 0:
        return NO_MATCH
    picked = sample_range(lo, hi, cfg.max_occurrences)
    starts = np.asarray(sa[picked], dtype=np.int64) + c  # continuation start positions
    mat = continuation_matrix(tokens, starts, cfg.max_length, separator)
    nodes = trie_of_sorted(mat)
    if not len(nodes.count):
        return Retrieval((), c, hi - lo, len(picked))
    keep = select_nodes(nodes.count, nodes.depth, cfg.max_nodes)
    leaves = _leaves(nodes.parent, keep)
    leaves = leaves[np.lexsort((leaves, -nodes.count[leaves]))][: cfg.max_candidates]
    candidates = []
    for leaf in leaves:
        path = _path(nodes.parent, int(leaf))
        r = int(nodes.row[leaf])
        source = None
        if doc_starts is not None:
            pos = int(starts[r])
            doc = int(np.searchsorted(doc_starts, pos, side="right")) - 1
            source = Source(shard, doc, pos - int(doc_starts[doc]))
        candidates.append(
            Candidate(
                tokens=tuple(int(t) for t in mat[r, : len(path)]),
                counts=tuple(int(nodes.count[p]) for p in path),
                source=source,
            )
        )
    return Retrieval(tuple(candidates), c, hi - lo, len(picked))


def merge(results: Sequence[Retrieval], max_nodes: int, max_candidates: int) -> Retrieval:
    """One result from several shards' results: counts of equal paths add up.

    Only shards that matched the longest suffix length among them contribute (a shorter match is
    weaker evidence); their candidates' prefix counts are summed per path and the top
    ``max_nodes`` paths are kept again as a tree.
    """
    matched = [r for r in results if r.match_length > 0]
    if not matched:
        return NO_MATCH
    c = max(r.match_length for r in matched)
    best = [r for r in matched if r.match_length == c]
    if len(best) == 1 and len(best[0].candidates) <= max_candidates:
        return best[0]
    counts: dict[tuple[int, ...], int] = {}
    sources: dict[tuple[int, ...], Source | None] = {}
    for result in best:
        seen: dict[tuple[int, ...], int] = {}
        for cand in result.candidates:
            for i in range(len(cand.tokens)):
                seen[cand.tokens[: i + 1]] = cand.counts[i]
        for path, n in seen.items():
            counts[path] = counts.get(path, 0) + n
        for cand in result.candidates:
            for i in range(len(cand.tokens)):
                sources.setdefault(cand.tokens[: i + 1], cand.source)
    paths = list(counts)
    count = np.array([counts[p] for p in paths], dtype=np.int64)
    depth = np.array([len(p) for p in paths], dtype=np.int64)
    keep = [paths[i] for i in select_nodes(count, depth, max_nodes)]
    inner = {p[:-1] for p in keep}
    leaves = sorted((p for p in keep if p not in inner), key=lambda p: (-counts[p], p))
    candidates = tuple(
        Candidate(p, tuple(counts[p[: i + 1]] for i in range(len(p))), sources.get(p))
        for p in leaves[:max_candidates]
    )
    return Retrieval(candidates, c, sum(r.occurrences for r in best), sum(r.sampled for r in best))
