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

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from datastore_svc import native
from datastore_svc.suffix import SuffixIndex

PAD = -1
MAX_READ_TOKENS = 262_144
"""N · L, the tokens one retrieval reads at most (e.g. N 4096 × L 64): bounds its time and memory."""


@dataclass(frozen=True)
class RetrievalConfig:
    c_min: int = 1
    """Shortest context suffix worth matching."""
    c_max: int = 16
    """Longest context suffix tried."""
    max_occurrences: int = 256
    """N: occurrences read, evenly spaced over the matched range."""
    max_length: int = 10
    """L: tokens read after each occurrence (REST reads 10)."""
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
        if self.max_occurrences * self.max_length > MAX_READ_TOKENS:
            raise ValueError(
                f"N × L = {self.max_occurrences} × {self.max_length} reads more than {MAX_READ_TOKENS} tokens"
            )


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
    """Up to n indices of [lo, hi), evenly spaced, in order: the first and the last, and between
    them ``lo + round(i · (hi - 1 - lo) / (n - 1))`` in integers (halves up), so the compiled
    retrieval (``native``) picks the same. The spacing exceeds 1, so no index repeats.

    Example: [0, 10), n 4 → [0, 3, 6, 9]; [0, 11), n 4 → [0, 3, 7, 10].
    """
    if hi - lo <= n:
        return np.arange(lo, hi, dtype=np.int64)
    if n == 1:
        return np.array([lo], dtype=np.int64)
    i = np.arange(n, dtype=np.int64)
    return lo + (i * (hi - 1 - lo) + (n - 1) // 2) // (n - 1)


def continuation_matrix(tokens: np.ndarray, starts: np.ndarray, length: int, separator: int) -> np.ndarray:
    """[len(starts), length] tokens following each start; PAD from the first separator or the end."""
    idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]  # [N, L]
    mat = tokens.take(idx, mode="clip").astype(np.int64)
    stop = mat >= separator
    if len(idx) and idx[:, -1].max() >= len(tokens):
        stop |= idx >= len(tokens)
    mat[np.logical_or.accumulate(stop, axis=1)] = PAD
    return mat


@dataclass(frozen=True)
class _Nodes:
    depth: np.ndarray  # [num_nodes] 0 = first continuation token
    row: np.ndarray  # [num_nodes] first row of the node's group
    count: np.ndarray  # [num_nodes]
    holder: np.ndarray  # [L, N] the node holding row i at depth d (meaningless where row i is PAD)

    def parents(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids)] parent of each node, -1 = hangs off the root."""
        depth = self.depth[ids]
        return np.where(depth > 0, self.holder[depth - 1, self.row[ids]], -1)  # depth 0: wraps, masked


def trie_of_sorted(mat: np.ndarray) -> _Nodes:
    """The trie of the rows of ``mat`` ([N, L], rows in lexicographic order, PAD-padded).

    Sorted rows that share a prefix are adjacent, so a node is a run of rows: at depth d a new
    node starts at row i when row i disagrees with row i-1 on the first d + 1 tokens (row 0 starts
    a node at every depth). Everything is computed at once over the [L, N] grid of (depth, row)
    starts, in depth-major order: a node runs to the next start (each depth's first row is one);
    its parent is the node holding its first row at depth d - 1.
    """
    n, length = mat.shape
    if n == 0 or length == 0:
        empty = np.zeros(0, dtype=np.int64)
        return _Nodes(empty, empty, empty, np.zeros((length, n), dtype=np.int64))
    cols = mat.T  # [L, N]
    agree = np.logical_and.accumulate(cols[:, 1:] == cols[:, :-1], axis=0)  # [L, N-1] rows i, i+1 to depth d
    starts = np.ones((length, n), dtype=bool)  # [L, N] a node starts at (depth, row)
    starts[:, 1:] = ~agree
    flat = np.flatnonzero(starts)  # depth-major positions d * N + i
    depth, row = np.divmod(flat, n)
    size = np.empty_like(flat)
    size[:-1] = flat[1:] - flat[:-1]
    size[-1] = length * n - flat[-1]
    valid = (cols != PAD).ravel()[flat]
    node_id = np.cumsum(valid) - 1  # ids of the valid starts, in order
    holder = node_id[np.cumsum(starts.ravel()) - 1].reshape(length, n)
    return _Nodes(depth[valid], row[valid], size[valid], holder)


def select_nodes(count: np.ndarray, depth: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k nodes with the highest counts, shallower first on ties (a closed tree)."""
    order = np.lexsort((np.arange(len(count)), depth, -count))
    return np.sort(order[:k])


def _leaves(nodes: _Nodes, keep: np.ndarray) -> np.ndarray:
    has_child = np.zeros(len(nodes.count), dtype=bool)
    kept_parents = nodes.parents(keep)
    has_child[kept_parents[kept_parents >= 0]] = True
    return keep[~has_child[keep]]


def retrieve(
    index: SuffixIndex,
    separator: int,
    context: np.ndarray,
    cfg: RetrievalConfig,
    doc_starts: np.ndarray | None = None,
    shard: int = 0,
) -> Retrieval:
    """Candidates for continuing ``context`` from one shard (see the module docstring); compiled
    where the library loads (``native``), the same result."""
    lib = native.library()
    if lib is not None and native.fits(shape_of(cfg)):
        raw = native.shards_candidates(lib, native.shard_table([(index, separator)]), context, shape_of(cfg))
        return of_raw(raw, None if doc_starts is None else [(doc_starts, shard)])
    c, lo, hi = index.longest_suffix_match(context, cfg.c_min, cfg.c_max, separator)
    if c == 0:
        return NO_MATCH
    picked = sample_range(lo, hi, cfg.max_occurrences)
    starts = index.positions(picked) + c  # continuation start positions
    mat = continuation_matrix(index.tokens, starts, cfg.max_length, separator)  # sorted: the SA's order
    return _candidates(mat, starts, c, hi - lo, cfg, doc_starts, shard)


def _candidates(
    mat: np.ndarray,
    starts: np.ndarray,
    c: int,
    occurrences: int,
    cfg: RetrievalConfig,
    doc_starts: np.ndarray | None = None,
    shard: int = 0,
) -> Retrieval:
    """The tree of the continuations ``mat`` ([N, L] rows in lexicographic order, read at
    ``starts`` after a match of ``c`` tokens): its ``cfg.max_nodes`` most frequent prefixes, and
    their leaves as candidates, most frequent first."""
    nodes = trie_of_sorted(mat)
    if not len(nodes.count):
        return Retrieval((), c, occurrences, len(starts))
    keep = select_nodes(nodes.count, nodes.depth, cfg.max_nodes)
    leaves = _leaves(nodes, keep)
    leaves = leaves[np.lexsort((leaves, -nodes.count[leaves]))][: cfg.max_candidates]
    rows = nodes.row[leaves]
    lengths = nodes.depth[leaves].tolist()
    token_rows = mat[rows].tolist()
    count_rows = nodes.count[nodes.holder[:, rows].T].tolist()  # [leaves, L]: counts of the row's prefixes
    sources: list[Source | None] = [None] * len(leaves)
    if doc_starts is not None:
        pos = starts[rows]
        doc = np.searchsorted(doc_starts, pos, side="right") - 1
        offset = pos - np.asarray(doc_starts)[doc]
        sources = [Source(shard, d, o) for d, o in zip(doc.tolist(), offset.tolist(), strict=True)]
    candidates = [
        Candidate(tuple(token_rows[i][: d + 1]), tuple(count_rows[i][: d + 1]), sources[i])
        for i, d in enumerate(lengths)
    ]
    return Retrieval(tuple(candidates), c, occurrences, len(starts))


def shape_of(cfg: RetrievalConfig) -> tuple[int, int, int, int, int, int]:
    """``cfg`` as the compiled retrieval reads it (``native``)."""
    return (cfg.c_min, cfg.c_max, cfg.max_occurrences, cfg.max_length, cfg.max_nodes, cfg.max_candidates)


def of_raw(
    raw: native.RawCandidates, shards: Sequence[tuple[Sequence[int] | np.ndarray, int]] | None = None
) -> Retrieval:
    """The compiled retrieval's answer as the numpy steps give it; ``shards``: per shard asked,
    its document starts and its index, to name each candidate's source (None: no sources). The
    starts are searched by ``bisect``, a list (``DatastoreVersion`` keeps one) without any numpy
    call, an array as it is, without copying it per retrieval."""
    if raw.match_length == 0:
        return NO_MATCH
    sources: list[Source | None] = [None] * len(raw.tokens)
    if shards is not None:
        sources = []
        for start, position in zip(raw.starts, raw.shards, strict=True):
            doc_starts, shard = shards[position]
            doc = bisect.bisect_right(doc_starts, start) - 1
            sources.append(Source(shard, doc, start - int(doc_starts[doc])))
    candidates = tuple(
        Candidate(tuple(tokens), tuple(counts), source)
        for tokens, counts, source in zip(raw.tokens, raw.counts, sources, strict=True)
    )
    return Retrieval(candidates, raw.match_length, raw.occurrences, raw.sampled)


def well_formed(candidates: Iterable[Candidate], max_length: int) -> tuple[Candidate, ...]:
    """The candidates a well-behaved datastore returns: not empty, at most ``max_length`` tokens,
    one count per token. What comes from a shard or another retriever is untrusted, and one bad
    candidate must cost its drafts, not the merge or the tree built from them."""
    return tuple(
        c for c in candidates if c.tokens and len(c.tokens) <= max_length and len(c.counts) == len(c.tokens)
    )


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
        seen: dict[tuple[int, ...], int] = {}  # one count per path and shard (prefixes repeat)
        for cand in result.candidates:
            tokens, prefix_counts, source = cand.tokens, cand.counts, cand.source
            for i in range(len(tokens)):
                prefix = tokens[: i + 1]
                seen[prefix] = prefix_counts[i]
                if prefix not in sources:
                    sources[prefix] = source
        for path, n in seen.items():
            counts[path] = counts.get(path, 0) + n
    # the top paths in plain Python (a few dozen: numpy's per-call cost between target forwards
    # exceeds the work), ordered as select_nodes orders nodes: count down, shallower, first seen
    paths = list(counts)
    ranked = sorted(range(len(paths)), key=lambda i: (-counts[paths[i]], len(paths[i]), i))
    keep = [paths[i] for i in sorted(ranked[:max_nodes])]
    inner = {p[:-1] for p in keep}
    leaves = sorted((p for p in keep if p not in inner), key=lambda p: (-counts[p], p))
    candidates = tuple(
        Candidate(p, tuple(counts[p[: i + 1]] for i in range(len(p))), sources.get(p))
        for p in leaves[:max_candidates]
    )
    return Retrieval(candidates, c, sum(r.occurrences for r in best), sum(r.sampled for r in best))


def context_retrieval(context: np.ndarray, separator: int, cfg: RetrievalConfig) -> Retrieval:
    """Retrieval from the context itself (prompt lookup with REST's trie): the longest suffix of
    ``context`` that occurred earlier in it, and what followed those occurrences.

    The last token is left out of the index, so the suffix never matches itself.
    Example: context [1, 2, 3, 1, 2] → suffix [1, 2] occurred at 0, followed by [3, 1] (L = 2).
    Compiled where the library loads (``native``), the same result.
    """
    lib = native.library()
    if lib is not None and native.fits(shape_of(cfg)):
        return of_raw(native.context_candidates(lib, context, separator, shape_of(cfg)))
    body = np.asarray(context[:-1], dtype=np.int64)
    if len(body) == 0:
        return NO_MATCH
    ends, c = suffix_occurrences(body, np.asarray(context[-cfg.c_max :], dtype=np.int64), cfg.c_min)
    if c == 0:
        return NO_MATCH
    starts = ends[sample_range(0, len(ends), cfg.max_occurrences)] + 1
    mat = continuation_matrix(np.append(body, separator), starts, cfg.max_length, separator)
    keys = np.where(mat == PAD, np.iinfo(np.int64).max, mat)  # an ended row sorts last, as the separator
    order = np.lexsort(keys.T[::-1])  # rows in lexicographic order, as a suffix array's
    return _candidates(mat[order], starts[order], c, len(ends), cfg)


def suffix_occurrences(body: np.ndarray, pattern: np.ndarray, c_min: int) -> tuple[np.ndarray, int]:
    """Where the longest suffix of ``pattern`` (at least ``c_min`` tokens) occurs in ``body``: the
    positions its occurrences end at, in order, and its length c; no match: (empty, 0).

    One vectorised comparison per pattern token (no index to build: a context changes every step).
    Example: body [1, 2, 3, 1, 2, 9], pattern [3, 1, 2] → ([4], 3), as [3, 1, 2] ends at 4; pattern
    [7, 1, 2] → ([1, 4], 2).
    """
    run = np.zeros(len(body), dtype=np.int64)  # run[j]: pattern's suffix length that ends at j
    alive = np.ones(len(body), dtype=bool)
    for k in range(min(len(pattern), len(body))):
        step = np.zeros(len(body), dtype=bool)
        step[k:] = alive[k:] & (body[: len(body) - k] == pattern[len(pattern) - 1 - k])
        if not step.any():
            break
        alive = step
        run += step
    c = int(run.max(initial=0))
    if c < max(c_min, 1):
        return np.zeros(0, dtype=np.int64), 0
    return np.flatnonzero(run == c), c


def fuse_context(corpus: Retrieval, own: Retrieval, max_nodes: int, max_candidates: int) -> Retrieval:
    """The corpus's and the context's candidates as one tree, the context weighing as much as the
    corpus sample: its counts are scaled by (corpus continuations read / context continuations
    read), then equal paths add up and the ``max_nodes`` most frequent prefixes are kept, whatever
    suffix length each side matched.
    """
    if own.match_length == 0 or not own.candidates:
        return corpus
    if corpus.match_length == 0 or not corpus.candidates:
        return own
    scale = max(corpus.sampled, 1) / max(own.sampled, 1)
    scaled = tuple(
        Candidate(c.tokens, tuple(max(1, round(n * scale)) for n in c.counts), c.source)
        for c in own.candidates
    )
    c = max(corpus.match_length, own.match_length)
    both = [
        Retrieval(corpus.candidates, c, corpus.occurrences, corpus.sampled),
        Retrieval(scaled, c, own.occurrences, own.sampled),
    ]
    return merge(both, max_nodes, max_candidates)
