"""The operations seam under the fast forward (llm_worker/model/ops.py): a new implementation of
``Ops`` plugs into the forward, and through it into the engine, without editing either; its GEMM
kernels are its own choice."""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch

from helpers.models import engine_for, greedy_tokens, prompts, tiny_model
from llm_worker.config import ModelConfig
from llm_worker.model import kernels, native, wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.kernels import ROLES, Kernel, KernelChoice, KernelReport, Linear, Weights
from llm_worker.model.ops import OPS, CallRows, Ops, OpsContext, register
from llm_worker.model.target import ForwardCall
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

NEEDS = ArtifactNeeds(hidden_layers=frozenset({0, 1, 2}), query_heads=((1, 0),))
IMPLEMENTATIONS = ["torch", "cpu-fused"]


class CountingOps:
    """A toy implementation: another implementation's operations, each call counted."""

    def __init__(self, inner: Ops) -> None:
        self.inner = inner
        self.name = f"counting-{inner.name}"
        self.kv_dtype = inner.kv_dtype
        self.calls: Counter[str] = Counter()

    def layout(self, calls: Any, total: int, pad: int) -> Any:
        self.calls["layout"] += 1
        assert all(isinstance(c, CallRows) for c in calls)
        return self.inner.layout(calls, total, pad)

    def scope(self, own_threads: bool) -> AbstractContextManager[None]:
        return self.inner.scope(own_threads)

    def choose_kernels(self, weights: Weights, requested: str) -> KernelChoice:
        self.calls["choose_kernels"] += 1
        return self.inner.choose_kernels(weights, requested)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> Linear:
        self.calls["linear"] += 1
        return self.inner.linear(weight, bias, kernel)

    def norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls["norm"] += 1
        return self.inner.norm(h, delta, weight, eps)

    def rope_store(
        self, layout: Any, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Any:
        self.calls["rope_store"] += 1
        return self.inner.rope_store(layout, layer, qkv, cos, sin)

    def attention(self, layout: Any, layer: int, q: torch.Tensor) -> torch.Tensor:
        self.calls["attention"] += 1
        return self.inner.attention(layout, layer, q)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        self.calls["activation"] += 1
        return self.inner.activation(gate_up)

    def logits(self, head: Linear, h: torch.Tensor) -> torch.Tensor:
        self.calls["logits"] += 1
        return self.inner.logits(head, h)

    def branching_rows_limit(self, length: int) -> int | None:
        return self.inner.branching_rows_limit(length)

    def variant(self) -> str:
        return self.inner.variant()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


def targets(name: str) -> tuple[FastLlamaTarget, FastLlamaTarget, CountingOps]:
    """The tiny model on the implementation ``name``, and on a counting wrapper of it."""
    if name == "cpu-fused" and native.load() is None:
        pytest.skip(f"the fused kernels do not run here: {native.unavailable_reason()}")
    base = wrap_model(tiny_model("llama", layers=2), None, ModelConfig(backend="fast", kernel="aten:1"))
    assert isinstance(base, FastLlamaTarget)
    plain = FastLlamaTarget(base.model, base.info, base.kernels, ops=name)
    made: list[CountingOps] = []

    def counting(ctx: OpsContext) -> CountingOps | None:
        inner = OPS[name](ctx)
        assert inner is not None
        made.append(CountingOps(inner))
        return made[-1]

    toy = FastLlamaTarget(base.model, base.info, base.kernels, ops=counting)
    assert toy.ops is made[0] and made[0].calls["linear"] == 4 * 2 + 1  # 4 GEMMs a layer, the head
    return plain, toy, made[0]


def run(target: FastLlamaTarget) -> list[Any]:
    """A prefill, a draft tree, then two requests in one forward (a decode row and a chain)."""
    outs: list[Any] = []
    with torch.inference_mode():
        first, second = target.start(), target.start()
        outs.append(target.forward(first, torch.tensor([3, 17, 42, 5, 9, 11, 23]), None, NEEDS))
        target.commit(first, range(7))
        outs.append(target.forward(second, torch.tensor([4, 8, 15]), None, NEEDS))
        target.commit(second, range(3))
        outs.append(
            target.forward(first, torch.tensor([7, 8, 9, 30, 31]), tree_buffers((-1, 0, -1, 0)), NEEDS)
        )
        target.commit(first, [0, 3])
        outs.extend(
            target.forward_many(
                [
                    ForwardCall(first, torch.tensor([12]), None, NEEDS),
                    ForwardCall(second, torch.tensor([16, 23, 42]), None, NEEDS, last_logits_only=True),
                ]
            )
        )
    return outs


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_toy_ops_plugs_into_the_forward_and_gives_the_same_numbers(name: str) -> None:
    plain, toy, counting = targets(name)
    expected, got = run(plain), run(toy)
    for want, out in zip(expected, got, strict=True):
        assert torch.equal(want.logits, out.logits)
        assert want.hidden.keys() == out.hidden.keys() == {0, 1, 2}
        for layer in want.hidden:
            assert torch.equal(want.hidden[layer], out.hidden[layer])
        assert torch.equal(want.queries[(1, 0)], out.queries[(1, 0)])
    forwards, layers = 4, 2
    assert counting.calls["layout"] == counting.calls["logits"] == forwards
    assert counting.calls["norm"] == forwards * (1 + 2 * layers)
    for op in ("rope_store", "attention", "activation"):
        assert counting.calls[op] == forwards * layers, op
    assert toy.kernel_info()["fused_kernels"] == (name == "cpu-fused")


def test_a_registered_ops_serves_the_engine_unchanged() -> None:
    """Registered by name, the toy runs under the engine (no engine, batching or server change):
    every mode's tokens are ``ar``'s, and ``ar``'s are the plain torch target's."""
    made: list[CountingOps] = []

    @register("counting-torch")
    def counting(ctx: OpsContext) -> CountingOps | None:
        inner = OPS["torch"](ctx)
        assert inner is not None
        made.append(CountingOps(inner))
        return made[-1]

    try:
        base = wrap_model(tiny_model("llama", layers=2), None, ModelConfig(backend="fast", kernel="aten:1"))
        assert isinstance(base, FastLlamaTarget)
        plain = FastLlamaTarget(base.model, base.info, base.kernels, ops="torch")
        toy = FastLlamaTarget(base.model, base.info, base.kernels, ops="counting-torch")
        prompt = prompts(96)[0]
        reference = greedy_tokens(engine_for(plain), prompt, "ar", 12)
        engine = engine_for(toy)
        for mode in ("ar", "pld"):
            assert greedy_tokens(engine, prompt, mode, 12) == reference, mode
        assert made[0].calls["attention"] > 0
    finally:
        del OPS["counting-torch"]


def test_unknown_or_unrunnable_ops_are_refused() -> None:
    base = wrap_model(tiny_model("llama", layers=2), None, ModelConfig(backend="fast", kernel="aten:1"))
    assert isinstance(base, FastLlamaTarget)
    with pytest.raises(KeyError):
        FastLlamaTarget(base.model, base.info, base.kernels, ops="no-such-ops")
    with pytest.raises(ValueError, match="cannot run"):
        FastLlamaTarget(base.model, base.info, base.kernels, ops=lambda ctx: None)


class OwnKernelsOps(CountingOps):
    """A toy that chooses its own GEMM kernels, as a CUDA implementation would: every role on
    ``aten:4`` whatever was requested, nothing measured."""

    KERNEL = Kernel("aten", 4)

    def choose_kernels(self, weights: Weights, requested: str) -> KernelChoice:
        self.calls["choose_kernels"] += 1
        assert set(weights) == set(ROLES) and len(weights["qkv"]) == 2 and len(weights["lm_head"]) == 1
        return dict.fromkeys(ROLES, self.KERNEL), None


def test_a_toy_ops_chooses_its_own_gemm_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for "auto" (``--kernel auto``), the forward runs every GEMM on the kernels the toy
    chose, without editing the forward: ``kernels``' measurement is never called, and the numbers
    are those of a forward handed the same kernels."""

    def no_measuring(*args: object, **kw: object) -> KernelReport:
        raise AssertionError("kernels.py measured for an implementation that chooses its own")

    monkeypatch.setattr(kernels, "load_or_measure_kernels", no_measuring)
    base = wrap_model(tiny_model("llama", layers=2), None, ModelConfig(backend="fast", kernel="aten:1"))
    assert isinstance(base, FastLlamaTarget)
    made: list[OwnKernelsOps] = []

    def own(ctx: OpsContext) -> OwnKernelsOps | None:
        inner = OPS["torch"](ctx)
        assert inner is not None
        made.append(OwnKernelsOps(inner))
        return made[-1]

    toy = FastLlamaTarget(base.model, base.info, "auto", ops=own)
    assert made[0].calls["choose_kernels"] == 1
    assert toy.kernels == dict.fromkeys(ROLES, OwnKernelsOps.KERNEL) and toy.min_rows == 4
    info = toy.kernel_info()
    assert info["gemm_kernels"] == dict.fromkeys(ROLES, "aten:4") and "gemm_kernel_candidates" not in info
    plain = FastLlamaTarget(base.model, base.info, dict.fromkeys(ROLES, OwnKernelsOps.KERNEL), ops="torch")
    for want, out in zip(run(plain), run(toy), strict=True):
        assert torch.equal(want.logits, out.logits)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_the_cpu_implementations_choose_by_kernels_measurement(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch and the fused kernels hand "auto" to ``kernels``' cached measurement (for the model's
    fingerprint, device and dtype), a kernel's name to every role, and refuse oneDNN where its
    prepacking cannot run."""
    plain, _, _ = targets(name)
    asked: list[tuple[object, ...]] = []
    chosen = {**dict.fromkeys(ROLES, "aten:2"), "lm_head": "aten:1"}

    def measured(*args: object, **kw: object) -> KernelReport:
        asked.append(args)
        return KernelReport(dict(chosen))

    monkeypatch.setattr(kernels, "load_or_measure_kernels", measured)
    auto = FastLlamaTarget(plain.model, plain.info, "auto", ops=name)
    assert len(asked) == 1 and asked[0][0] == plain.info.fingerprint
    assert asked[0][2:] == (torch.device("cpu"), torch.float32)
    assert {role: k.name for role, k in auto.kernels.items()} == chosen
    assert auto.kernel_info()["gemm_kernel_candidates"]["chosen"] == chosen
    forced = FastLlamaTarget(plain.model, plain.info, "aten:2", ops=name)
    assert forced.kernels == dict.fromkeys(ROLES, Kernel("aten", 2)) and len(asked) == 1
    monkeypatch.setattr(kernels, "onednn_available", lambda device, dtype: False)
    with pytest.raises(ValueError, match="oneDNN prepacking is not available"):
        FastLlamaTarget(plain.model, plain.info, "onednn:2", ops=name)
