"""Batch invariance of the fast forward: a token's outputs are bit-identical alone and inside
forwards of 2, 4, 9, 17, 33 and 65 rows, at any position, in float32 and bfloat16.

Each operation is checked on its own (GEMM kernels, RMSNorm, RoPE, SiLU·up, attention), then the
whole forward on a tiny random Llama and on the real model; the kernel choice is driven by fake
timing tables.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from helpers.models import snap_to_blocks, tiny_model
from llm_worker.config import ModelConfig
from llm_worker.model import kernels, wrap_model
from llm_worker.model.fast_llama import FastLlamaTarget
from llm_worker.model.kernels import Kernel, KernelReport, Linear
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import tree_buffers

SIZES = (2, 4, 9, 17, 33, 65)
DTYPES = (torch.float32, torch.bfloat16)
NEEDS = ArtifactNeeds(hidden_layers=frozenset({1, 2}), query_heads=((0, 1), (1, 3)))


def positions(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


FUSED = (True, False)
"""The fused kernels (``native``) and the torch-operation path, each batch-invariant."""


def tiny_fast(dtype: torch.dtype, kernel: str = "auto", fused: bool = True) -> FastLlamaTarget:
    model = tiny_model("llama", layers=2)
    if kernel.startswith("quant"):  # weights that are exact 4-/8-bit blocks, as the default model's
        snap_to_blocks(model)
    model = model.to(dtype)
    cfg = ModelConfig(backend="fast", kernel=kernel, dtype=str(dtype)[6:], fused_kernels=fused)
    target = wrap_model(model, None, cfg)
    assert isinstance(target, FastLlamaTarget)
    if fused:
        assert target.fused is not None, "the fused kernels must build and run on the test machines"
    return target


# -- operations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_chosen_gemm_kernel_is_row_invariant_for_the_model_shapes(dtype: torch.dtype) -> None:
    target = tiny_fast(dtype)
    gen = torch.Generator().manual_seed(1)
    layer = target.layers[0]
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, target.lm_head):
        x = torch.randn(max(SIZES), lin.weight.shape[1], generator=gen).to(dtype)
        for n in SIZES:
            out = lin(x[:n])
            for i in positions(n):
                assert torch.equal(out[i], lin(x[i : i + 1])[0]), (lin.kernel, n, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_operations_are_row_invariant(dtype: torch.dtype) -> None:
    target = tiny_fast(dtype, fused=False)
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(max(SIZES), 64, generator=gen)).to(dtype)
    heads = torch.randn(max(SIZES), 6, 16, generator=gen)  # RoPE runs in float32 (attention's dtype)
    gate_up = torch.randn(max(SIZES), 256, generator=gen).to(dtype)
    w = target.layers[0].ln_attn
    pos = torch.arange(max(SIZES)) * 7
    cos, sin = target.cos[pos][:, None], target.sin_signed[pos][:, None]

    def silu_up(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    ops = {
        "rms": lambda r: target._rms(x[r], w),
        "rope": lambda r: target._rotate(heads[r], cos[r], sin[r]),
        "silu_up": lambda r: silu_up(gate_up[r]),
    }
    for name, op in ops.items():
        for n in SIZES:
            out = op(slice(0, n))
            for i in positions(n):
                assert torch.equal(out[i], op(slice(i, i + 1))[0]), (name, n, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 5, 250, 300])
def test_attention_is_row_invariant_across_chunk_boundaries(dtype: torch.dtype, start: int) -> None:
    """A query alone (its keys up to itself) equals the same query inside n causal rows, also when
    the n rows reach into the next key chunk."""
    target = tiny_fast(dtype, fused=False)
    gen = torch.Generator().manual_seed(3)
    heads, kv, d = 4, 2, 16
    keys = torch.randn(kv, 512, d, generator=gen)  # attention runs in float32 on CPU, any weights dtype
    values = torch.cat((torch.randn(kv, 512, d, generator=gen), torch.ones(kv, 512, 1)), -1)
    q = torch.randn(max(SIZES), heads, d, generator=gen)
    for n in SIZES:
        out = target._attention(q[:n], keys, values, target._bias(start, n, None).repeat(2, 1))
        for i in positions(n):
            alone = target._attention(
                q[i : i + 1], keys, values, target._bias(start + i, 1, None).repeat(2, 1)
            )
            assert torch.equal(out[i], alone[0]), (n, i)


# -- the whole forward --------------------------------------------------------------------------


def prefilled(target: FastLlamaTarget, prefix: torch.Tensor, needs: ArtifactNeeds = NEEDS):
    """A state with ``prefix`` committed."""
    state = target.start()
    target.forward(state, prefix, None, needs)
    target.commit(state, range(len(prefix)))
    return state


def run_alone(
    target: FastLlamaTarget, prefix: torch.Tensor, tokens: list[int], needs: ArtifactNeeds = NEEDS
) -> list:
    """Each token of ``tokens`` decoded alone after ``prefix``: its ForwardOutput."""
    state = prefilled(target, prefix, needs)
    outs = []
    for t in tokens:
        outs.append(target.forward(state, torch.tensor([t]), None, needs))
        target.commit(state, [0])
    return outs


def assert_same_row(batch, r: int, alone, label: object) -> None:
    assert torch.equal(batch.logits[r], alone.logits[0]), label
    for layer, h in batch.hidden.items():
        assert torch.equal(h[r], alone.hidden[layer][0]), (label, "hidden", layer)
    for key, q in batch.queries.items():
        assert torch.equal(q[r], alone.queries[key][0]), (label, "query", key)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["auto", "onednn:4", "quant:1", "bf16:1"])
def test_forward_rows_equal_tokens_decoded_alone(dtype: torch.dtype, kernel: str, fused: bool) -> None:
    if kernel.startswith("onednn") and not kernels.onednn_available(torch.device("cpu"), dtype):
        pytest.skip("oneDNN prepacking is not available here")
    if kernel.startswith("quant") and dtype != torch.float32:
        pytest.skip("the packed-block GEMM is float32 only")
    if kernel.startswith("bf16") and not kernels.bf16_available(torch.device("cpu"), dtype):
        pytest.skip("the bfloat16 GEMM runs on bfloat16 with AVX512-BF16 only")
    target = tiny_fast(dtype, kernel, fused)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 96, (250,), generator=gen)  # drafts cross the 256-key chunk boundary
    tokens = torch.randint(0, 96, (max(SIZES),), generator=gen).tolist()
    alone = run_alone(target, prefix, tokens)
    with torch.inference_mode():
        for n in SIZES:
            out = target.forward(prefilled(target, prefix), torch.tensor(tokens[:n]), None, NEEDS)
            for i in positions(n):
                assert_same_row(out, i, alone[i], (dtype, kernel, n, i))


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_rows_and_prefill_rows_equal_tokens_decoded_alone(dtype: torch.dtype, fused: bool) -> None:
    """Branches of a tree (each node at its depth, siblings beside it) and rows of a prefill."""
    target = tiny_fast(dtype, fused=fused)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 96, (40,), generator=gen)
    # root 11 → 22 → 33 → 44, and 55 a sibling of 22 (parents index draft nodes; -1 = the root)
    tree = tree_buffers((-1, 0, 1, -1))
    toks = [11, 22, 33, 44, 55]
    with torch.inference_mode():
        state = target.start()
        target.forward(state, prefix, None, NEEDS)
        target.commit(state, range(len(prefix)))
        out = target.forward(state, torch.tensor(toks), tree, NEEDS)
    for path, rows in (([11, 22, 33, 44], [0, 1, 2, 3]), ([11, 55], [0, 4])):
        alone = run_alone(target, prefix, path)
        for step, row in enumerate(rows):
            assert_same_row(out, row, alone[step], (dtype, path, row))
    # prefill: row j of one forward over the whole prompt equals token j decoded after the rest
    with torch.inference_mode():
        full = target.forward(target.start(), prefix, None, NEEDS)
        for j in (1, 17, 39):
            alone = run_alone(target, prefix[:j], [int(prefix[j])])[0]
            assert_same_row(full, j, alone, (dtype, "prefill", j))


def test_a_branching_tree_is_trimmed_at_a_key_chunk_boundary_and_a_chain_is_not() -> None:
    """The torch-operation path's attention sums keys in a grid of 256-key chunks: a sibling's key
    may not push a node's key into the next chunk."""
    from llm_worker.config import SamplingParams
    from llm_worker.sampling import SamplingNoise
    from llm_worker.types import DraftTree
    from llm_worker.verify.steps import TREE, decider

    target = tiny_fast(torch.float32, fused=False)
    decide = decider(SamplingParams(), SamplingNoise(0, target.info.vocab_size))
    tree = DraftTree((5, 6, 7, 8), (-1, 0, -1, 2))
    chain = DraftTree.chain((5, 6, 7, 8))
    with torch.inference_mode():
        for draft, start, kept in ((tree, 254, 1), (tree, 250, 4), (chain, 254, 4)):
            state = target.start()
            target.forward(state, torch.zeros(start, dtype=torch.long), None, NEEDS)
            target.commit(state, range(start))
            assert target.branching_rows_limit(state) == 256 - start
            step = TREE.step(target, state, 3, draft, NEEDS, decide, start + 1)
            assert len(step.decided) == kept, (draft, start)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_attention_keeps_a_branching_tree_across_a_chunk_boundary(dtype: torch.dtype) -> None:
    """The fused attention has no key grid (a query sums its visible keys in order): no limit on a
    tree's rows, and a node whose key sits past its siblings' still equals the token decoded alone."""
    target = tiny_fast(dtype)
    gen = torch.Generator().manual_seed(6)
    prefix = torch.randint(0, 96, (254,), generator=gen)
    state = prefilled(target, prefix)
    assert target.branching_rows_limit(state) is None
    # root 11 with children 22 and 33; 44 under 33: 33's key at 256, decoded alone at 255
    toks = [11, 22, 33, 44]
    with torch.inference_mode():
        out = target.forward(state, torch.tensor(toks), tree_buffers((-1, -1, 1)), NEEDS)
    for path, rows in (([11, 22], [0, 1]), ([11, 33, 44], [0, 2, 3])):
        alone = run_alone(target, prefix, path)
        for step, row in enumerate(rows):
            assert_same_row(out, row, alone[step], (dtype, path, row))


@pytest.mark.parametrize("fused", FUSED)
def test_the_cache_is_bfloat16_with_bfloat16_weights_on_the_fused_kernels(fused: bool) -> None:
    """The fused kernels keep bfloat16 weights' keys and values in bfloat16 (the forward tests
    above run on it); the torch-operation path keeps its float32 cache."""
    target = tiny_fast(torch.bfloat16, fused=fused)
    state = prefilled(target, torch.arange(5))
    expected = torch.bfloat16 if fused else torch.float32
    keys, values = target.kv(state, 1)
    assert keys.dtype == values.dtype == expected and keys.shape[1] == 5
    assert target.kernel_info()["kv_cache_dtype"] == str(expected).removeprefix("torch.")
    assert tiny_fast(torch.float32, fused=fused).kernel_info()["kv_cache_dtype"] == "float32"


# -- the kernel choice --------------------------------------------------------------------------


def test_attention_padding_is_the_smallest_that_makes_the_batched_gemm_invariant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batched GEMM whose first rows come out differently below 4 rows (as MKL's on an AVX2 EPYC)
    gets padded to 4; one invariant everywhere is not padded."""
    real = torch.bmm

    def row_by_row(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # invariant by construction
        return torch.cat([real(a[:, i : i + 1], b) for i in range(a.shape[1])], dim=1)

    def small_rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = row_by_row(a, b)
        return out + 1e-3 if a.shape[1] < 4 else out

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "bmm", row_by_row)
    assert kernels.attention_min_rows(2, 2, 16, 64, 9, cpu, torch.float32) == 1
    monkeypatch.setattr(torch, "bmm", small_rows_differ)
    assert kernels.attention_min_rows(2, 2, 16, 64, 9, cpu, torch.float32) == 4


def test_a_kernel_that_cannot_run_here_is_reported_and_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bfloat16 path raises on processors without AVX-512: the candidate is skipped."""
    real = kernels.Linear

    def linear(w: torch.Tensor, b: torch.Tensor | None, k: Kernel) -> Linear:
        if k.library == "onednn":
            raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")
        return real(w, b, k)

    monkeypatch.setattr(kernels, "candidates", lambda d, t: [Kernel("aten", 1), Kernel("onednn", 4)])
    monkeypatch.setattr(kernels, "Linear", linear)
    monkeypatch.setattr(kernels, "is_invariant", lambda lin, x, rows: True)
    weights = {role: [(torch.randn(16, 8), None)] for role in kernels.ROLES}
    report = kernels.measure_kernels(weights, torch.device("cpu"), torch.float32, repeats=1)
    assert set(report.chosen.values()) == {"aten:1"}
    assert report.unavailable == {role: ["onednn:4"] for role in kernels.ROLES}
    assert KernelReport.from_json(report.to_json()).unavailable == report.unavailable


def test_choice_is_the_fastest_invariant_kernel_on_fake_timings() -> None:
    invariant = {"aten:1": False, "onednn:2": True, "onednn:4": True, "aten:4": True}
    seconds = {
        "aten:1": {1: 0.001, 8: 0.002},  # fastest, but not invariant: never chosen
        "onednn:2": {1: 0.020, 8: 0.025},
        "onednn:4": {1: 0.018, 8: 0.024},
        "aten:4": {1: 0.030, 8: 0.010},
    }
    assert kernels.choose(invariant, seconds) == "onednn:4"
    # single-row forwards weigh most (ROW_WEIGHTS): a faster 8-row time cannot buy a slow decode
    seconds["aten:4"] = {1: 0.0195, 8: 0.0225}
    assert kernels.choose(invariant, seconds) == "onednn:4"
    seconds["aten:4"] = {1: 0.017, 8: 0.020}
    assert kernels.choose(invariant, seconds) == "aten:4"
    assert kernels.choose({"aten:1": False}, {"aten:1": {1: 0.001}}) is None


def test_measure_checks_invariance_and_times_only_invariant_candidates(monkeypatch) -> None:
    """measure_kernels() on fake verdicts and a fake clock: the verdicts gate the timing, the timings
    decide, per GEMM role; nothing depends on this machine."""
    monkeypatch.setattr(
        kernels, "candidates", lambda d, t: [Kernel("aten", 1), Kernel("onednn", 2), Kernel("onednn", 4)]
    )
    monkeypatch.setattr(kernels, "Linear", lambda w, b, k: (w, k))
    # aten is never invariant; onednn:2 is not invariant for the weight of 3 columns (the "down" role)
    monkeypatch.setattr(
        kernels,
        "is_invariant",
        lambda lin, x, rows: (
            lin[1].library == "onednn" and not (lin[0].shape[1] == 3 and lin[1].min_rows == 2)
        ),
    )
    fake = {"onednn:2": 0.01, "onednn:4": 0.02}
    monkeypatch.setattr(
        kernels, "time_forward", lambda gemms, inputs, repeats: sum(fake[g[1].name] for g in gemms)
    )
    w, narrow = torch.zeros(8, 4), torch.zeros(4, 3)
    weights = {"qkv": [(w, None)] * 2, "o": [(w, None)] * 2, "gate_up": [(w, None)] * 2}
    weights |= {"down": [(narrow, None)] * 2, "lm_head": [(torch.zeros(16, 4), None)]}
    report = kernels.measure_kernels(weights, torch.device("cpu"), torch.float32)
    assert report.invariant["qkv"] == {"aten:1": False, "onednn:2": True, "onednn:4": True}
    assert set(report.seconds["qkv"]) == {"onednn:2", "onednn:4"}
    assert report.chosen == {
        "qkv": "onednn:2", "o": "onednn:2", "gate_up": "onednn:2", "down": "onednn:4", "lm_head": "onednn:2"
    }  # fmt: skip
    assert report.seconds["qkv"]["onednn:2"][1] == pytest.approx(0.02)  # a layer role counts every layer
    assert report.seconds["lm_head"]["onednn:2"][1] == pytest.approx(0.01)
    assert KernelReport.from_json(json.loads(json.dumps(report.to_json()))).chosen == report.chosen


CACHED = dict.fromkeys(kernels.ROLES, "aten:4")
LOAD_ARGS = (
    "fp",
    {},
    torch.device("cpu"),
    torch.float32,
)  # load_or_measure_kernels's (fingerprint, weights, ...)


@pytest.fixture
def measure_calls(tmp_path, monkeypatch) -> list[int]:
    """A fresh kernel cache and a fake ``measure`` (choosing ``CACHED``) that counts its calls."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    calls: list[int] = []

    def fake_measure(*args, **kw) -> KernelReport:
        calls.append(1)
        return KernelReport(dict(CACHED), {r: {"aten:4": True} for r in CACHED}, {})

    monkeypatch.setattr(kernels, "measure_kernels", fake_measure)
    return calls


def test_kernel_choice_is_cached_and_a_corrupt_cache_is_remeasured(measure_calls) -> None:
    assert kernels.load_or_measure_kernels(*LOAD_ARGS).chosen == CACHED
    again = kernels.load_or_measure_kernels(*LOAD_ARGS)
    assert (again.chosen, again.measured, len(measure_calls)) == (CACHED, False, 1)
    path = kernels.cache_path("fp", "float32", "cpu")
    assert json.loads(path.read_text())["chosen"] == CACHED
    path.write_text("{not json")
    assert kernels.load_or_measure_kernels(*LOAD_ARGS).chosen == CACHED
    assert len(measure_calls) == 2


def test_kernel_choices_of_another_processor_are_not_reused(measure_calls, monkeypatch) -> None:
    """Invariance is a property of a library on a machine: a cache shared by an Intel and an AMD
    node must not hand one's verdicts to the other."""
    for cpu in ("intel", "amd", "intel"):
        monkeypatch.setattr(kernels, "machine_id", lambda device, cpu=cpu: cpu)
        kernels.load_or_measure_kernels(*LOAD_ARGS)
    assert len(measure_calls) == 2


def test_machine_id_is_stable_and_short() -> None:
    from llm_worker.model.kernels import machine_id

    assert machine_id("cpu") == machine_id("cpu")
    assert len(machine_id("cpu")) == 10


def test_blocks_are_tried_when_no_kernel_is_invariant_at_every_row_count(monkeypatch) -> None:
    """As bfloat16 GEMMs of the real model's 576-input weights on a Sapphire Rapids VM: every
    product of up to 32 rows agrees with a row alone, larger ones do not. Blocks of at most 32 rows
    are then invariant, and checked at every size up to the block."""
    monkeypatch.setattr(kernels, "candidates", lambda d, t: [Kernel("onednn", 1), Kernel("onednn", 4)])
    checked: dict[str, list[int]] = {}

    def invariant_up_to_32(lin: Linear, x: torch.Tensor, rows) -> bool:
        checked[lin.kernel.name] = list(rows)
        return lin.kernel.max_rows is not None and lin.kernel.max_rows <= 32

    monkeypatch.setattr(kernels, "is_invariant", invariant_up_to_32)
    monkeypatch.setattr(kernels, "time_forward", lambda gemms, inputs, repeats: 0.01 * len(gemms))
    weights = {role: [(torch.zeros(8, 4), None)] * 2 for role in kernels.ROLES}
    report = kernels.measure_kernels(weights, torch.device("cpu"), torch.float32, repeats=1)
    assert set(report.invariant["qkv"]) == {
        "onednn:1", "onednn:4", "onednn:1:64", "onednn:4:64", "onednn:1:32", "onednn:4:32",
        "onednn:1:16", "onednn:4:16",
    }  # fmt: skip
    assert set(report.chosen.values()) == {"onednn:1:32"}  # ties go to the first: the larger block
    assert set(range(1, 33)) <= set(checked["onednn:1:32"])
    assert KernelReport.from_json(json.loads(json.dumps(report.to_json()))).chosen == report.chosen


def test_the_choice_is_timed_in_the_forwards_order(monkeypatch) -> None:
    """Alone, aten is the faster kernel for qkv and o, oneDNN for the others; inside a forward,
    every switch between the libraries costs extra (as mixing MKL into a oneDNN forward did on a
    Sapphire Rapids VM): the whole-forward timing keeps one library."""
    monkeypatch.setattr(kernels, "candidates", lambda d, t: [Kernel("aten", 4), Kernel("onednn", 1)])
    monkeypatch.setattr(kernels, "is_invariant", lambda lin, x, rows: True)

    def alone(role: str, kernel: Kernel) -> float:
        faster = "aten" if role in ("qkv", "o") else "onednn"
        return 1.0 if kernel.library == faster else 1.1

    def clock(gemms, inputs, repeats) -> float:
        names = [g.kernel.library for g in gemms]
        switches = sum(a != b for a, b in itertools.pairwise(names))
        return sum(alone(g.role, g.kernel) for g in gemms) + 0.5 * switches

    class Tagged(Linear):
        role = ""

    def tagged(w: torch.Tensor, b, k: Kernel) -> Tagged:
        lin = Tagged(w, b, Kernel("aten", 1))
        lin.kernel, lin.role = k, {8: "qkv", 6: "o", 16: "gate_up", 4: "down", 32: "lm_head"}[w.shape[0]]
        return lin

    monkeypatch.setattr(kernels, "Linear", tagged)
    monkeypatch.setattr(kernels, "time_forward", clock)
    shapes = {"qkv": (8, 4), "o": (6, 4), "gate_up": (16, 4), "down": (4, 8), "lm_head": (32, 4)}
    weights = {
        role: [(torch.zeros(*shape), None)] * (1 if role == "lm_head" else 2)
        for role, shape in shapes.items()
    }
    report = kernels.measure_kernels(weights, torch.device("cpu"), torch.float32, repeats=1)
    assert report.seconds["qkv"]["aten:4"][1] < report.seconds["qkv"]["onednn:1"][1]  # alone: aten
    assert report.seconds["down"]["aten:4"][1] > report.seconds["down"]["onednn:1"][1]  # alone: oneDNN
    assert set(report.chosen.values()) == {"onednn:1"}, report.chosen
    first = kernels.assignment_name(
        {r: ("aten:4" if r in ("qkv", "o") else "onednn:1") for r in kernels.ROLES}
    )
    assert first in report.forward_seconds  # the roles' own choices were timed first


def test_kernel_names_parse_and_bad_ones_are_refused() -> None:
    assert Kernel.parse("onednn:4") == Kernel("onednn", 4)
    assert Kernel.parse("aten:1").name == "aten:1"
    assert Kernel.parse("onednn:4:32") == Kernel("onednn", 4, 32)
    assert Kernel.parse("onednn:4:32").name == "onednn:4:32"
    for bad in ("mkl:1", "onednn", "onednn:0", "aten:x", "onednn:4:2", "onednn:1:2:3", "aten:1:0"):
        with pytest.raises(ValueError, match="unknown kernel"):
            Kernel.parse(bad)


def test_linear_pads_small_inputs_and_returns_only_their_rows() -> None:
    w = torch.randn(5, 3)
    lin = Linear(w, None, Kernel("aten", 4))
    x = torch.randn(2, 3)
    assert lin(x).shape == (2, 5)
    assert torch.allclose(lin(x), x @ w.T, atol=1e-6)


def test_a_blocked_linear_runs_large_products_in_blocks(monkeypatch) -> None:
    w = torch.randn(5, 3)
    lin = Linear(w, None, Kernel("aten", 4, 8))
    rows: list[int] = []
    real = F.linear

    def counted(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", counted)
    x = torch.randn(19, 3)
    assert torch.allclose(lin(x), x @ w.T, atol=1e-6)
    assert rows == [8, 8, 4]  # the last block of 3 rows padded to the minimum


# -- the real model -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["real_model", "real_model_bf16"])
def test_real_model_rows_equal_tokens_decoded_alone(request, fixture: str) -> None:
    target = request.getfixturevalue(fixture)[0]
    assert isinstance(target, FastLlamaTarget)
    gen = torch.Generator().manual_seed(6)
    prefix = torch.randint(0, target.info.vocab_size, (240,), generator=gen)
    tokens = torch.randint(0, target.info.vocab_size, (max(SIZES),), generator=gen).tolist()
    needs = ArtifactNeeds(hidden_layers=frozenset({17}))
    with torch.inference_mode():
        alone = run_alone(target, prefix, tokens, needs)
        for n in SIZES:
            out = target.forward(prefilled(target, prefix, needs), torch.tensor(tokens[:n]), None, needs)
            for i in positions(n):
                assert torch.equal(out.logits[i], alone[i].logits[0]), (fixture, n, i)
                assert torch.equal(out.hidden[17][i], alone[i].hidden[17][0]), (fixture, n, i)
