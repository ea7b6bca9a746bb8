"""GLIDE's draft network on the fused kernels: the same function as the torch network (whose
weights are rounded to 8-bit blocks first, as the fused one's are), reading the target's cache
in place; and the 8-bit rounding packs exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.models import tiny_model
from llm_worker.config import ModelConfig
from llm_worker.drafters.base import DraftContext
from llm_worker.drafters.glide import GlideDrafter, GlideNetwork, _State
from llm_worker.drafters.glide_net import GlideNet, glide_config_for
from llm_worker.model import native, quant, wrap_model

pytestmark = pytest.mark.skipif(native.load() is None, reason="the fused kernels do not build here")


def test_rounding_to_8_bit_blocks_packs_exactly_and_is_idempotent() -> None:
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    w[3, :32] = 0.0  # a zero block
    r = quant.round_to_eight_bit(w)
    packed = quant.pack_exact(r)
    assert packed is not None and packed.n == 48
    assert torch.equal(quant.round_to_eight_bit(r), r)
    assert float((r - w).abs().max()) <= float(w.abs().max()) / 127


@pytest.mark.parametrize("cross", [True, False], ids=["glide", "vanilla"])
def test_fused_network_matches_the_torch_network(cross: bool) -> None:
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    torch.manual_seed(1)
    net = GlideNet(glide_config_for(model, 64, cross_attention=cross))
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 2:
                p.copy_(
                    quant.round_to_eight_bit(p * 4)
                )  # exact 8-bit blocks: the fused network's rounding is a no-op
    d2t = torch.arange(64)
    drafter = GlideDrafter(GlideNetwork.build(target, net, d2t), 8, 0.05, None)
    assert drafter.fast is not None

    state = target.start()
    tokens = np.random.default_rng(0).integers(1, 90, size=41)
    target.forward(state, torch.tensor(tokens[:40]), None, drafter.needs)
    target.commit(state, range(40))
    ctx = DraftContext(
        tokens,
        8,
        kv=lambda layer: target.kv(state, layer),
        kv_buffers=lambda layer: target.kv_buffers(state, layer),
    )
    fused_state, torch_state = _State([], None), _State([], None)
    fast = drafter.fast
    with torch.inference_mode():
        for start, chunk in [(0, tokens.tolist()), (41, [5]), (42, [17])]:
            drafter.fast = fast
            a = drafter._forward(chunk, start, 40, fused_state, ctx)
            drafter.fast = None
            b = drafter._forward(chunk, start, 40, torch_state, ctx)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fused_state.fused is not None and fused_state.fused.length == 43


def test_chain_stops_where_another_token_would_not_pay() -> None:
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    torch.manual_seed(1)
    net = GlideNet(glide_config_for(model, 64))
    drafter = GlideDrafter(GlideNetwork.build(target, net, torch.arange(64)), 6, 0.0, None)
    state = target.start()
    tokens = np.random.default_rng(0).integers(1, 60, size=21)
    target.forward(state, torch.tensor(tokens[:20]), None, drafter.needs)
    target.commit(state, range(20))

    def chain(token_seconds: float | None) -> int:
        drafter.token_seconds = token_seconds
        ctx = DraftContext(
            tokens,
            8,
            kv=lambda layer: target.kv(state, layer),
            kv_buffers=lambda layer: target.kv_buffers(state, layer),
            verify_seconds=lambda n: 1e9 + 0.001 * n,  # a step dear enough for any reach ≥ 64^-6
        )
        return len(drafter.propose(ctx))

    assert chain(None) == 6  # nothing measured yet: the chain runs to its depth
    assert chain(0.0) == 6  # free draft forwards: every token pays
    assert chain(2e9) == 1  # a draft forward dearer than a step: the first token only (no forward)


def test_a_window_drafts_as_the_network_over_its_last_tokens_only() -> None:
    """``window=W``: a fresh request's draft keeps only its last W positions (at their true
    positions) and reads the target's whole cache: a chain token drafted after that window gives
    the logits of one forward over the window and the token from a KV that starts at the window."""
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    torch.manual_seed(2)
    net = GlideNet(glide_config_for(model, 64))
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 2:
                p.copy_(quant.round_to_eight_bit(p * 4))
    drafter = GlideDrafter(GlideNetwork.build(target, net, torch.arange(64)), 8, 0.05, None, window=8)
    fast = drafter.fast
    assert fast is not None
    state = target.start()
    tokens = np.random.default_rng(3).integers(1, 90, size=31)
    target.forward(state, torch.tensor(tokens[:30]), None, drafter.needs)
    target.commit(state, range(30))
    ctx = DraftContext(tokens, 8, kv_buffers=lambda layer: target.kv_buffers(state, layer))
    windowed = _State([], None)
    with torch.inference_mode():
        a = drafter._forward(tokens.tolist(), 0, 30, windowed, ctx)
        assert windowed.fused is not None
        assert (windowed.fused.offset, windowed.fused.length) == (23, 8)
        b = drafter._forward([7], 31, 30, windowed, ctx)  # the chain continues after the window
        # the same rows in one forward, from a KV that starts at position 23
        reference = fast.new_kv()
        reference.offset = 23
        buffers = target.kv_buffers(state, net.cfg.target_layer)
        assert buffers is not None
        x = drafter.embed(torch.tensor([*tokens[23:].tolist(), 7])).float()
        expected = fast.forward(x, reference, buffers, torch.arange(23, 32).clamp(max=30))
    torch.testing.assert_close(b, expected, rtol=1e-5, atol=1e-5)
    assert a.shape == b.shape
