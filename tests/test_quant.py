"""Exact 4- and 8-bit blocks (llm_worker/model/quant.py) and the packed GEMM of the fused kernels:
the blocks are found again bit for bit, the product matches a float64 reference, and a row's
result is the same alone and inside products of 2 to 65 rows."""

from __future__ import annotations

import pytest
import torch

from helpers.models import exact_blocks
from llm_worker.model import quant
from llm_worker.model.kernels import Kernel, Linear

SIZES = (2, 4, 9, 17, 33, 65)


def unpack(p: quant.PackedWeight) -> torch.Tensor:
    """The packed weight rebuilt in Python: [n, k] float32."""
    panels, k = p.codes.shape[0], p.k
    if p.offsets is not None:
        low, high = p.codes & 15, p.codes >> 4  # [panels, k, 8] each
        q = torch.cat((low, high), -1).float()  # [panels, k, 16]
    else:
        q = p.codes.float()
    scales = p.scales.repeat_interleave(quant.BLOCK, 1)  # [panels, k, 16]
    w = scales * q + (p.offsets.repeat_interleave(quant.BLOCK, 1) if p.offsets is not None else 0)
    return w.movedim(-1, 1).reshape(panels * quant.PANEL, k)[: p.n]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(48, 64), (20, 96), (1, 32)])  # rows not a multiple of 16 too
def test_exact_blocks_are_found_again_bit_for_bit(bits: int, shape: tuple[int, int]) -> None:
    w = exact_blocks(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), bits)
    packed = quant.pack_exact(w)
    assert packed is not None and packed.bits == bits
    assert torch.equal(unpack(packed).view(torch.int32), w.view(torch.int32))


def test_weights_that_are_not_blocks_do_not_pack() -> None:
    gen = torch.Generator().manual_seed(1)
    assert quant.pack_exact(torch.randn(16, 64, generator=gen)) is None
    assert quant.pack_exact(exact_blocks(torch.randn(16, 64, generator=gen), 4)[:, :40].contiguous()) is None
    assert quant.pack_exact(exact_blocks(torch.randn(16, 64, generator=gen), 4).bfloat16()) is None
    w = exact_blocks(torch.randn(16, 64, generator=gen), 4)
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(9.0))  # one weight off by an ulp
    assert quant.pack_exact(w) is None or quant.pack_exact(w).bits == 8  # type: ignore[union-attr]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_matches_float64_and_is_row_invariant(fused, bits: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    w = exact_blocks(torch.randn(40, 96, generator=gen) * 0.1, bits)
    bias = torch.randn(40, generator=gen) if with_bias else None
    lin = Linear(w, bias, Kernel("quant", 1))
    x = torch.randn(max(SIZES), 96, generator=gen)
    out = lin(x)
    expected = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for n in SIZES:
        rows = lin(x[:n].clone())
        for i in range(n):
            assert torch.equal(rows[i], lin(x[i : i + 1].clone())[0]), (n, i)
    assert lin.nbytes() < w.numel() * 4 / 2  # codes and scales, rows padded to 16


def test_a_weight_that_is_not_blocks_cannot_be_a_quant_kernel() -> None:
    with pytest.raises(RuntimeError, match="not exact"):
        Linear(torch.randn(16, 64), None, Kernel("quant", 1))


def test_the_avx512_and_avx2_variants_agree_bit_for_bit(fused, tmp_path) -> None:
    """Where the processor has AVX-512 the packed GEMM runs 16 lanes at a time: the same FMA chain
    per output as the AVX2 code, so the same bits (compared in a process kept on AVX2)."""
    import os
    import subprocess
    import sys

    if not fused.wide():
        pytest.skip("no AVX-512 here: only the AVX2 variant runs")
    gen = torch.Generator().manual_seed(3)
    w4 = exact_blocks(torch.randn(40, 96, generator=gen) * 0.1, 4)
    w8 = exact_blocks(torch.randn(24, 64, generator=gen) * 0.1, 8)
    x4, x8 = torch.randn(70, 96, generator=gen), torch.randn(70, 64, generator=gen)
    torch.save({"w4": w4, "w8": w8, "x4": x4, "x8": x8}, tmp_path / "in.pt")
    script = (
        "import sys, torch\n"
        "from llm_worker.model.kernels import Kernel, Linear\n"
        "d = torch.load(sys.argv[1])\n"
        "out = {}\n"
        "for b in ('4', '8'):\n"
        "    lin = Linear(d['w' + b], None, Kernel('quant', 1))\n"
        "    out[b] = [lin(d['x' + b][:n].clone()) for n in (1, 2, 3, 4, 7, 13, 70)]\n"
        "torch.save(out, sys.argv[2])\n"
    )
    env = os.environ | {"SPECDRAFT_NATIVE_AVX512": "0"}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env, check=True
    )
    narrow = torch.load(tmp_path / "out.pt")
    for bits, w, x in (("4", w4, x4), ("8", w8, x8)):
        lin = Linear(w, None, Kernel("quant", 1))
        for n, expected in zip((1, 2, 3, 4, 7, 13, 70), narrow[bits], strict=True):
            assert torch.equal(lin(x[:n].clone()), expected), (bits, n)
