"""``suffix`` mode: its suffix structure against brute-force counts, incremental growth against a
rebuild, eviction under a memory bound, tenant isolation, and the engine drafting a repeated
request from the first one's answer. Greedy and sampling identical to ``ar``: test_lossless_tiny.py
and test_lossless_real.py, with every mode."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.models import CPU_LIKE_CURVE, engine_for, prompts, tiny_target
from llm_worker.drafters import DRAFTERS, DraftContext, DraftResources, RequestState, UnknownModeError
from llm_worker.drafters.suffix_tree import SuffixStore, SuffixTrie, grow
from llm_worker.engine import GenerationRequest
from llm_worker.types import NO_SOURCE

sequences = st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=6)


def brute_counts(seqs: Sequence[Sequence[int]], depth: int) -> Counter[tuple[int, ...]]:
    """Occurrences of every string of 1 .. depth tokens, by scanning every position."""
    counts: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i : i + n])] += 1
    return counts


def assert_equals_brute_force(trie: SuffixTrie, seqs: Sequence[Sequence[int]]) -> None:
    counts = brute_counts(seqs, trie.depth)
    for pattern, n in counts.items():
        assert trie.count(pattern) == n, pattern
        if len(pattern) < trie.depth:
            cursor = trie.find(pattern)
            assert cursor is not None
            seen = {c.token: c.count for c in trie.continuations(cursor)}
            longer = [(p, m) for p, m in counts.items() if len(p) == len(pattern) + 1]
            expected = {p[-1]: m for p, m in longer if p[:-1] == pattern}
            assert seen == expected, pattern
    for pattern in [(0, 1, 2, 3), (3, 3, 3), (2,), (1, 0, 1, 0, 1)]:
        assert trie.count(pattern[: trie.depth]) == counts.get(pattern[: trie.depth], 0)
    built = sum(1 for p in counts if len(p) <= trie.depth)
    assert trie.nodes <= built  # lazily built: never more nodes than strings


@settings(max_examples=150, deadline=None)
@given(seqs=sequences, depth=st.integers(1, 6), chunk=st.integers(1, 5))
def test_counts_and_continuations_equal_brute_force(seqs: list[list[int]], depth: int, chunk: int) -> None:
    trie = SuffixTrie(depth)
    for i, s in enumerate(seqs):
        for lo in range(0, len(s), chunk):  # appended a few tokens at a time, as tokens commit
            trie.append(i, s[lo : lo + chunk])
        trie.close(i)
    assert_equals_brute_force(trie, seqs)


@settings(max_examples=100, deadline=None)
@given(seqs=sequences, depth=st.integers(1, 6), order=st.randoms(use_true_random=False))
def test_removing_sequences_leaves_the_trie_of_the_others(seqs: list[list[int]], depth: int, order) -> None:
    trie = SuffixTrie(depth)
    for i, s in enumerate(seqs):
        trie.append(i, s)
    alive = dict(enumerate(seqs))
    for i in order.sample(list(alive), len(alive)):
        trie.remove(i)
        del alive[i]
        assert_equals_brute_force(trie, list(alive.values()))
    assert trie.nodes == 0 and trie.count([0]) == trie.count([1]) == 0


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1, max_size=3))))
def test_interleaved_growth_equals_a_rebuild(steps: list[tuple[int, list[int]]]) -> None:
    """Sequences growing in turn (a request's own text as it commits) give the trie a rebuild of
    the final sequences gives."""
    grown, texts = SuffixTrie(4), {0: [], 1: [], 2: []}
    for seq, tokens in steps:
        grown.append(seq, tokens)
        texts[seq] += tokens
    rebuilt = SuffixTrie(4)
    for seq, text in texts.items():
        rebuilt.append(seq, text)
    for pattern in brute_counts(list(texts.values()), 4):
        assert grown.count(pattern) == rebuilt.count(pattern)
    assert_equals_brute_force(grown, list(texts.values()))


def brute_match(seqs: Sequence[Sequence[int]], depth: int, context: Sequence[int], longest: int) -> int:
    """The longest suffix of ``context`` (at most ``longest``, shorter than ``depth``) that some
    sequence holds followed by a token, by scanning: its length (0: none)."""
    counts = brute_counts(seqs, depth)
    for m in range(min(longest, depth - 1, len(context)), 0, -1):
        suffix = tuple(context[len(context) - m :])
        if any(p[:-1] == suffix for p in counts if len(p) == m + 1):
            return m
    return 0


@settings(max_examples=200, deadline=None)
@given(
    seqs=sequences,
    depth=st.integers(2, 8),
    context=st.lists(st.integers(0, 3), max_size=12),
    longest=st.integers(1, 10),
)
def test_match_equals_brute_force(
    seqs: list[list[int]], depth: int, context: list[int], longest: int
) -> None:
    trie = SuffixTrie(depth)
    for i, s in enumerate(seqs):
        trie.append(i, s)
    found = trie.match(context, longest)
    m = brute_match(seqs, depth, context, longest)
    assert (found[1] if found is not None else 0) == m
    if found is not None:
        assert found[0] == trie.find(context[len(context) - m :])


def test_match_and_grow() -> None:
    trie = SuffixTrie(8)
    trie.append(0, [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7, 1, 5, 8])
    found = trie.match([9, 9, 5, 6], longest=4)
    assert found is not None and found[1] == 2  # [5, 6] occurred, [9, 5, 6] never
    tree = grow(trie, found[0], max_nodes=3, min_probability=0.1)
    # after [5, 6]: 7 three times; after [5, 6, 7]: 1 twice, 2 once; after [5, 6, 7, 1]: 5 twice
    assert tree.tokens == (7, 1, 5) and tree.parents == (-1, 0, 1)
    assert tree.probabilities == pytest.approx((1.0, 2 / 3, 2 / 3))
    assert tree.score == pytest.approx(7 / 3)
    wider = grow(trie, found[0], max_nodes=5, min_probability=0.1)
    # then three at 1/3 (2 after [5, 6, 7]; 6 and 8 after [5, 6, 7, 1, 5]): two of them
    assert wider.tokens[:3] == (7, 1, 5) and set(wider.tokens[3:]) < {2, 6, 8}
    assert wider.probabilities == pytest.approx((1.0, 2 / 3, 2 / 3, 1 / 3, 1 / 3))
    assert grow(trie, found[0], max_nodes=3, min_probability=0.7).tokens == (7,)
    assert trie.match([4, 4], longest=4) is None


def test_the_store_evicts_the_oldest_under_its_bound() -> None:
    store = SuffixStore(max_tokens=30, depth=6, prompt_tokens=0)
    rng = np.random.default_rng(0)
    kept: list[tuple[str, list[int]]] = []
    for i in range(40):
        tenant = "ab"[i % 2]
        output = rng.integers(0, 5, size=int(rng.integers(1, 12))).tolist()
        store.add(tenant, [99, 98, *output], prompt_length=2)
        kept.append((tenant, output))
        while sum(len(o) for _, o in kept) > 30:
            kept.pop(0)
        assert store.tokens == sum(len(o) for _, o in kept) <= 30
        for tenant in "ab":
            mine = [o for t, o in kept if t == tenant]
            trie = store.trie(tenant)
            if not mine:
                assert trie is None
                continue
            assert trie is not None
            assert_equals_brute_force(trie, mine)
    store.add("c", list(range(100)), prompt_length=0)  # longer than the bound: its last 30 tokens
    assert store.tenants() == ["c"] and store.tokens == 30 and store.trie("c").count([70]) == 1  # type: ignore[union-attr]


def test_the_store_keeps_the_end_of_each_prompt() -> None:
    store = SuffixStore(depth=4, prompt_tokens=2)
    store.add("", [1, 2, 3, 4, 5, 6], prompt_length=4)  # prompt 1 2 3 4, output 5 6
    trie = store.trie("")
    assert trie is not None and trie.count([3, 4, 5, 6]) == 1 and trie.count([2]) == 0
    whole = SuffixStore(depth=4, prompt_tokens=-1)
    whole.add("", [1, 2, 3, 4, 5, 6], prompt_length=4)
    assert whole.trie("").count([1, 2]) == 1  # type: ignore[union-attr]


def drafter_for(resources: DraftResources, mode: str = "suffix"):
    return DRAFTERS.create(mode, tiny_target(), resources)


def test_a_tenant_never_drafts_from_another_tenants_text() -> None:
    resources = DraftResources()
    drafter = drafter_for(resources)
    secret = [40, 41, 42, 43, 44, 45, 46, 47]
    drafter.finish(RequestState(tenant="a"), np.array([1, 2, 3, *secret]), 3)
    ctx_a = DraftContext(np.array([9, 40, 41, 42]), 8, request_state=RequestState(tenant="a"))
    tree = drafter.propose(ctx_a)
    assert tree.tokens[:3] == (43, 44, 45) and set(tree.sources) == {NO_SOURCE}
    for tenant in ("b", "", "a/"):
        state = RequestState(tenant=tenant)
        tree = drafter.propose(DraftContext(np.array([9, 40, 41, 42]), 8, request_state=state))
        assert not set(tree.tokens) & set(secret[3:]), tenant  # nothing only a's text holds
    # the request's own text drafts with provenance: positions of its own context
    own = np.array([7, 40, 41, 42, 50, 51, 8, 40, 41, 42])
    tree = drafter.propose(DraftContext(own, 8, request_state=RequestState(tenant="b")))
    assert tree.tokens[:2] == (50, 51) and tree.sources[:2] == (4, 5)


def test_every_spelling_shares_the_store_and_options_are_checked() -> None:
    resources = DraftResources()
    one, other = drafter_for(resources), drafter_for(resources, "suffix:match=8:factor=2:min_p=0.2")
    one.finish(RequestState(), np.array([1, 2, 3, 4, 5, 6, 7]), 0)
    tree = other.propose(DraftContext(np.array([9, 2, 3]), 8))
    assert tree.tokens == (4, 5, 6, 7) and all(f.startswith("suffix:global:m2") for f in tree.features)
    for bad in ("suffix:match=0", "suffix:factor=nan", "suffix:min_p=2", "suffix:depth=3"):
        with pytest.raises(UnknownModeError):
            drafter_for(resources, bad)


def test_a_repeated_request_drafts_from_the_first_answer() -> None:
    target = tiny_target()
    engine = engine_for(target, CPU_LIKE_CURVE)
    prompt = tuple(prompts(target.info.vocab_size)[1])  # random: little to copy from the prompt
    ar = engine.generate(GenerationRequest(prompt, 64, "ar")).token_ids
    first = engine.generate(GenerationRequest(prompt, 64, "suffix"))
    again = engine.generate(GenerationRequest(prompt, 64, "suffix:factor=4"))  # another spelling
    other = engine.generate(GenerationRequest(prompt, 64, "suffix", tenant="elsewhere"))
    assert first.token_ids == again.token_ids == other.token_ids == ar
    assert again.stats.tau > 2 * first.stats.tau and again.stats.tau > 4
    assert other.stats.tau < again.stats.tau / 2  # another tenant learned nothing from it


def test_benchmark_modes_learn_only_from_their_own_outputs() -> None:
    """``specdraft bench`` runs every mode on the same questions: each mode is its own tenant, so
    ``suffix`` never drafts the answer that ``fuse`` (which shares the store) gave just before."""
    from client.bench.runners import engine_runner

    target = tiny_target()
    engine = engine_for(target, CPU_LIKE_CURVE)
    prompt = list(prompts(target.info.vocab_size)[1])
    fused = engine_runner(engine, "fuse")(prompt, 64)
    alone = engine_runner(engine, "suffix")(prompt, 64)
    again = engine_runner(engine, "suffix")(prompt, 64)
    assert fused.token_ids == alone.token_ids == again.token_ids
    taus = [len(o.token_ids) / o.target_forwards for o in (alone, again)]
    assert taus[1] > 2 * taus[0]  # its own first answer drafts the second, fuse's did not draft the first
