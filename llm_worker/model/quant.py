"""Weights that are exactly 4-bit or 8-bit blocks, packed for ``native``'s ``quant_linear``.

The default model ships as a GGUF file whose linear weights are Q4_1 (each block of 32 inputs of
an output row is ``d * q + m``, q in 0..15, d and m float16) and whose tied embedding / LM head is
Q8_0 (``d * q``, q in -128..127). De-quantised to float32 those are exact float32 numbers: the
float32 model *is* those blocks. Found again from the float32 weights (and checked bit for bit),
they can be read at 0.75 or 1.125 bytes a weight instead of 4 and rebuilt exactly in registers
(``csrc/quant_gemm.cpp``): the same float32 weights, 5x less memory traffic per decoded token.

A weight that is not exactly such blocks (any other checkpoint, a fine-tuned one, bfloat16)
packs to None and runs through the float32 GEMMs.

Example: the block [0.5, 0.75, 1.0, ...] with m = 0.5, d = 0.25 → q = [0, 1, 2, ...];
rebuilt as fma(0.25, q, 0.5) = the same numbers bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per quantisation block (GGUF's Q4_1 and Q8_0)
PANEL = 16  # output columns per packed panel (the kernel's two 8-lane vectors)


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] weight in ``quant_linear``'s layout (see ``csrc/quant_gemm.cpp``)."""

    codes: torch.Tensor  # 4-bit: [panels, k, 8] uint8 (two columns a byte); 8-bit: [panels, k, 16] int8
    scales: torch.Tensor  # [panels, k / 32, 16] float32
    offsets: torch.Tensor | None  # [panels, k / 32, 16] float32 (4-bit), None (8-bit)
    n: int
    k: int

    @property
    def bits(self) -> int:
        return 4 if self.offsets is not None else 8

    def nbytes(self) -> int:
        parts = [self.codes, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bitwise equality of two float32 tensors (tells -0.0 from 0.0)."""
    return a.view(torch.int32) == b.view(torch.int32)


def _as_half(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _neighbours(d: torch.Tensor) -> list[torch.Tensor]:
    """d (float16 values as float32) and its float16 neighbours above and below."""
    half = d.half()
    up = torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.half)).float()
    down = torch.nextafter(half, torch.tensor(0.0, dtype=torch.half)).float()
    return [d, up, down]


def _search(
    blocks: torch.Tensor,
    d0: torch.Tensor,
    rebuild: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For every block [n, kb, 32], the first scale among ``_neighbours(d0)`` whose codes
    ``rebuild(d)`` → (q [n, kb, 32] float, rebuilt weights) give the block back bit for bit:
    (q, d), or None if some block has none."""
    best_q = torch.zeros(blocks.shape)
    best_d = d0.clone()
    done = torch.zeros(d0.shape, dtype=torch.bool)
    for d in _neighbours(d0):
        q, rebuilt = rebuild(d)
        ok = _same_bits(rebuilt, blocks).all(-1) & ~done
        best_q[ok], best_d[ok] = q[ok], d[ok]
        done |= ok
        if bool(done.all()):
            return best_q, best_d
    return None


def _codes(x: torch.Tensor, d: torch.Tensor, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    """round(x / d) within [low, high] as ``dtype`` values (0 where d is 0), back as float32."""
    q = (x / torch.where(d > 0, d, torch.ones_like(d))[..., None]).round().clamp(low, high)
    return torch.where((d > 0)[..., None], q, torch.zeros_like(q)).to(dtype).float()  # -0.0 → 0


def _four_bit(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """blocks [n, kb, 32] → (q uint8 [n, kb, 32], d, m [n, kb]) with fma(d, q, m) == blocks bit
    for bit, or None. The block's least value is m (its q is 0); d is tried at the float16
    nearest (max - m) / 15 and at its float16 neighbours."""
    m = blocks.amin(-1)
    if not torch.equal(_as_half(m), m):
        return None

    def rebuild(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _codes(blocks - m[..., None], d, 0, 15, torch.uint8)
        return q, d[..., None] * q + m[..., None]  # d * q is exact: one rounding, as fma

    found = _search(blocks, _as_half((blocks.amax(-1) - m) / 15), rebuild)
    return None if found is None else (found[0].to(torch.uint8), found[1], m)


def _eight_bit(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """blocks [n, kb, 32] → (q int8 [n, kb, 32], d [n, kb]) with d * q == blocks bit for bit, or
    None (d at the float16 nearest max |w| / 127 or its neighbours)."""

    def rebuild(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _codes(blocks, d, -128, 127, torch.int8)
        return q, d[..., None] * q

    found = _search(blocks, _as_half(blocks.abs().amax(-1) / 127), rebuild)
    return None if found is None else (found[0].to(torch.int8), found[1])


def round_to_eight_bit(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] (k a multiple of 32) rounded to 8-bit blocks of 32 inputs (Q8_0): per
    block d = float16(max |w| / 127), w ≈ d · round(w / d) — exactly such blocks, so
    ``pack_exact`` packs the result (a network that is not stored quantised, e.g. a draft
    network, can then run on ``quant_linear``)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = _as_half(blocks.abs().amax(-1) / 127)
    return (d[..., None] * _codes(blocks, d, -128, 127, torch.int8)).reshape(n, k)


def _panels(x: torch.Tensor, panels: int) -> torch.Tensor:
    """[panels · 16, ...] rows → [panels, ..., 16]: each panel's 16 rows made the last dim."""
    return x.reshape(panels, PANEL, *x.shape[1:]).movedim(1, -1).contiguous()


def pack_exact(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` [n, k] (float32, CPU) as exact 4-bit blocks, else as exact 8-bit blocks, else
    None. Rows are padded with zero rows to whole panels of 16."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = torch.zeros(panels * PANEL, k)
    w[:n] = weight.detach().cpu()
    blocks = w.view(panels * PANEL, k // BLOCK, BLOCK)
    four = _four_bit(blocks)
    if four is not None:
        q, d, m = four
        codes = _panels(q.view(panels * PANEL, k), panels)  # [panels, k, 16]
        packed = codes[..., :8] | (codes[..., 8:] << 4)  # [panels, k, 8]
        return PackedWeight(packed.contiguous(), _panels(d, panels), _panels(m, panels), n, k)
    eight = _eight_bit(blocks)
    if eight is not None:
        q8, d = eight
        return PackedWeight(_panels(q8.view(panels * PANEL, k), panels), _panels(d, panels), None, n, k)
    return None
