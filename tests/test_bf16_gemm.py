"""The fused kernels' bfloat16 GEMM (``bf16_linear``, kernel ``bf16:1``): float32 sums of bfloat16
products rounded once, the same chain per output at every row count, chosen only where the
processor has AVX512-BF16."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from llm_worker.model import kernels
from llm_worker.model.kernels import Kernel, Linear, pack_bf16

SIZES = (1, 2, 3, 5, 6, 7, 9, 13, 17, 33, 65)


@pytest.fixture(scope="module")
def fused(fused: ModuleType) -> ModuleType:
    """conftest's kernels, where they have the bfloat16 GEMM."""
    module = fused
    if not module.bf16_dot():
        pytest.skip("no AVX512-BF16 here: the bfloat16 GEMM is not a candidate")
    return module


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(40, 96), (960, 576), (576, 1536), (7, 64)])
def test_product_matches_float64_and_is_row_invariant(
    fused: ModuleType, shape: tuple[int, int], with_bias: bool
) -> None:
    n, k = shape  # 40, 7: a last panel of 8 and 7 outputs
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    lin = Linear(w, bias, Kernel("bf16", 1))
    x = torch.randn(max(SIZES), k, generator=gen).bfloat16()
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (max(SIZES), n)
    expected = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    # float32 sums: the only error of note is the final rounding to bfloat16 (8 bits)
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)
    for m in SIZES:
        rows = lin(x[:m].clone())
        for i in range(m):
            assert torch.equal(rows[i], lin(x[i : i + 1].clone())[0]), (shape, m, i)
    assert lin(x[:0]).shape == (0, n)


def test_packing_is_panels_of_sixteen_outputs_by_input_pairs() -> None:
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    packed = pack_bf16(w)
    assert packed.shape == (2, 3, 16, 2)
    assert packed[0, 1, 5].tolist() == [w[5, 2].item(), w[5, 3].item()]  # output 5, inputs 2 and 3
    assert packed[1, 2, 3].tolist() == [w[19, 4].item(), w[19, 5].item()]
    assert packed[1, 0, 4:].abs().sum() == 0  # outputs 20..31 are padding
    with pytest.raises(ValueError, match="odd number of inputs"):
        pack_bf16(torch.zeros(4, 5, dtype=torch.bfloat16))


def test_bad_arguments_are_errors_not_crashes(fused: ModuleType) -> None:
    packed = pack_bf16(torch.randn(40, 96).bfloat16())
    x = torch.randn(3, 96).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        fused.bf16_linear(x.float(), packed, None, 40)
    with pytest.raises(RuntimeError, match="packed"):  # another K than the weight's
        fused.bf16_linear(torch.randn(3, 64).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="packed"):  # more outputs than the panels hold
        fused.bf16_linear(x, packed, None, 64)
    with pytest.raises(RuntimeError, match="bias"):
        fused.bf16_linear(x, packed, torch.randn(8), 40)
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.bf16_linear(torch.randn(96, 3).bfloat16().t(), packed, None, 40)


def test_float32_weights_are_refused(fused: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="bfloat16 weights"):
        Linear(torch.randn(16, 64), None, Kernel("bf16", 1))


def test_a_candidate_only_for_bfloat16_on_the_cpu(fused: ModuleType) -> None:
    cpu = torch.device("cpu")
    assert Kernel("bf16", 1) in kernels.candidates(cpu, torch.bfloat16)
    assert Kernel("bf16", 1) not in kernels.candidates(cpu, torch.float32)
    assert Kernel.parse("bf16:1") == Kernel("bf16", 1)


def test_a_choice_made_without_it_is_cached_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECDRAFT_NATIVE_BF16=0 (or a processor without AVX512-BF16) chooses among the others:
    its cached choice must not be the one that includes ``bf16``."""
    monkeypatch.setattr(kernels, "bf16_available", lambda device, dtype: True)
    with_it = kernels.cache_path("abc", "bfloat16", "cpu")
    monkeypatch.setattr(kernels, "bf16_available", lambda device, dtype: False)
    assert kernels.cache_path("abc", "bfloat16", "cpu") != with_it
    assert kernels.cache_path("abc", "float32", "cpu").name.count("-bf16") == 0
