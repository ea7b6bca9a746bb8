"""Suffix arrays and sparse retrieval against brute-force scans, on random and real token arrays."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore_svc.retrieval import (
    NO_MATCH,
    PAD,
    Candidate,
    Retrieval,
    RetrievalConfig,
    continuation_matrix,
    merge,
    retrieve,
    sample_range,
    select_nodes,
    trie_of_sorted,
)
from datastore_svc.suffix import SuffixIndex, build_suffix_array

VOCAB = 12
SEP = VOCAB  # above every token


def random_corpus(rng: np.random.Generator, docs: int, vocab: int = VOCAB) -> np.ndarray:
    parts = []
    for _ in range(docs):
        parts.append(rng.integers(0, vocab, size=int(rng.integers(1, 60))))
        parts.append([vocab])
    return np.concatenate(parts).astype(np.int32)


def real_corpus() -> np.ndarray:
    """Real text (the standard library's own docs) tokenized by the default model's tokenizer."""
    import json
    import textwrap

    from transformers import AutoTokenizer

    from llm_worker.model.loading import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    docs = [textwrap.dedent(m.__doc__ or "") for m in (json, textwrap, np)]
    ids: list[int] = []
    for doc in docs:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [len(tok)]
    return np.array(ids, dtype=np.int32)


def brute_sa(tokens: np.ndarray) -> list[int]:
    seq = tokens.tolist()
    return sorted(range(len(seq)), key=lambda i: seq[i:])


def brute_occurrences(tokens: np.ndarray, pattern: np.ndarray) -> list[int]:
    m = len(pattern)
    return [i for i in range(len(tokens) - m + 1) if np.array_equal(tokens[i : i + m], pattern)]


def index(tokens: np.ndarray, separator: int = SEP) -> SuffixIndex:
    return SuffixIndex.build(tokens, separator)


@pytest.mark.parametrize("seed", range(5))
def test_suffix_array_is_sorted_suffixes(seed: int) -> None:
    tokens = random_corpus(np.random.default_rng(seed), 8)
    assert build_suffix_array(tokens).tolist() == brute_sa(tokens)


def test_suffix_array_of_real_tokens() -> None:
    tokens = real_corpus()
    sa = build_suffix_array(tokens)
    assert sorted(sa.tolist()) == list(range(len(tokens)))
    seq = tokens.tolist()
    for a, b in zip(sa[:-1].tolist(), sa[1:].tolist(), strict=True):  # each adjacent pair in order
        assert seq[a : a + 64] <= seq[b : b + 64]


@pytest.mark.parametrize("seed", range(5))
def test_find_range_equals_a_scan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 10, vocab=4)
    idx = index(tokens, 4)
    for _ in range(60):
        m = int(rng.integers(1, 6))
        if rng.random() < 0.7:  # a pattern taken from the corpus (inside one document)
            start = int(rng.integers(0, len(tokens) - m))
            pattern = tokens[start : start + m]
            if (pattern == SEP).any() or (pattern == 4).any():
                continue
        else:
            pattern = rng.integers(0, 4, size=m).astype(np.int32)
        lo, hi = idx.find_range(pattern)
        assert sorted(idx.positions(np.arange(lo, hi)).tolist()) == brute_occurrences(tokens, pattern)


def test_find_range_on_real_tokens_and_absent_tokens() -> None:
    tokens = real_corpus()
    vocab = int(tokens.max()) + 1
    idx = index(tokens, vocab)
    rng = np.random.default_rng(0)
    for _ in range(40):
        m = int(rng.integers(1, 9))
        start = int(rng.integers(0, len(tokens) - m))
        pattern = tokens[start : start + m]
        lo, hi = idx.find_range(pattern)
        assert sorted(idx.positions(np.arange(lo, hi)).tolist()) == brute_occurrences(tokens, pattern)
    assert idx.find_range(np.array([vocab + 5], dtype=np.int32)) == (0, 0)
    assert idx.find_range(np.array([3, -1], dtype=np.int32)) == (0, 0)


def brute_longest(tokens: np.ndarray, context: np.ndarray, c_min: int, c_max: int) -> int:
    for c in range(min(c_max, len(context)), c_min - 1, -1):
        if brute_occurrences(tokens, context[len(context) - c :]):
            return c
    return 0


def brute_retrieve(tokens: np.ndarray, context: np.ndarray, cfg: RetrievalConfig) -> list[tuple]:
    """Every occurrence, every continuation prefix counted, the same top-node rule."""
    c = brute_longest(tokens, context, cfg.c_min, cfg.c_max)
    if c == 0:
        return []
    counts: Counter[tuple[int, ...]] = Counter()
    for pos in brute_occurrences(tokens, context[len(context) - c :]):
        cont = []
        for t in tokens[pos + c : pos + c + cfg.max_length].tolist():
            if t >= SEP:
                break
            cont.append(t)
        for i in range(len(cont)):
            counts[tuple(cont[: i + 1])] += 1
    order = sorted(counts, key=lambda p: (-counts[p], len(p), p))[: cfg.max_nodes]
    kept = set(order)
    leaves = [p for p in kept if not any(q[:-1] == p for q in kept)]
    return sorted((p, tuple(counts[p[: i + 1]] for i in range(len(p)))) for p in leaves)


@pytest.mark.parametrize("seed", range(8))
def test_retrieve_equals_a_brute_force_scan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = random_corpus(rng, 12, vocab=3)
    idx = index(tokens)
    cfg = RetrievalConfig(c_min=1, c_max=6, max_occurrences=10_000, max_length=4, max_nodes=int(seed * 3 + 2))
    for _ in range(20):
        context = rng.integers(0, 3, size=int(rng.integers(1, 10))).astype(np.int32)
        got = retrieve(idx, SEP, context, cfg)
        assert got.match_length == brute_longest(tokens, context, 1, 6)
        assert len({c.tokens for c in got.candidates}) == len(got.candidates)
        assert sorted((c.tokens, c.counts) for c in got.candidates) == brute_retrieve(tokens, context, cfg)


def test_retrieve_reports_sources_and_no_match_means_no_candidates() -> None:
    tokens = np.array([1, 2, 3, SEP, 5, 1, 2, 4, SEP], dtype=np.int32)
    idx = index(tokens)
    docs = np.array([0, 4])
    got = retrieve(idx, SEP, np.array([9, 1, 2]), RetrievalConfig(), docs, shard=3)
    assert got.match_length == 2
    assert {(c.tokens, c.source) for c in got.candidates} == {
        ((3,), retrieval_source(3, 0, 2)),
        ((4,), retrieval_source(3, 1, 3)),
    }
    none = retrieve(idx, SEP, np.array([7, 8]), RetrievalConfig(), docs)
    assert none.candidates == () and none.match_length == 0


def retrieval_source(shard: int, doc: int, offset: int) -> object:
    from datastore_svc.retrieval import Source

    return Source(shard, doc, offset)


def test_trie_and_top_nodes_example() -> None:
    mat = np.array([[4, 2], [4, 2], [4, 9], [7, -1]])
    nodes = trie_of_sorted(mat)
    paths = {}
    for i in range(len(nodes.count)):
        paths[i] = tuple(mat[nodes.row[i], : nodes.depth[i] + 1].tolist())
    assert {paths[i]: int(nodes.count[i]) for i in paths} == {(4,): 3, (7,): 1, (4, 2): 2, (4, 9): 1}
    keep = select_nodes(nodes.count, nodes.depth, 3)
    assert {paths[int(i)] for i in keep} == {(4,), (4, 2), (7,)}


def test_merging_shards_equals_retrieving_from_their_union() -> None:
    rng = np.random.default_rng(7)
    shards = [random_corpus(rng, 10, vocab=3) for _ in range(3)]
    union = np.concatenate(shards)
    cfg = RetrievalConfig(c_min=1, c_max=5, max_occurrences=10_000, max_length=3, max_nodes=1000)
    indexes = [index(s) for s in shards]
    whole_index = index(union)
    for _ in range(25):
        context = rng.integers(0, 3, size=6).astype(np.int32)
        parts = [retrieve(i, SEP, context, cfg) for i in indexes]
        merged = merge(parts, cfg.max_nodes, cfg.max_candidates * 100)
        whole = retrieve(whole_index, SEP, context, cfg)
        assert merged.match_length == whole.match_length
        got = sorted((c.tokens, c.counts) for c in merged.candidates)
        assert got == sorted((c.tokens, c.counts) for c in whole.candidates)


def test_merge_keeps_the_top_nodes_of_the_summed_counts() -> None:
    a = Retrieval((Candidate((1, 2), (5, 3)), Candidate((4,), (2,))), 2, 7, 7)
    b = Retrieval((Candidate((1, 5), (4, 4)),), 2, 4, 4)
    shorter = Retrieval((Candidate((9,), (50,)),), 1, 50, 50)
    merged = merge([a, b, shorter], max_nodes=3, max_candidates=8)
    assert merged.match_length == 2
    assert [(c.tokens, c.counts) for c in merged.candidates] == [((1, 5), (9, 4)), ((1, 2), (9, 3))]


def test_longest_suffix_match_binary_search() -> None:
    tokens = np.array([1, 2, 3, 4, SEP, 2, 3, 4, 5, SEP], dtype=np.int32)
    idx = index(tokens)
    c, lo, hi = idx.longest_suffix_match(np.array([0, 1, 2, 3, 4]), 1, 16)
    assert c == 4 and idx.positions(np.arange(lo, hi)).tolist() == [0]
    assert idx.longest_suffix_match(np.array([7]), 1, 16) == (0, 0, 0)


def test_a_context_token_at_the_separator_never_matches_across_documents() -> None:
    """The separator (or an id above it) in a context is no document's token: the match starts
    after it, never across a document boundary into the next document."""
    tokens = np.array([1, 2, SEP, 3, 4, SEP], dtype=np.int32)
    idx = index(tokens)
    assert idx.longest_suffix_match(np.array([2, SEP, 3]), 1, 16, SEP) == (1, *idx.find_range(np.array([3])))
    assert idx.longest_suffix_match(np.array([2, SEP + 1, 3]), 1, 16, SEP)[0] == 1
    got = retrieve(idx, SEP, np.array([2, SEP, 3]), RetrievalConfig(max_length=4))
    assert got.match_length == 1 and [c.tokens for c in got.candidates] == [(4,)]


def test_wide_vocabularies_use_four_byte_tokens() -> None:
    tokens = np.array([70000, 5, 70000, 6, 100000], dtype=np.int64)
    idx = SuffixIndex.build(tokens, 100000)
    assert idx.width == 4
    lo, hi = idx.find_range(np.array([70000]))
    assert sorted(idx.positions(np.arange(lo, hi)).tolist()) == [0, 2]


def test_sample_range_is_evenly_spaced_without_repeats() -> None:
    rng = np.random.default_rng(0)
    for _ in range(3000):
        lo = int(rng.integers(0, 10**7))
        n = int(rng.integers(1, 400))
        hi = lo + int(rng.integers(0, 5 * n if rng.random() < 0.7 else 10**6))
        got = sample_range(lo, hi, n)
        if hi - lo <= n:
            assert got.tolist() == list(range(lo, hi))
        else:  # within half a step of the evenly spaced points, ends exact, no repeats
            ideal = np.linspace(lo, hi - 1, n)
            assert len(got) == n and (np.diff(got) > 0).all()
            assert got[0] == lo and (got[-1] == hi - 1 or n == 1)
            assert (np.abs(got - ideal) <= 0.5 + 1e-6).all()


def test_continuation_matrix_stops_at_separators_and_the_end() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, SEP + 1, size=50).astype(np.int32)  # no trailing separator
    starts = np.arange(len(tokens), dtype=np.int64)
    got = continuation_matrix(tokens.astype(">u2"), starts, 6, SEP)
    for s, row in zip(starts.tolist(), got.tolist(), strict=True):
        expected = []
        for t in tokens[s : s + 6].tolist():
            if t >= SEP:
                break
            expected.append(t)
        assert row == expected + [PAD] * (6 - len(expected))


def brute_trie(mat: np.ndarray) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every non-PAD prefix of the rows: (count of rows starting with it, first such row)."""
    nodes: dict[tuple[int, ...], tuple[int, int]] = {}
    for i, row in enumerate(mat.tolist()):
        for d in range(len(row)):
            if row[d] == PAD:
                break
            count, first = nodes.get(tuple(row[: d + 1]), (0, i))
            nodes[tuple(row[: d + 1])] = (count + 1, first)
    return nodes


@pytest.mark.parametrize("seed", range(6))
def test_trie_of_sorted_equals_a_dict_trie(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, length = int(rng.integers(1, 40)), int(rng.integers(1, 7))
        mat = rng.integers(0, 3, size=(n, length))
        ends = rng.integers(0, length + 1, size=n)  # continuations end early (PAD after)
        mat[np.arange(length)[None, :] >= ends[:, None]] = PAD
        mat = np.array(sorted(mat.tolist()), dtype=np.int64)
        nodes = trie_of_sorted(mat)
        paths = [tuple(mat[r, : d + 1].tolist()) for r, d in zip(nodes.row, nodes.depth, strict=True)]
        expected = brute_trie(mat)
        assert {
            p: (int(c), int(r)) for p, c, r in zip(paths, nodes.count, nodes.row, strict=True)
        } == expected
        assert len(paths) == len(expected)
        ids = np.arange(len(paths))
        parents = nodes.parents(ids).tolist()
        assert [paths[q] if q >= 0 else () for q in parents] == [p[:-1] for p in paths]
        for i, row in enumerate(mat.tolist()):  # the node holding each non-PAD cell
            for d in range(length):
                if row[d] != PAD:
                    assert paths[nodes.holder[d, i]] == tuple(row[: d + 1])


def test_longest_suffix_match_skips_tokens_the_index_cannot_hold() -> None:
    tokens = np.array([1, 2, 3, 4, SEP, 2, 3, 4, 5, SEP], dtype=np.int32)
    idx = index(tokens)
    for bad in (-1, 2**16, 2**40):
        c, lo, hi = idx.longest_suffix_match(np.array([1, 2, bad, 3, 4]), 1, 16)
        assert c == 2 and sorted(idx.positions(np.arange(lo, hi)).tolist()) == [2, 6]
        assert idx.longest_suffix_match(np.array([3, 4, bad]), 1, 16) == (0, 0, 0)
    assert idx.longest_suffix_match(np.array([], dtype=np.int64), 1, 16) == (0, 0, 0)


def test_context_retrieval_is_prompt_lookup_through_the_trie() -> None:
    from datastore_svc.retrieval import context_retrieval

    cfg = RetrievalConfig(max_length=2)
    res = context_retrieval(np.array([1, 2, 3, 1, 2]), 10, cfg)
    assert res.match_length == 2 and [c.tokens for c in res.candidates] == [(3, 1)]
    assert context_retrieval(np.array([5]), 10, cfg).candidates == ()
    assert context_retrieval(np.array([1, 2, 3]), 10, cfg).match_length == 0  # nothing repeats


def test_fused_context_weighs_as_much_as_the_corpus_sample() -> None:
    from datastore_svc.retrieval import Candidate, Retrieval, fuse_context

    corpus = Retrieval((Candidate((4, 2), (30, 15)), Candidate((7,), (10,))), 3, 40, 40)
    own = Retrieval((Candidate((7, 8), (2, 1)),), 6, 2, 2)  # the context: 2 continuations, both 7
    fused = fuse_context(corpus, own, max_nodes=3, max_candidates=8)
    # context counts scaled by 40 / 2: (7,) 10 + 40 = 50, (7, 8) 20; (4,) 30, (4, 2) 15 → top 3 nodes;
    # leaves most frequent first
    assert [(c.tokens, c.counts) for c in fused.candidates] == [((4,), (30,)), ((7, 8), (50, 20))]
    assert fused.match_length == 6
    empty = Retrieval((), 0, 0, 0)
    assert fuse_context(corpus, empty, 3, 8) is corpus and fuse_context(empty, own, 3, 8) is own


def test_small_arrays_sort_on_token_ranks_with_the_same_suffix_array() -> None:
    import pydivsufsort

    from datastore_svc.suffix import build_suffix_array

    rng = np.random.default_rng(3)
    for n in (1, 2, 40, 3000):
        tokens = rng.integers(0, 49_152, size=n).astype(np.int32)
        tokens[::5] = 7  # repeats
        assert np.array_equal(build_suffix_array(tokens), np.asarray(pydivsufsort.divsufsort(tokens)))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=60),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(1, 5),
)
def test_context_retrieval_equals_the_suffix_array_search(
    context: list[int], c_max: int, c_min: int, length: int
) -> None:
    """Without a suffix array (a vectorised scan: the context changes every step), the same
    candidates, counts and match as indexing the context and searching it."""
    from datastore_svc.retrieval import context_retrieval, suffix_occurrences

    cfg = RetrievalConfig(c_min=min(c_min, c_max), c_max=c_max, max_length=length, max_nodes=16)
    tokens = np.array(context)
    body = tokens[:-1]
    reference = NO_MATCH
    if len(body):
        reference = retrieve(SuffixIndex.build(np.append(body, SEP), SEP), SEP, tokens[-c_max:], cfg)
    assert context_retrieval(tokens, SEP, cfg) == reference
    pattern = tokens[-c_max:]  # brute force: the longest suffix of the pattern found in the body
    ends, c = suffix_occurrences(body, pattern, cfg.c_min)
    found = [
        k
        for k in range(cfg.c_min, len(pattern) + 1)
        if any((body[j - k + 1 : j + 1] == pattern[-k:]).all() for j in range(k - 1, len(body)))
    ]
    assert c == (max(found) if found else 0)
    if c:
        expected = [j for j in range(c - 1, len(body)) if (body[j - c + 1 : j + 1] == pattern[-c:]).all()]
        assert ends.tolist() == expected
