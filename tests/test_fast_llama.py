"""The fast Llama-family forward against transformers' own forward (the plain reference)."""

from __future__ import annotations

import pytest
import torch

from helpers.models import snap_to_blocks, tiny_model
from llm_worker.config import ModelConfig
from llm_worker.model import native, wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.ops_cpu import FusedCpuOps
from llm_worker.model.ops_torch import TorchOps
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

NONE = ArtifactNeeds()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_and_incremental_match_transformers(kind: str) -> None:
    model = tiny_model(kind)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    assert isinstance(target, FastLlamaTarget)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(model, ids)
    with torch.inference_mode():
        state = target.start()
        out = target.forward(state, torch.tensor(ids[:30]), None, NONE)
        target.commit(state, range(30))
        assert torch.allclose(out.logits, ref[:30], atol=1e-5)
        # A 4-token chain after the prefix, then single tokens.
        out = target.forward(state, torch.tensor(ids[30:34]), None, NONE)
        target.commit(state, range(4))
        assert torch.allclose(out.logits, ref[30:34], atol=1e-5)
        for i in range(34, 40):
            out = target.forward(state, torch.tensor([ids[i]]), None, NONE)
            target.commit(state, [0])
            assert torch.allclose(out.logits[0], ref[i], atol=1e-5)


def test_tree_rows_equal_their_own_chains_and_commit_compacts_the_cache() -> None:
    model = tiny_model("llama")
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    prefix = [3, 17, 42, 5, 9, 11, 23]
    # root 7; branches [7, 8, 9] and [7, 30] and [7, 8, 31]: tokens (8, 9, 30, 31), parents (-1, 0, -1, 0)
    tokens, parents = (8, 9, 30, 31), (-1, 0, -1, 0)
    buffers = tree_buffers(parents)
    with torch.inference_mode():
        state = target.start()
        target.forward(state, torch.tensor(prefix), None, NONE)
        target.commit(state, range(len(prefix)))
        out = target.forward(state, torch.tensor((7, *tokens)), buffers, NONE)
        for path in ([7, 8, 9], [7, 30], [7, 8, 31]):
            ref = reference_logits(model, prefix + path)
            rows = {(7,): 0, (7, 8): 1, (7, 8, 9): 2, (7, 30): 3, (7, 8, 31): 4}
            assert torch.allclose(out.logits[rows[tuple(path)]], ref[-1], atol=1e-5)
        # Accept root, 8, 31 (rows 0, 1, 4): the cache must now equal the plain sequence's.
        target.commit(state, [0, 1, 4])
        nxt = target.forward(state, torch.tensor([50]), None, NONE)
    ref = reference_logits(model, [*prefix, 7, 8, 31, 50])
    assert torch.allclose(nxt.logits[0], ref[-1], atol=1e-5)


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_last_logits_only(backend: str) -> None:
    model = tiny_model("llama")
    target = wrap_model(model, None, ModelConfig(backend=backend))
    ids = list(range(3, 20))
    with torch.inference_mode():
        out = target.forward(target.start(), torch.tensor(ids), None, NONE, last_logits_only=True)
    assert out.logits.shape == (1, 96)
    assert torch.allclose(out.logits[0], reference_logits(model, ids)[-1], atol=1e-5)


def test_hidden_states_and_queries_are_reported() -> None:
    model = tiny_model("llama")
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    ids = [4, 8, 15, 16, 23, 42]
    needs = ArtifactNeeds(hidden_layers=frozenset({0, 1}), query_heads=((1, 3),))
    with torch.inference_mode():
        out = target.forward(target.start(), torch.tensor(ids), None, needs)
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    assert torch.allclose(out.hidden[0], ref.hidden_states[0][0], atol=1e-6)
    assert torch.allclose(out.hidden[1], ref.hidden_states[1][0], atol=1e-5)
    assert out.queries[(1, 3)].shape == (len(ids), 16)


def test_context_limit_is_enforced() -> None:
    target = wrap_model(tiny_model("llama"), None, ModelConfig(backend="fast", max_context=16))
    with torch.inference_mode(), pytest.raises(ValueError, match="exceeds the model's limit"):
        target.forward(target.start(), torch.zeros(17, dtype=torch.long), None, NONE)


def test_non_llama_models_fall_back_to_transformers_backend() -> None:
    target = wrap_model(tiny_model("gpt2"), None, ModelConfig())
    assert target.info.backend == "hf"
    with pytest.raises(ValueError, match="not one of"):
        wrap_model(tiny_model("gpt2"), None, ModelConfig(backend="fast"))


@pytest.mark.parametrize(
    "kernel", ["aten:1", "aten:4", "onednn:2", "onednn:16", "onednn:2:4", "quant:1", "auto"]
)
def test_every_kernel_matches_transformers(kernel: str) -> None:
    model = tiny_model("llama")
    if kernel.startswith("quant"):  # weights that are exact 4-/8-bit blocks, as the default model's
        snap_to_blocks(model)
    target = wrap_model(model, None, ModelConfig(backend="fast", kernel=kernel))
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = reference_logits(model, ids)
    with torch.inference_mode():
        state = target.start()
        for lo, hi in ((0, 2), (2, 8), (8, 9), (9, 24)):  # row counts below and above the padding
            out = target.forward(state, torch.tensor(ids[lo:hi]), None, NONE)
            target.commit(state, range(hi - lo))
            assert torch.allclose(out.logits, ref[lo:hi], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 40])  # halves of 12 and 20: RoPE's vectors of 8 split them
def test_fused_kernels_match_torch_on_heads_whose_half_is_not_whole_vectors(
    head_dim: int, dtype: torch.dtype
) -> None:
    """A tiny Llama whose head_dim is not a multiple of 16: the fused path's logits are the torch
    path's and transformers' (a prefill, a chain after it, then single tokens)."""
    if native.load() is None:
        pytest.skip(f"the fused kernels do not run here: {native.unavailable_reason()}")
    model = tiny_model("llama", head_dim=head_dim).to(dtype)
    name = str(dtype).removeprefix("torch.")
    fused = wrap_model(model, None, ModelConfig(backend="fast", kernel="aten:1", dtype=name))
    assert isinstance(fused, FastLlamaTarget) and isinstance(fused.ops, FusedCpuOps)
    plain = FastLlamaTarget(model, fused.info, fused.kernels, fused=False)
    assert isinstance(plain.ops, TorchOps)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = reference_logits(model, ids)
    atol = 1e-4 if dtype == torch.float32 else 0.1
    outs = []
    for target in (fused, plain):
        logits = []
        with torch.inference_mode():
            state = target.start()
            for lo, hi in ((0, 30), (30, 34), *((i, i + 1) for i in range(34, 40))):
                logits.append(target.forward(state, torch.tensor(ids[lo:hi]), None, NONE).logits)
                target.commit(state, range(hi - lo))
        outs.append(torch.cat(logits))
        torch.testing.assert_close(outs[-1], ref, atol=atol, rtol=0)
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)
