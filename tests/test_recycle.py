"""``recycle`` (Token Recycling): the matrix update and the template's tree against brute force,
tenants kept apart, eviction under the store's bound, and the mode on tiny and real models."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.models import (
    CPU_LIKE_CURVE,
    FLAT_CURVE,
    assert_greedy_identical,
    chat_ids,
    engine_for,
    tiny_target,
)
from llm_worker.config import SamplingParams
from llm_worker.drafters import DRAFTERS, DraftContext, DraftResources
from llm_worker.drafters.base import RequestState
from llm_worker.drafters.recycle import RecycleDrafter, TreeTemplate, best_paths, expand
from llm_worker.drafters.recycle_store import EMPTY, RecycleStore, TenantMatrix, update_matrix
from llm_worker.engine import GenerationRequest
from llm_worker.types import NO_SOURCE, DraftTree

VOCAB = 12


def brute_update(matrix: TenantMatrix, inputs: list[int], candidates: list[list[int]], clock: int) -> None:
    """Row by row, last row first, so that a token's first row is written last and wins."""
    vocab, k = matrix.next.shape
    for token, row in reversed(list(zip(inputs, candidates, strict=True))):
        for j, c in enumerate(row[:k]):
            matrix.next[token, j] = c if 0 <= c < vocab else EMPTY
        matrix.written[token] = clock


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, VOCAB - 1), st.lists(st.integers(-1, VOCAB + 2), min_size=3, max_size=3)),
        min_size=1,
        max_size=10,
    ),
    k=st.integers(1, 4),
)
def test_matrix_update_matches_writing_row_by_row(rows: list[tuple[int, list[int]]], k: int) -> None:
    inputs = [t for t, _ in rows]
    candidates = [c for _, c in rows]
    fast, slow = TenantMatrix.empty(VOCAB, k), TenantMatrix.empty(VOCAB, k)
    fast.next[3], slow.next[3] = 7, 7  # an older row, kept unless written
    update_matrix(fast, np.array(inputs), np.array(candidates), clock=5)
    brute_update(slow, inputs, candidates, clock=5)
    np.testing.assert_array_equal(fast.next, slow.next)
    np.testing.assert_array_equal(fast.written, slow.written)


def test_matrix_update_example() -> None:
    m = TenantMatrix.empty(10, 2)
    update_matrix(m, np.array([5, 9, 5]), np.array([[1, 2], [3, 4], [6, 7]]), clock=1)
    assert m.next[5].tolist() == [1, 2] and m.next[9].tolist() == [3, 4]
    assert m.written[[5, 9, 0]].tolist() == [1, 1, -1]


def test_best_paths() -> None:
    assert best_paths((0.5, 0.2), 4, 3) == [(0,), (0, 0), (1,), (0, 0, 0)]
    paths = best_paths((0.42, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01), 80, 6)
    assert len(paths) == 80 and max(map(len, paths)) == 6
    assert all(p[:-1] in paths for p in paths if len(p) > 1)  # closed under parents
    assert (0, 0, 0, 0, 0, 0) in paths and (7,) in paths  # the likeliest branch deepest
    template = TreeTemplate.from_paths([(0,), (1,), (0, 0)])
    assert template.parent.tolist() == [0, 0, 1] and template.rank.tolist() == [0, 1, 0]
    assert template.levels == ((0, 2), (2, 3))
    with pytest.raises(ValueError, match="without its parent"):
        TreeTemplate.from_paths([(0,), (1, 0)])


def brute_tree(rows: np.ndarray, root: int, paths: list[tuple[int, ...]], max_depth: int) -> DraftTree:
    """Grow every template path recursively from the root: a node exists where its parent does
    and its parent's row has an entry at its rank."""
    nodes: dict[tuple[int, ...], int] = {}  # path → token

    def grow(path: tuple[int, ...], token: int) -> None:
        for child in sorted(p for p in paths if len(p) == len(path) + 1 and p[:-1] == path):
            if len(child) <= max_depth and rows[token, child[-1]] != EMPTY:
                nodes[child] = int(rows[token, child[-1]])
                grow(child, nodes[child])

    grow((), root)
    order = sorted(nodes, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(order)}
    return DraftTree(tuple(nodes[p] for p in order), tuple(index.get(p[:-1], -1) for p in order))


@st.composite
def matrices(draw: st.DrawFn) -> np.ndarray:
    """[VOCAB, 4]: each row a distinct top-4 (a permutation's head) or empty, some columns cut."""
    rows = np.full((VOCAB, 4), EMPTY, dtype=np.int32)
    for t in range(VOCAB):
        if draw(st.booleans()):
            perm = draw(st.permutations(range(VOCAB)))
            width = draw(st.integers(1, 4))
            rows[t, :width] = perm[:width]
    return rows


@settings(max_examples=150, deadline=None)
@given(
    rows=matrices(),
    root=st.integers(0, VOCAB - 1),
    accept=st.lists(st.floats(0.05, 0.9), min_size=4, max_size=4),
    nodes=st.integers(1, 40),
    depth=st.integers(1, 6),
    max_depth=st.integers(1, 7),
)
def test_tree_from_the_template_matches_a_recursive_expansion(
    rows: np.ndarray, root: int, accept: list[float], nodes: int, depth: int, max_depth: int
) -> None:
    paths = best_paths(tuple(accept), nodes, depth)
    template = TreeTemplate.from_paths(paths)
    tokens, parents, kept = expand(rows, root, template, max_depth)
    tree = DraftTree(tuple(tokens.tolist()), tuple(parents.tolist()))  # checks parents come first
    assert tree == brute_tree(rows, root, paths, max_depth)
    assert [template.paths[i][-1] for i in kept] == template.rank[kept].tolist()
    children: dict[int, list[int]] = {}
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        children.setdefault(parent, []).append(token)
    assert all(len(set(c)) == len(c) for c in children.values())  # siblings distinct


def propose(drafter: RecycleDrafter, tenant: str, tokens: list[int], budget: int = 16) -> DraftTree:
    ctx = DraftContext(np.array(tokens), budget, request_state=RequestState(tenant=tenant))
    return drafter.propose(ctx)


def make_drafter(store: RecycleStore) -> RecycleDrafter:
    return RecycleDrafter(store, VOCAB, TreeTemplate.from_paths(best_paths((0.5, 0.3, 0.1, 0.1), 20, 4)))


def test_a_tenant_drafts_from_its_own_matrix_only() -> None:
    store = RecycleStore(k=4)
    drafter = make_drafter(store)
    every = np.arange(VOCAB)
    store.observe("a", VOCAB, every, np.tile([8, 9, 10, 11], (VOCAB, 1)))  # a's rows: 8..11 only
    assert len(propose(drafter, "a", [1, 2, 3]))
    assert propose(drafter, "b", [1, 2, 3]) == DraftTree.empty()  # b has no matrix: nothing
    store.observe("b", VOCAB, every, np.tile([0, 1, 2, 3], (VOCAB, 1)))  # b's rows: 0..3 only
    for root in range(VOCAB):
        for tenant, allowed in (("a", {8, 9, 10, 11}), ("b", {0, 1, 2, 3})):
            tree = propose(drafter, tenant, [5, root])
            assert len(tree) and set(tree.tokens) <= allowed, (tenant, root)
            assert all(tree.source(i) == NO_SOURCE for i in range(len(tree)))  # no provenance


def test_a_root_outside_the_matrix_drafts_nothing() -> None:
    store = RecycleStore(k=4)
    store.observe("", VOCAB, np.arange(VOCAB), np.tile([1, 2, 3, 4], (VOCAB, 1)))
    assert propose(make_drafter(store), "", [1, VOCAB + 3]) == DraftTree.empty()


def test_features_say_rank_and_whether_the_row_is_new() -> None:
    store = RecycleStore(k=4)
    drafter = make_drafter(store)
    store.observe("", VOCAB, np.array([1]), np.array([[2, 3, 4, 5]]))
    state = RequestState()
    ctx = DraftContext(np.array([0, 1]), 16, request_state=state)
    assert drafter.propose(ctx).features == ("tr:r0:old", "tr:r1:old", "tr:r2:old", "tr:r3:old")
    drafter.observe_candidates(state, np.array([1]), np.array([[2, 3, 4, 5]]))
    assert drafter.propose(ctx).features == ("tr:r0:new", "tr:r1:new", "tr:r2:new", "tr:r3:new")


def test_the_store_evicts_the_least_recently_used_tenant() -> None:
    store = RecycleStore(max_tenants=2, k=4)
    drafter = make_drafter(store)
    row = np.array([[2, 3, 4, 5]])
    store.observe("a", VOCAB, np.array([1]), row)
    store.observe("b", VOCAB, np.array([1]), row)
    assert store.get("a") is not None  # a is now the most recently used
    store.observe("c", VOCAB, np.array([1]), row)
    assert store.tenants() == ["a", "c"] and store.evictions == 1
    assert propose(drafter, "b", [0, 1]) == DraftTree.empty()  # evicted: drafts nothing, never fails
    store.observe("b", VOCAB, np.array([1]), row)  # and starts again, empty but for this row
    assert store.get("b").next[2].tolist() == [EMPTY] * 4  # type: ignore[union-attr]
    assert store.tenants() == ["c", "b"]
    assert store.nbytes == 2 * VOCAB * (4 * 4 + 8)


def test_mode_strings_share_one_store() -> None:
    target = tiny_target()
    resources = DraftResources(recycling=RecycleStore(max_tenants=3))
    a = DRAFTERS.create("recycle", target, resources)
    b = DRAFTERS.create("recycle:nodes=80:depth=6", target, resources)
    assert isinstance(a, RecycleDrafter) and isinstance(b, RecycleDrafter)
    assert a.store is b.store and a.candidates == 8 and len(b.template) == 80


@pytest.mark.parametrize("curve", [FLAT_CURVE, CPU_LIKE_CURVE], ids=["flat", "cpu"])
def test_the_mode_drafts_and_accepts_after_warm_up(curve: object) -> None:
    target = tiny_target()
    engine = engine_for(target, curve)  # type: ignore[arg-type]
    prompt = (5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7)
    ref = engine.generate(GenerationRequest(prompt, 48, "ar")).token_ids
    first = engine.generate(GenerationRequest(prompt, 48, "recycle", tenant="t"))
    again = engine.generate(GenerationRequest(prompt, 48, "recycle", tenant="t"))
    assert first.token_ids == ref and again.token_ids == ref
    assert again.stats.accepted_tokens > 0 and again.stats.tau > 1.2
    assert again.stats.target_forwards < first.stats.target_forwards  # the matrix warmed up
    other = engine.generate(GenerationRequest(prompt, 48, "recycle", tenant="u"))
    assert other.token_ids == ref and other.stats.target_forwards > again.stats.target_forwards


def test_seeded_sampling_equals_ar() -> None:
    target = tiny_target()
    engine = engine_for(target, FLAT_CURVE)
    accepted = 0
    for seed in range(4):
        params = SamplingParams(temperature=0.7, seed=seed)
        prompt = (3, 4, 5, 3, 4, 5, 3)
        ref = engine.generate(GenerationRequest(prompt, 40, "ar", params)).token_ids
        res = engine.generate(GenerationRequest(prompt, 40, "recycle", params))
        assert res.token_ids == ref, seed
        accepted += res.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.slow
def test_greedy_on_the_real_model_equals_ar(real_model) -> None:
    target, tokenizer = real_model
    # its own engine, with a flat cost curve: the session's shared engine may have learned that
    # recycle's drafts do not pay on this CPU, and would then verify none
    real_engine = engine_for(target, FLAT_CURVE)
    texts = ["Write a short story about a fox and a dog.", "Explain what a hash table is to a child."]
    accepted = 0
    for text in texts * 2:  # the second round drafts from the first's matrix
        prompt = chat_ids(tokenizer, text)
        ref = real_engine.generate(GenerationRequest(tuple(prompt), 48, "ar", stop_at_eos=False)).token_ids
        res = real_engine.generate(GenerationRequest(tuple(prompt), 48, "recycle", stop_at_eos=False))
        assert_greedy_identical(target, prompt, ref, res.token_ids, f"recycle/{text}")
        accepted += res.stats.accepted_tokens
    assert accepted > 0
