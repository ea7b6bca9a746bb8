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
from llm_worker.drafters.recycle_store import (
    CONTEXT_ORDERS,
    EMPTY,
    RecycleStore,
    TenantMatrix,
    packed_keys,
    slot_of,
    update_matrix,
)
from llm_worker.engine import GenerationRequest
from llm_worker.types import NO_SOURCE, DraftTree, ForwardCandidates

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


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(-1, 3), min_size=3, max_size=3),
            st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=2),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_context_rows_keep_the_first_row_of_a_context_in_one_forward(
    rows: list[tuple[list[int], list[int]]],
) -> None:
    """Contexts over a 4-token alphabet (-1: not known), so that one forward repeats them."""
    contexts = [[-1] * (c.index(-1) + 1) + c[c.index(-1) + 1 :] if -1 in c else c for c, _ in rows]
    candidates = np.array([r for _, r in rows])
    matrix = TenantMatrix.empty(VOCAB, 2)
    update_matrix(matrix, np.array([c[-1] for c in contexts]), candidates, 3, contexts)
    first: dict[tuple[int, ...], list[int]] = {}
    for context, (_, row) in zip(contexts, rows, strict=True):
        if context[-1] < 0:
            continue
        for order in CONTEXT_ORDERS:
            key = tuple(context[-order:])
            if -1 not in key:
                first.setdefault(key, row)
    slots = {slot_of(packed_keys(list(k))[-1][1], len(matrix.context_key)) for k in first}
    if len(slots) < len(first):
        return  # two contexts on one slot (tested on its own)
    for key, row in first.items():
        found, order, when = matrix.row(list(key))
        assert (found.tolist(), order, when) == (row, len(key), 3)


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


def brute_tree(
    rows: np.ndarray,
    context: list[int],
    paths: list[tuple[int, ...]],
    max_depth: int,
    written: dict[tuple[int, ...], list[int]] | None = None,
) -> DraftTree:
    """Grow every template path recursively from the root (``context[-1]``): a node exists where
    its parent does and the row of its parent's context has an entry at its rank. A context's
    row: ``written``'s row of the longest of its last 3 and 2 tokens, else its last token's row."""
    written = written or {}
    nodes: dict[tuple[int, ...], int] = {}  # path → token

    def row_of(text: list[int]) -> list[int]:
        for order in sorted(CONTEXT_ORDERS, reverse=True):
            if len(text) >= order and tuple(text[-order:]) in written:
                return written[tuple(text[-order:])]
        return rows[text[-1]].tolist()

    def grow(path: tuple[int, ...], text: list[int]) -> None:
        row = row_of(text)
        for child in sorted(p for p in paths if len(p) == len(path) + 1 and p[:-1] == path):
            if len(child) <= max_depth and row[child[-1]] != EMPTY:
                nodes[child] = int(row[child[-1]])
                grow(child, [*text, nodes[child]])

    grow((), list(context))
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
    matrix = TenantMatrix.empty(VOCAB, 4, slots=16)
    matrix.next[:] = rows
    grown = expand(matrix, np.array([root]), template, max_depth)
    tree = DraftTree(tuple(grown.tokens.tolist()), tuple(grown.parents.tolist()))  # checks parents come first
    assert tree == brute_tree(rows, [root], paths, max_depth)
    assert [template.paths[i][-1] for i in grown.kept] == template.rank[grown.kept].tolist()
    assert (grown.order == 1).all()  # no context rows: every node from a one-token row
    children: dict[int, list[int]] = {}
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        children.setdefault(parent, []).append(token)
    assert all(len(set(c)) == len(c) for c in children.values())  # siblings distinct


@settings(max_examples=150, deadline=None)
@given(
    rows=matrices(),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    writes=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=2, max_size=3),
            st.permutations(range(VOCAB)).map(lambda p: list(p[:4])),
        ),
        max_size=12,
    ),
    max_depth=st.integers(1, 5),
)
def test_context_rows_win_over_one_token_rows_as_a_recursive_expansion(
    rows: np.ndarray, context: list[int], writes: list[tuple[list[int], list[int]]], max_depth: int
) -> None:
    """Contexts over a 4-token alphabet, so that branches meet written contexts often."""
    matrix = TenantMatrix.empty(VOCAB, 4)
    matrix.next[:] = rows
    written: dict[tuple[int, ...], list[int]] = {}
    rows = rows.copy()  # what the one-token rows become
    for clock, (text, row) in enumerate(writes):
        keys = np.array([[-1] * (3 - len(text)) + text])
        update_matrix(matrix, np.array(text[-1:]), np.array([row]), clock, keys)
        written[tuple(text)] = row
        written[tuple(text[-2:])] = row  # a 3-token context also writes its 2-token one
        rows[text[-1]] = row  # and its last token's row
    slots = {slot_of(packed_keys(k)[-1][1], len(matrix.context_key)) for k in written}
    if len(slots) < len(written):
        return  # two contexts on one slot: the table keeps one (tested below)
    paths = best_paths((0.5, 0.3, 0.1, 0.1), 30, 5)
    template = TreeTemplate.from_paths(paths)
    grown = expand(matrix, np.array(context), template, max_depth)
    tree = DraftTree(tuple(grown.tokens.tolist()), tuple(grown.parents.tolist()))
    assert tree == brute_tree(rows, context, paths, max_depth, written)


def test_one_token_rows_go_on_with_the_next_row_of_a_write() -> None:
    matrix = TenantMatrix.empty(10, 2)
    rows = np.array([[1, 2], [3, 4]])
    update_matrix(matrix, np.array([5, 6]), rows, 1, np.array([[7, 8, 5], [-1, -1, 6]]))
    found = [matrix.row(c) for c in ([7, 8, 5], [0, 8, 5], [9, 9, 5], [0, 0, 6], [8, 5], [5])]
    assert [r.tolist() for r, _, _ in found] == [[1, 2]] * 3 + [[3, 4], [1, 2], [1, 2]]  # [8, 5]: its own
    assert [o for _, o, _ in found] == [3, 2, 1, 1, 2, 1]


def test_two_contexts_on_one_slot_keep_one_and_never_answer_for_each_other() -> None:
    matrix = TenantMatrix.empty(10, 2, slots=1)  # every context on the one slot
    update_matrix(matrix, np.array([5]), np.array([[1, 2]]), 1, np.array([[-1, 8, 5]]))
    update_matrix(matrix, np.array([5]), np.array([[3, 4]]), 2, np.array([[-1, 9, 5]]))
    (a, order_a, when_a), (b, order_b, when_b) = matrix.row([0, 8, 5]), matrix.row([0, 9, 5])
    assert (order_a, order_b, when_a, when_b) == (1, 2, 2, 2)  # [8, 5] was replaced
    assert a.tolist() == b.tolist() == [3, 4]  # the one-token row, also written last


def test_context_keys_are_the_tokens_packed_exactly() -> None:
    texts = [[1, 2, 3], [2, 1, 3], [0, 2, 3], [3, 2, 1]]
    keys = [packed_keys(t) for t in texts]
    assert [[order for order, _ in k] for k in keys] == [[2, 3]] * 4
    two, three = ({k[i][1] for k in keys} for i in (0, 1))
    assert len(three) == 4 and len(two) == 3 and not three & two  # [2, 3] twice
    assert packed_keys([4, 5]) == [(2, (5 << 21) | 6)] and packed_keys([5]) == []
    assert packed_keys([0, 0, 0]) == [(2, (1 << 21) | 1), (3, (1 << 42) | (1 << 21) | 1)]
    wide = (1 << 21) - 1
    assert packed_keys([-1, 2, 3]) == [(2, (3 << 21) | 4)]  # the known suffix only
    assert packed_keys([1, wide, 3]) == [] and packed_keys([1, 2, wide]) == []


def test_the_drafter_writes_each_rows_context_along_its_branch() -> None:
    store = RecycleStore(k=2, context_slots=1 << 10)
    drafter = make_drafter(store)
    tree = DraftTree((5, 6), (-1, -1))
    rows = ForwardCandidates.of_tree(np.array([7, 8]), 9, tree, np.arange(6).reshape(3, 2))
    drafter.observe_candidates(RequestState(), rows)
    matrix = store.get("")
    assert matrix is not None
    for text, row in zip(map(list, rows.contexts(3)), ([0, 1], [2, 3], [4, 5]), strict=True):
        assert text in ([7, 8, 9], [8, 9, 5], [8, 9, 6])
        found, order, _ = matrix.row(text)
        assert (found.tolist(), order) == (row, 3)


@given(
    parents=st.lists(st.integers(0, 6), min_size=0, max_size=7),
    history=st.lists(st.integers(0, 9), max_size=5),
    width=st.integers(1, 4),
)
def test_contexts_read_each_rows_branch(parents: list[int], history: list[int], width: int) -> None:
    parent_rows = [-1] + [min(p, i) for i, p in enumerate(parents)]  # row i + 1's parent: a row before it
    inputs = np.arange(100, 100 + len(parent_rows))
    rows = ForwardCandidates(
        inputs, np.array(parent_rows), np.array(history, dtype=np.int64), np.zeros((0, 1))
    )
    keys = rows.contexts(width)
    for r in range(len(parent_rows)):
        text, at = [], r
        while at >= 0:
            text.insert(0, int(inputs[at]))
            at = parent_rows[at]
        text = history + text
        expected = [-1] * max(0, width - len(text)) + text[-width:]
        assert [-1] * (width - len(keys[r])) + list(keys[r]) == expected[-width:]


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
    assert drafter.propose(ctx).features == ("tr:o1:r0:old", "tr:o1:r1:old", "tr:o1:r2:old", "tr:o1:r3:old")
    rows = ForwardCandidates(np.array([1]), np.array([-1]), np.array([0]), np.array([[2, 3, 4, 5]]))
    drafter.observe_candidates(state, rows)
    assert drafter.propose(ctx).features == ("tr:o2:r0:new", "tr:o2:r1:new", "tr:o2:r2:new", "tr:o2:r3:new")


def test_the_store_evicts_the_least_recently_used_tenant() -> None:
    store = RecycleStore(max_tenants=2, k=4, context_slots=8)
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
    assert store.nbytes == 2 * (VOCAB * (4 * 4 + 8) + 8 * (4 * 4 + 16))
    with pytest.raises(ValueError, match="power of two"):
        RecycleStore(context_slots=12)


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


def test_recycle_sizes_its_template_unless_nodes_is_given() -> None:
    """Without ``nodes``, a step grows the template its verify prices afford (24 halved while a
    tree that size costs over two plain steps); with it, the template asked for."""
    target = tiny_target("llama")
    tokens = np.arange(1, 8, dtype=np.int64)
    ctx = DraftContext(tokens, 64, request_state=RequestState(), verify_seconds=lambda n: 10.0 + n)
    sized = DRAFTERS.create("recycle", target)
    assert isinstance(sized, RecycleDrafter)
    assert len(sized.template_for(ctx).rank) == 6  # 34, 22 ms > 20; 16 ≤ 20
    assert sized.template_for(ctx) is sized.template_for(ctx)  # made once per size
    assert sized.template_for(DraftContext(tokens, 64)) is sized.template  # no prices: as configured
    fixed = DRAFTERS.create("recycle:nodes=24", target)
    assert isinstance(fixed, RecycleDrafter) and fixed.template_for(ctx) is fixed.template
    assert len(fixed.template.rank) == 24
