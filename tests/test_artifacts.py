"""Artifacts by key (llm_worker/model/artifacts.py): a new kind of artifact reaches the drafter
that declares it through the engine with nothing but a registered kind and a registered drafter
— no engine, batching or server change — and the output stays ``ar``'s."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from helpers.models import FLAT_CURVE, DraftTally, engine_for, greedy_tokens, prompts, tiny_target
from llm_worker.batching import BatchingConfig
from llm_worker.config import EngineConfig, PlannerConfig
from llm_worker.drafters import DRAFTERS, DraftContext, Drafter, DraftResources, ModeUnavailableError
from llm_worker.drafters.pld import PromptLookupDrafter
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model.artifacts import ARTIFACTS, ArtifactKind, ArtifactView
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactKey, ArtifactNeeds, DraftTree, UndeclaredArtifactError, hidden_key

MODE = "test-pre-norm"

# -- the new artifact: registered here, produced from a tap the fast forward publishes ----------

PRE_NORM = ArtifactKind("test-pre-norm", tap=lambda key: ("residual", key.args[0]))
"""The residual stream after ``args[0]`` decoder layers, before any norm, at every committed
position: [T-1, hidden_size]. At the last layer it is not a hidden state (those are after the
final norm there)."""

LAST_PRE_NORM = ArtifactKind("test-last-pre-norm", tap=lambda key: ("residual", key.args[0]), keep_last=True)
"""The same at the last committed position only: [hidden_size]."""


def cached_positions(view: ArtifactView, key: ArtifactKey[Any]) -> int:
    return int(view.target.kv(view.state, 0)[0].shape[1])


CACHED = ArtifactKind("test-cached", read=cached_positions)
"""Read when asked, from the target: how many positions its cache holds (T-1)."""


@pytest.fixture
def new_artifacts() -> Iterator[None]:
    with ARTIFACTS.registered(PRE_NORM), ARTIFACTS.registered(LAST_PRE_NORM), ARTIFACTS.registered(CACHED):
        yield


class PreNormDrafter(Drafter):
    """PLD's drafts; on the way it keeps what it read of the new artifacts at every step."""

    def __init__(self, layers: int) -> None:
        self.every: ArtifactKey[torch.Tensor] = ArtifactKey(PRE_NORM.name, (layers,))
        self.last: ArtifactKey[torch.Tensor] = ArtifactKey(LAST_PRE_NORM.name, (layers,))
        self.cached: ArtifactKey[int] = ArtifactKey(CACHED.name)
        self.needs = ArtifactNeeds(extra=frozenset({self.every, self.last, self.cached}))
        self.seen: list[tuple[np.ndarray, torch.Tensor, torch.Tensor, int]] = []
        self.pld = PromptLookupDrafter()

    def propose(self, ctx: DraftContext) -> DraftTree:
        every, last = ctx.artifact(self.every), ctx.artifact(self.last)
        self.seen.append((ctx.tokens.copy(), every.clone(), last.clone(), ctx.artifact(self.cached)))
        return self.pld.propose(ctx)


@pytest.fixture
def pre_norm_mode(new_artifacts: None) -> Iterator[list[PreNormDrafter]]:
    """``test-pre-norm`` registered; the drafters it made."""
    made: list[PreNormDrafter] = []

    def make(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
        made.append(PreNormDrafter(target.info.num_layers))
        return made[-1]

    with DRAFTERS.registered(MODE, "test only: reads the last layer's state before the final norm", make):
        yield made


def reference_pre_norm(model: Any, tokens: np.ndarray) -> torch.Tensor:
    """[T, hidden]: what enters transformers' final norm, for ``tokens`` in one forward."""
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: seen.append(args[0][0]))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor(tokens)[None])
    finally:
        hook.remove()
    return seen[0]


def assert_seen_matches_the_model(drafter: PreNormDrafter, model: Any) -> None:
    """Every step's artifacts against a plain forward over the longest sequence that step's
    tokens begin (causal: a position's state depends on the tokens up to it only)."""
    assert drafter.seen
    references: list[tuple[list[int], torch.Tensor]] = []  # longest first
    for tokens, every, last, cached in sorted(drafter.seen, key=lambda seen: -len(seen[0])):
        context = tokens[:-1].tolist()  # the root has no state yet
        match = next((ref for seq, ref in references if seq[: len(context)] == context), None)
        if match is None:
            match = reference_pre_norm(model, tokens[:-1])
            references.append((context, match))
        want = match[: len(context)]
        assert every.shape == want.shape and cached == len(context)
        torch.testing.assert_close(every, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(last, every[-1])


# -- tests ---------------------------------------------------------------------------------------


def test_a_new_artifact_reaches_its_drafter_through_the_engine_unchanged(
    pre_norm_mode: list[PreNormDrafter],
) -> None:
    target = tiny_target("llama", backend="fast")
    engine = engine_for(target, FLAT_CURVE)
    tally = DraftTally()
    for prompt in prompts(target.info.vocab_size)[:2]:
        reference = greedy_tokens(engine, prompt, "ar", 40)
        result = engine.generate(GenerationRequest(tuple(prompt), 40, MODE))
        assert result.token_ids == reference
        tally.observe(MODE, result.stats)
    tally.assert_every_mode_drafted_and_accepted()
    assert_seen_matches_the_model(pre_norm_mode[0], target.model)


def test_requests_batched_with_others_get_their_own_artifacts(pre_norm_mode: list[PreNormDrafter]) -> None:
    """Through the batch scheduler, beside requests that record nothing: each request's rows."""
    target = tiny_target("llama", backend="fast")
    solo = engine_for(target, FLAT_CURVE)
    engine = Engine(
        target, EngineConfig(planner=PlannerConfig()), curve=FLAT_CURVE, batching=BatchingConfig()
    )
    ps = prompts(target.info.vocab_size)
    requests = [GenerationRequest(tuple(ps[i % 2]), 30, (MODE, "ar", "pld")[i % 3]) for i in range(6)]
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(engine.generate, requests))
    finally:
        engine.close()
    for req, res in zip(requests, results, strict=True):
        assert res.token_ids == greedy_tokens(solo, req.prompt_ids, "ar", 30), req.mode
    assert_seen_matches_the_model(pre_norm_mode[0], target.model)


def test_an_undeclared_artifact_is_refused_naming_its_key(new_artifacts: None) -> None:
    class Undeclared(Drafter):
        needs = ArtifactNeeds(hidden_layers=frozenset({2}))

        def propose(self, ctx: DraftContext) -> DraftTree:
            ctx.artifact(hidden_key(1))
            return DraftTree.empty()

    engine = engine_for(tiny_target("llama", backend="fast"), FLAT_CURVE)
    with (
        DRAFTERS.registered("test-undeclared", "test only", lambda target, opts, res: Undeclared()),
        pytest.raises(UndeclaredArtifactError, match=r"artifact hidden\(1\) .*declared: hidden\(2\)"),
    ):
        engine.generate(GenerationRequest((1, 2, 3, 1, 2), 4, "test-undeclared"))
    with pytest.raises(KeyError, match=r"test-pre-norm\(2\)"):
        DraftContext(np.array([1, 2]), 2).artifact(ArtifactKey("test-pre-norm", (2,)))


def test_a_backend_that_cannot_produce_an_artifact_refuses_the_mode(
    pre_norm_mode: list[PreNormDrafter],
) -> None:
    """transformers' forward publishes no state before its final norm: the mode is unavailable
    there, before any request runs, and the message names the artifact."""
    hf = tiny_target("llama", backend="hf")
    with pytest.raises(
        ModeUnavailableError, match=r"artifact test-last-pre-norm\(2\): the hf backend.*'residual' at layer 2"
    ):
        DRAFTERS.create(MODE, hf)
    assert MODE not in DRAFTERS.available(hf)
    assert MODE in DRAFTERS.available(tiny_target("llama", backend="fast"))


def test_a_kind_nobody_registered_is_refused_and_kinds_leave_with_their_block() -> None:
    key: ArtifactKey[torch.Tensor] = ArtifactKey("test-pre-norm", (2,))
    target = tiny_target("llama", backend="fast")
    needs = ArtifactNeeds(extra=frozenset({key}))
    with ARTIFACTS.registered(PRE_NORM):
        assert [r.tap for r in ARTIFACTS.published(target, needs)] == [("residual", 2)]
        with pytest.raises(ValueError, match="registered twice"):
            ARTIFACTS.register(PRE_NORM)
    with pytest.raises(ValueError, match=r"test-pre-norm\(2\): no kind 'test-pre-norm' is registered"):
        ARTIFACTS.published(target, needs)
    with pytest.raises(ValueError, match="a tap or a read"):
        ArtifactKind("test-neither")
