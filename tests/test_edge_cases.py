"""Regression tests for edge cases found in review: context limits, masks, windows, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import transformers

from helpers.models import FLAT_CURVE, DraftTally, engine_for, tiny_model, tiny_target
from llm_worker.config import CostConfig, EngineConfig, ModelConfig
from llm_worker.drafters import DRAFTERS
from llm_worker.drafters.base import NoDrafter
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import wrap_model
from llm_worker.planner import CostCurve, measure_cost_curve
from llm_worker.results import GenerationResult
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

TREE_MODES = ["pld", "pld+h:layer=1", "pld+h:layer=1:branches=4"]


def repetitive_prompt(length: int, period: int = 10) -> list[int]:
    body = np.random.default_rng(7).integers(1, 95, size=period).tolist()
    return (body * (length // period + 1))[:length]


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_tree_drafts_near_the_context_limit_are_trimmed_not_refused(backend: str) -> None:
    target = wrap_model(tiny_model("llama"), None, ModelConfig(backend=backend, max_context=60))
    engine = engine_for(target, FLAT_CURVE)
    prompt = repetitive_prompt(40)
    ref = engine.generate(GenerationRequest(tuple(prompt), 20, "ar")).token_ids
    tally = DraftTally()
    for mode in TREE_MODES:
        res = engine.generate(GenerationRequest(tuple(prompt), 20, mode))
        assert res.token_ids == ref, mode
        tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted(f"context limit/{backend}")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_backend_tree_masks_hold_for_every_attention_implementation(kind: str, impl: str) -> None:
    model = tiny_model(kind)
    model.set_attn_implementation(impl)
    target = wrap_model(model, None, ModelConfig(backend="hf"))
    none = ArtifactNeeds()
    with torch.inference_mode():
        state = target.start()
        target.forward(state, torch.tensor([5, 6, 7, 8]), None, none)
        target.commit(state, range(4))
        # root 9 with children 11 and 12; 13 under 11
        tree = target.forward(state, torch.tensor([9, 11, 12, 13]), tree_buffers((-1, -1, 0)), none).logits
        ref = target.forward(target.start(), torch.tensor([5, 6, 7, 8, 9, 12]), None, none).logits[-1]
    assert torch.allclose(tree[2], ref, atol=1e-5)
    engine = engine_for(target, FLAT_CURVE)
    prompt = repetitive_prompt(36, 12)
    ref_tokens = engine.generate(GenerationRequest(tuple(prompt), 40, "ar")).token_ids
    res = engine.generate(GenerationRequest(tuple(prompt), 40, "pld+h:layer=1:branches=4"))
    assert res.token_ids == ref_tokens
    assert res.stats.drafted_tokens > 0 and res.stats.accepted_tokens > 0, res.stats


def test_sliding_window_models_run_every_mode_on_the_hf_backend() -> None:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=95,
        tie_word_embeddings=False,
        sliding_window=16,
    )
    model = transformers.MistralForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    target = wrap_model(model, None, ModelConfig())
    assert target.info.backend == "hf"
    engine = engine_for(target, FLAT_CURVE)
    # Two layers of 16-token windows see 32 tokens back: after ``start`` + its continuation +
    # ``start`` again (36 tokens) the model continues as it did the first time, so the context
    # holds the answer and copy drafts are accepted (a random model rarely repeats by itself).
    start = repetitive_prompt(36, 12)
    prompt = start + engine.generate(GenerationRequest(tuple(start), 40, "ar")).token_ids + start
    ref = engine.generate(GenerationRequest(tuple(prompt), 40, "ar")).token_ids
    with torch.inference_mode():  # our ar is the model's own greedy decoding
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=95)
    assert hf[0, len(prompt) :].tolist() == ref
    tally = DraftTally()
    for mode in TREE_MODES:
        res = engine.generate(GenerationRequest(tuple(prompt), 40, mode))
        assert res.token_ids == ref, mode
        tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("sliding window")


def test_cost_curve_on_a_short_context_model() -> None:
    target = wrap_model(tiny_model("llama"), None, ModelConfig(max_context=64))
    curve = measure_cost_curve(target, CostConfig(repeats=1), 65)
    assert max(curve.sizes) <= 32 and all(c >= 1 for c in curve.contexts)
    engine = Engine(target, EngineConfig(cost=CostConfig(repeats=1, cache=False)))
    assert len(engine.generate(GenerationRequest(tuple(repetitive_prompt(20)), 8, "pld")).token_ids) == 8
    assert CostCurve((1,), (0,), ((0.5,),)).t(7, 100) == 0.5


def test_a_stream_may_be_resumed_from_different_threads() -> None:
    engine = engine_for(wrap_model(tiny_model("llama"), None, ModelConfig()), FLAT_CURVE)
    steps = engine.stream(GenerationRequest(tuple(repetitive_prompt(30)), 24, "pld"))
    items: list[object] = []
    errors: list[BaseException] = []

    def one_step() -> None:
        try:
            items.append(next(steps))
        except StopIteration:
            items.append(None)
        except BaseException as exc:
            errors.append(exc)

    while not errors and (not items or items[-1] is not None):
        thread = threading.Thread(target=one_step)
        thread.start()
        thread.join()
    assert not errors, errors
    assert isinstance(items[-2], GenerationResult)


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_hidden_states_mean_the_same_on_both_backends(backend: str) -> None:
    model = tiny_model("llama")
    target = wrap_model(model, None, ModelConfig(backend=backend))
    ids = torch.tensor([3, 4, 5, 6, 7])
    needs = ArtifactNeeds(hidden_layers=frozenset({0, 1, 2}))
    with torch.inference_mode():
        out = target.forward(target.start(), ids, None, needs)
        ref = model(ids[None], output_hidden_states=True).hidden_states
    for layer in (0, 1, 2):
        assert torch.allclose(out.hidden[layer], ref[layer][0], atol=1e-5), layer


def test_mode_runtimes_are_bounded_and_shared_by_spellings_of_one_mode() -> None:
    from llm_worker.engine import MAX_MODE_RUNTIMES

    engine = engine_for(tiny_target("llama"))
    first = engine.runtime("pld:min_n=1:max_n=3")
    assert engine.runtime(" pld : max_n=3 : min_n=1 ") is first  # the same options, another order
    for i in range(3 * MAX_MODE_RUNTIMES):  # one mode spelled many ways: one runtime
        assert engine.runtime(f"pld:max_n={'0' * i}3:min_n=01") is first
    assert engine.cached_modes == 1
    for i in range(3 * MAX_MODE_RUNTIMES):  # a client sending a new variant each time
        engine.runtime(f"pld+h:layer=1:theta={i / 1000}")
    assert engine.cached_modes == MAX_MODE_RUNTIMES
    assert engine.runtime("pld:max_n=3:min_n=1") is not first  # dropped long ago: made again


class HeavyDrafter(NoDrafter):
    """Drafts nothing, holds ``weights``."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def tensors(self) -> list[torch.Tensor]:
        return [self.weights]


def test_mode_runtimes_are_bounded_by_their_drafters_memory() -> None:
    """Beyond ``max_drafter_bytes`` the least recently used runtimes are dropped; a tensor that
    several modes' drafters share counts once; the mode just asked for is kept whatever it holds."""
    engine = engine_for(tiny_target("llama"))
    engine.config = EngineConfig(max_drafter_bytes=10 << 20)

    held: dict[tuple[str, str], torch.Tensor] = {}

    def make(target: object, options: dict[str, str], resources: object) -> HeavyDrafter:
        """``heavy:mb=N:copy=C``: copy C of N MB (the same C: the same tensor)."""
        mb, copy = options["mb"], options.get("copy", "0")
        return HeavyDrafter(held.setdefault((mb, copy), torch.zeros(int(mb) << 18)))  # float32: N MB

    with DRAFTERS.registered("heavy", "holds memory", make, options=("mb", "copy", "tag")):
        for tag in range(20):  # one tensor shared by 20 spellings: 4 MB
            engine.runtime(f"heavy:mb=4:tag={tag}")
        assert engine.cached_modes == 20 and engine.drafter_bytes == 4 << 20
        engine.runtime("heavy:mb=5:copy=1")
        assert engine.cached_modes == 21 and engine.drafter_bytes == 9 << 20
        engine.runtime("heavy:mb=3:copy=2")  # 12 MB: every spelling of the 4 MB one goes
        assert engine.cached_modes == 2 and engine.drafter_bytes == 8 << 20
        engine.runtime("heavy:mb=16:copy=3")  # alone over the budget: kept, alone
        assert engine.cached_modes == 1 and engine.drafter_bytes == 16 << 20
