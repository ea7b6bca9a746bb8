"""``fuse``: the merged trie and the verdict each source hears against brute force, priors learned
per source on a fake stream, bad source lists, and the mode identical to ``ar`` (greedy and
sampled, tiny models with and without datastores, greedy on the real model)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore_svc.store import LocalRetriever
from helpers.datastores import datastore_engine, datastore_for, dense_version, own_continuations
from helpers.models import (
    CPU_LIKE_CURVE,
    FLAT_CURVE,
    DraftTally,
    assert_greedy_identical,
    assert_modes_equal_ar,
    chat_ids,
    engine_for,
    prompts,
    tiny_model,
    tiny_target,
)
from helpers.stats import SAMPLES, VOCAB, chi_square_p, exact_distribution, sample_counts
from llm_worker.config import ModelConfig, PlannerConfig, SamplingParams
from llm_worker.drafters import DRAFTERS, DraftContext, Drafter, DraftResources, RequestState
from llm_worker.drafters.base import DrafterState, ModeUnavailableError, UnknownModeError
from llm_worker.drafters.fuse import FuseDrafter, FuseState, fuse_trees, verdict_on
from llm_worker.engine import GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.planner import CostCurve, DraftPlanner
from llm_worker.types import NO_SOURCE, ArtifactNeeds, DraftTree, ForwardCandidates, Outcome, VerifyResult
from llm_worker.verify.verifier import verify_tokens

# -- the merge ----------------------------------------------------------------------------------


def paths_of(tree: DraftTree) -> dict[tuple[int, ...], int]:
    """Every node's token path from the root → the node."""
    return {tuple(tree.tokens[n] for n in tree.path_to(node)): node for node in range(len(tree))}


# a source's tree: up to 5 token paths over 3 tokens, 1 .. 4 deep, features naming path and source
source_paths = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=5)


def source_tree(paths: Sequence[Sequence[int]], tag: str) -> DraftTree:
    features = [[f"{tag}{'-'.join(map(str, p[: i + 1]))}" for i in range(len(p))] for p in paths]
    positions = [[len(p) * 10 + i if tag == "a" else NO_SOURCE for i in range(len(p))] for p in paths]
    return DraftTree.from_sequences(paths, positions, features)


@settings(max_examples=150, deadline=None)
@given(a=source_paths, b=source_paths, c=source_paths)
def test_the_fused_trie_is_the_union_of_the_paths(
    a: list[list[int]], b: list[list[int]], c: list[list[int]]
) -> None:
    trees = {"a": source_tree(a, "a"), "c": source_tree(c, "c"), "b": source_tree(b, "b")}
    fused = fuse_trees(trees)
    fused_paths = paths_of(fused)
    by_source = {name: paths_of(tree) for name, tree in trees.items()}
    union = set().union(*by_source.values())
    assert set(fused_paths) == union and len(fused) == len(union)  # one node per distinct path
    for path, node in fused_paths.items():
        who = sorted(name for name, paths in by_source.items() if path in paths)
        first = trees[who[0]]
        assert fused.features[node] == f"{'&'.join(who)}:{first.feature(by_source[who[0]][path])}"
        cited = [trees[n].source(by_source[n][path]) for n in trees if path in by_source[n]]
        assert fused.sources[node] == next((s for s in cited if s != NO_SOURCE), NO_SOURCE)


def test_the_merge_example() -> None:
    pld = DraftTree.chain([4, 2], sources=[7, 8], features=["m3", "m3"])
    suffix = DraftTree.chain([4, 7], features=["suffix:own:m4:p0.6:n2"] * 2)
    fused = fuse_trees({"pld": pld, "suffix": suffix})
    assert fused.tokens == (4, 2, 7) and fused.parents == (-1, 0, 0) and fused.sources == (7, 8, NO_SOURCE)
    # a feature that already names its source keeps the name once (not suffix:suffix:own:...)
    assert fused.features == ("pld&suffix:m3", "pld:m3", "suffix:own:m4:p0.6:n2")
    assert fuse_trees({"suffix": suffix, "pld": pld}).features[0] == "pld&suffix:m3"
    assert fuse_trees({"pld": DraftTree.empty()}) == DraftTree((), (), (), ())


# -- the verdict each source hears --------------------------------------------------------------


def brute_verdict(tree: DraftTree, accepted: list[int], bonus: int) -> list[Outcome]:
    """By token paths: accepted if the path is a prefix of the accepted tokens; rejected if the
    path without its last token is one (or empty) and the last token is not what the target said
    there (an accepted token, or the bonus right after them); unreached otherwise."""
    said = [*accepted, bonus]
    out = []
    for node in range(len(tree)):
        path = [tree.tokens[n] for n in tree.path_to(node)]
        d = len(path)
        if d <= len(accepted) and path == accepted[:d]:
            out.append(Outcome.ACCEPTED)
        elif path[:-1] == accepted[: d - 1] and d - 1 <= len(accepted) and path[-1] != said[d - 1]:
            out.append(Outcome.REJECTED)
        else:
            out.append(Outcome.UNREACHED)
    return out


@settings(max_examples=300, deadline=None)
@given(
    paths=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=6),
    accepted=st.lists(st.integers(0, 2), max_size=5),
    bonus=st.integers(0, 2),
)
def test_each_source_hears_the_verdict_on_its_own_tree(
    paths: list[list[int]], accepted: list[int], bonus: int
) -> None:
    tree = DraftTree.from_sequences(paths)
    verdict = verdict_on(tree, accepted, bonus)
    assert list(verdict.outcomes) == brute_verdict(tree, accepted, bonus)
    path = [tree.tokens[n] for n in verdict.accepted]
    assert path == accepted[: len(path)] and verdict.bonus == [*accepted, bonus][len(path)]
    assert verdict.accepted == tuple(n for n, o in enumerate(verdict.outcomes) if o == Outcome.ACCEPTED)
    last = verdict.accepted[-1] if verdict.accepted else -1
    holds_bonus = len(path) == len(accepted) and any(
        p == last and t == bonus for t, p in zip(tree.tokens, tree.parents, strict=True)
    )
    if not holds_bonus:  # then the verdict is the verifier's own, the target saying accepted + bonus
        said, depth = [*accepted, bonus], [0, *tree.depths()]
        assert verify_tokens(lambda row: said[depth[row]], tree) == verdict


def test_the_verdict_example() -> None:
    tree = DraftTree((5, 6, 7, 8), (-1, 0, 1, 0))
    verdict = verdict_on(tree, [5, 8], 9)
    assert verdict == VerifyResult(
        (0, 3), 9, (Outcome.ACCEPTED, Outcome.REJECTED, Outcome.UNREACHED, Outcome.ACCEPTED)
    )
    # the planner kept only [5]: 6 (the bonus) was never verified, 7 hangs off it
    assert verdict_on(tree, [5], 6) == VerifyResult(
        (0,), 6, (Outcome.ACCEPTED, Outcome.UNREACHED, Outcome.UNREACHED, Outcome.REJECTED)
    )


# -- fake sources: priors learned per source ----------------------------------------------------


class _Seen(DrafterState):
    def __init__(self) -> None:
        self.steps = 0


class Fixed(Drafter):
    """Always the chain ``tokens``, feature ``f``; counts its steps in its own request state and
    keeps every verdict it hears."""

    def __init__(self, name: str, tokens: Sequence[int], candidates: int = 0) -> None:
        self.name = name
        self.tokens = tokens
        self.candidates = candidates
        self.heard: list[tuple[DraftTree, VerifyResult, RequestState]] = []
        self.seen_candidates: list[np.ndarray] = []
        self.finished: list[RequestState] = []

    def propose(self, ctx: DraftContext) -> DraftTree:
        state = ctx.request_state
        if not isinstance(state.drafter, _Seen):
            state.drafter = _Seen()
        state.drafter.steps += 1
        return DraftTree.chain(self.tokens[: ctx.budget], features=["f"] * min(len(self.tokens), ctx.budget))

    def observe(self, tree: DraftTree, result: VerifyResult, state: RequestState) -> None:
        self.heard.append((tree, result, state))

    def observe_candidates(self, state: RequestState, rows: ForwardCandidates) -> None:
        self.seen_candidates.append(rows.candidates)

    def finish(self, state: RequestState, tokens: np.ndarray, prompt_length: int) -> None:
        self.finished.append(state)


def test_the_planner_learns_to_keep_one_sources_nodes_and_prune_the_others() -> None:
    a, b = Fixed("a", [1, 2, 3, 4]), Fixed("b", [7, 8, 9, 10])
    fuse = FuseDrafter([a, b])
    planner = DraftPlanner(CostCurve.linear(0.05, 0.005), PlannerConfig())  # a node: a tenth of a step
    state = RequestState(tenant="t")
    ctx = DraftContext(np.array([0, 5]), 8, request_state=state)
    first = planner.plan(fuse.propose(ctx), 2).tree
    # before any verdict the two sources look the same: their depth-1 nodes kept alike
    assert (1 in first.tokens) == (7 in first.tokens)
    said = [*a.tokens, 0]  # the target's tokens: a's chain, then 0
    for _ in range(200):  # a's chains always accepted, b's never
        fused = fuse.propose(ctx)
        kept = planner.plan(fused, 2).tree
        result = verify_tokens(lambda row, k=kept: said[([0, *k.depths()])[row]], kept)
        planner.observe(kept, result)
        fuse.observe(kept, result, state)
    fused = fuse.propose(ctx)
    assert fused.features == ("a:f",) * 4 + ("b:f",) * 4
    kept = planner.plan(fused, 2).tree
    assert kept.tokens == (1, 2, 3, 4)  # a's nodes all kept, none of b's
    # b was verified until its rejections brought it below what a tenth of a step is worth
    assert planner.acceptance.p("a:f", 4) > 0.95 and planner.acceptance.p("b:f", 1) < 0.4
    assert any(r.outcomes[0] == Outcome.REJECTED for _, r, _ in b.heard)
    # every source heard its verdict in its own request state, and the tokens it gave are counted
    fused_state = state.drafter
    assert isinstance(fused_state, FuseState)
    assert fused_state.states["a"].drafter.steps == 202  # type: ignore[union-attr]
    assert all(s is fused_state.states["a"] for _, _, s in a.heard)
    assert a.heard[-1][1].num_accepted == 4 and a.heard[-1][1].bonus == 0
    assert fused_state.accepted["a"] == fuse.accepted["a"] == sum(r.num_accepted for _, r, _ in a.heard)
    assert fused_state.accepted["b"] == 0 and b.heard  # b heard its rejections while verified


def test_agreement_gets_its_own_key_and_hooks_reach_every_source() -> None:
    a, b, c = Fixed("a", [1, 2]), Fixed("b", [1, 3], candidates=4), Fixed("c", [], candidates=2)
    fuse = FuseDrafter([a, b, c])
    assert fuse.candidates == 4 and not fuse.gated and fuse.needs == ArtifactNeeds()
    state = RequestState()
    fused = fuse.propose(DraftContext(np.array([0]), 8, request_state=state))
    assert fused.tokens == (1, 2, 3) and fused.features == ("a&b:f", "a:f", "b:f")
    fuse.observe(
        fused, VerifyResult((0, 2), 5, (Outcome.ACCEPTED, Outcome.REJECTED, Outcome.ACCEPTED)), state
    )
    assert a.heard[0][1].accepted == (0,) and a.heard[0][1].bonus == 3
    assert b.heard[0][1].accepted == (0, 1) and not c.heard  # c proposed nothing
    assert dict(fuse.accepted) == {"a": 1, "b": 2}
    rows = ForwardCandidates(np.array([0, 1]), np.array([-1, 0]), np.array([5]), np.arange(8).reshape(2, 4))
    fuse.observe_candidates(state, rows)
    assert not a.seen_candidates and b.seen_candidates[0].shape == (2, 4)
    assert c.seen_candidates[0].tolist() == [[0, 1], [4, 5]]  # each its own k
    fuse.finish(state, np.array([0, 1, 3]), 1)
    assert [s.tenant for s in a.finished] == [""] and a.finished[0] is not state


def test_needs_are_the_union_of_the_sources() -> None:
    one = ArtifactNeeds(hidden_layers=frozenset({1}), query_heads=((1, 0),))
    two = ArtifactNeeds(
        hidden_layers=frozenset({1, 3}), query_heads=((2, 1), (1, 0)), kv_layers=frozenset({2})
    )
    both = ArtifactNeeds.union([one, two])
    assert both == ArtifactNeeds(frozenset({1, 3}), ((1, 0), (2, 1)), frozenset({2}))


# -- mode strings -------------------------------------------------------------------------------


def test_sources_by_default_and_by_name() -> None:
    target = tiny_target()
    bare = DRAFTERS.create("fuse", target)
    assert isinstance(bare, FuseDrafter) and list(bare.sources) == ["pld", "suffix"]
    assert bare.candidates == 0  # recycle, the one source that wants candidates, joins when named
    assert DRAFTERS.create("fuse:sources=pld.recycle", target).candidates == 8  # recycle's
    named = DRAFTERS.create("fuse:sources=suffix.pld", target)
    assert isinstance(named, FuseDrafter) and list(named.sources) == ["suffix", "pld"]
    resources = DraftResources()
    shared = DRAFTERS.create("fuse:sources=suffix", target, resources)
    alone = DRAFTERS.create("suffix", target, resources)
    assert shared.sources["suffix"].store is alone.store  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "mode,error,words",
    [
        ("fuse:sources=pld.nope", UnknownModeError, "fuse source 'nope': unknown mode"),
        ("fuse:sources=rest", ModeUnavailableError, "fuse source 'rest': needs a datastore"),
        ("fuse:sources=pld.dresd", ModeUnavailableError, "fuse source 'dresd': needs a datastore"),
        ("fuse:sources=pld.pld", UnknownModeError, "names a source twice"),
        ("fuse:sources=pld..suffix", UnknownModeError, "names an empty source"),
        ("fuse:sources=", UnknownModeError, "names an empty source"),
        ("fuse:sources=fuse", UnknownModeError, "'fuse' cannot be a source"),
        ("fuse:sources=ar", UnknownModeError, "'ar' cannot be a source"),
        ("fuse:depth=3", UnknownModeError, "takes options ['sources']"),
        # a source's options: SOURCE.OPTION, checked as that mode's own
        ("fuse:rest.window=3", UnknownModeError, "fuse option 'rest.window': mode 'rest' takes options"),
        ("fuse:nope.n=1", UnknownModeError, "fuse option 'nope.n': unknown mode 'nope'"),
        ("fuse:sources=pld:pld.max_n=x", UnknownModeError, "fuse source 'pld': option max_n='x' is not"),
        ("fuse:sources=pld:pld.max_n=99", UnknownModeError, "fuse source 'pld': option max_n=99 is outside"),
        ("fuse:sources=pld:suffix.match=4", UnknownModeError, "'suffix' is not a source here (sources: pld)"),
        ("fuse:recycle.depth=2", UnknownModeError, "'recycle' is not a source here"),
    ],
)
def test_bad_source_lists_are_clear_errors(mode: str, error: type[Exception], words: str) -> None:
    with pytest.raises(error) as raised:
        DRAFTERS.create(mode, tiny_target())
    assert type(raised.value) is error and words in str(raised.value) and "\n" not in str(raised.value)


def test_a_source_takes_its_options_as_source_dot_option() -> None:
    """``fuse:sources=pld.suffix:pld.max_n=2:suffix.match=4`` runs ``pld:max_n=2`` and
    ``suffix:match=4``; such a mode string passes the check a command makes before any model
    loads, and a bad source option fails it there."""
    target = tiny_target()
    fused = DRAFTERS.create("fuse:sources=pld.suffix:pld.max_n=2:suffix.match=4", target)
    assert isinstance(fused, FuseDrafter) and list(fused.sources) == ["pld", "suffix"]
    assert fused.sources["pld"].max_n == 2 and fused.sources["suffix"].match == 4  # type: ignore[attr-defined]
    defaults = DRAFTERS.create("fuse:pld.min_n=2", target)  # the default sources, pld with min_n=2
    assert isinstance(defaults, FuseDrafter) and list(defaults.sources) == ["pld", "suffix"]
    assert defaults.sources["pld"].min_n == 2  # type: ignore[attr-defined]
    spec, options = DRAFTERS.check("fuse:sources=pld.rest:rest.ctx=0")
    assert spec.name == "fuse" and options == {"sources": "pld.rest", "rest.ctx": "0"}
    with pytest.raises(UnknownModeError, match="mode 'rest' takes options"):
        DRAFTERS.check("fuse:rest.ctx0=1")
    with pytest.raises(UnknownModeError, match="takes options"):
        DRAFTERS.check("pld:rest.ctx=0")  # only a mode that runs sources takes SOURCE.OPTION


def test_greedy_fuse_with_a_source_option_equals_ar(tmp_path: Path) -> None:
    """A fused source with an option (``rest.ctx=0``: REST from the datastore alone) is lossless
    and drafts: greedy, every prompt, the same tokens as ``ar``."""
    target = tiny_target("llama", backend="fast")
    engine = datastore_engine(target, datastore_for(target, tmp_path / "v"), FLAT_CURVE)
    mode = "fuse:sources=pld.rest:rest.ctx=0"
    rest = engine.runtime(mode).drafter.sources["rest"]  # type: ignore[attr-defined]
    assert rest.fuse_separator is None  # ctx=0 reached it (ctx=1 fuses the context: a separator)
    assert engine.runtime("fuse:sources=pld.rest").drafter.sources["rest"].fuse_separator is not None  # type: ignore[attr-defined]
    assert_modes_equal_ar(engine, target, [mode], 40, "fuse with rest.ctx=0")


# -- identical to ar ----------------------------------------------------------------------------


@pytest.mark.parametrize("curve", [FLAT_CURVE, CPU_LIKE_CURVE], ids=["flat", "cpu"])
def test_greedy_fuse_equals_ar(curve: CostCurve) -> None:
    target = tiny_target("llama", backend="fast")
    engine = engine_for(target, curve)
    assert_modes_equal_ar(engine, target, ["fuse", "fuse:sources=pld.suffix.recycle"], 48, "fuse")
    # one source: every accepted token is that source's
    prompt = tuple(prompts(target.info.vocab_size)[0])
    res = engine.generate(GenerationRequest(prompt, 48, "fuse:sources=pld"))
    assert engine.runtime("fuse:sources=pld").drafter.accepted["pld"] == res.stats.accepted_tokens > 0  # type: ignore[attr-defined]


def test_greedy_fuse_with_sparse_and_dense_datastores_equals_ar(tmp_path: Path) -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=0)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    version = dense_version(model, target, tmp_path / "v", own_continuations(target))
    engine = datastore_engine(target, LocalRetriever(version), CPU_LIKE_CURVE)
    fused = engine.runtime("fuse").drafter
    assert isinstance(fused, FuseDrafter) and list(fused.sources) == [
        "pld",
        "suffix",
        "rest",
        "dresd",
    ]
    assert fused.needs.hidden_layers == {target.info.num_layers}  # dresd's
    tally = DraftTally()
    modes = ["fuse", "fuse:sources=rest.dresd", "fuse:sources=pld.rest-batch.dresd-batch"]
    for prompt in prompts(VOCAB)[:4]:
        ref = engine.generate(GenerationRequest(tuple(prompt), 40, "ar", stop_at_eos=False)).token_ids
        for mode in modes:
            res = engine.generate(GenerationRequest(tuple(prompt), 40, mode, stop_at_eos=False))
            assert res.token_ids == ref, f"{mode}: differs from ar on {prompt}"
            assert res.datastore_version == "v"
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("fuse with datastores")
    assert fused.accepted["rest"] > 0 and fused.accepted["dresd"] > 0


def test_sampling_fuse_matches_exact_distribution() -> None:
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    params = SamplingParams(temperature=1.3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    engine = engine_for(target, FLAT_CURVE)
    counts, drafted, accepted = sample_counts(engine, prompt, "fuse", params)
    p = chi_square_p(counts, exact_distribution(model, prompt, params), SAMPLES)
    assert p > 1e-3, f"fuse: sampled continuations do not follow the target distribution (p = {p:.2g})"
    assert drafted > SAMPLES // 4 and accepted > 0, (drafted, accepted)


def test_seeded_sampling_equals_ar() -> None:
    target = tiny_target("llama", backend="fast")
    engine = engine_for(target, CPU_LIKE_CURVE)
    tally = DraftTally()
    for seed, prompt in enumerate(prompts(target.info.vocab_size)[:4]):
        params = SamplingParams(temperature=0.3, top_p=0.95, seed=seed)
        ref = engine.generate(GenerationRequest(tuple(prompt), 40, "ar", params)).token_ids
        res = engine.generate(GenerationRequest(tuple(prompt), 40, "fuse", params))
        assert res.token_ids == ref, seed
        tally.observe("fuse", res.stats)
    tally.assert_every_mode_drafted_and_accepted("fuse sampled")


@pytest.mark.slow
def test_greedy_on_the_real_model_equals_ar(real_model) -> None:
    target, tokenizer = real_model
    engine = engine_for(
        target, FLAT_CURVE
    )  # its own engine: the shared one may have learned to verify nothing
    prompt = chat_ids(tokenizer, "Explain what a hash table is to a child.")
    ref = engine.generate(GenerationRequest(tuple(prompt), 40, "ar", stop_at_eos=False)).token_ids
    accepted = 0
    for _ in range(2):  # the second drafts from what the first said (suffix, recycle)
        res = engine.generate(GenerationRequest(tuple(prompt), 40, "fuse", stop_at_eos=False))
        assert_greedy_identical(target, prompt, ref, res.token_ids, "fuse")
        accepted += res.stats.accepted_tokens
    assert accepted > 0
