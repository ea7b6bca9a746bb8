"""GEMM kernels chosen by measurement, among the batch-invariant ones: the choice the torch and
fused CPU operations make (``requested_kernels``, through ``ops.Ops.choose_kernels``).

A token's logits must not depend on how many rows its forward had (see ``fast_llama``). Every
other operation of the fast forward is row-invariant by construction; a GEMM is not: BLAS
libraries pick a different code path (GEMV, another K blocking, a K split across threads) for
1, 2 or 3 rows than for many, and which sizes agree differs between libraries, dtypes and
machines (on an Intel Sapphire Rapids VM, float32: MKL's row 0 of a 1-row product differs from
the same row inside a 2-row product, oneDNN's prepacked kernel agrees from 2 rows up; bfloat16:
both agree everywhere).

A *kernel* here is a library plus a minimum row count: forwards with fewer rows are padded with
zero rows up to it, so that every row count runs the same code path; and, where no library is
invariant over every row count, a maximum: larger products run in blocks of at most that many
rows (``onednn:4:32``; on a Sapphire Rapids VM bfloat16 products of the real model's weights with
576 inputs change path above 32 rows). At start-up each candidate is checked bitwise on this
machine (a row alone vs the same row inside products of every size the engine uses, at the first
and the last position, with the model's own weights), the invariant ones are timed per GEMM role,
and then in the forward's own order (every layer's qkv, o, gate_up and down, then the LM head:
a kernel's cost beside the others' is not its cost alone — on that VM mixing MKL into a oneDNN
forward cost 2–3 ms a token more than its solo timing said); the fastest invariant assignment is
used. The verdicts and times are cached per model, dtype, device, thread count, torch version and
processor (``machine_id``), next to the cost curve (for half an hour only if other processes used
the cores meanwhile), and reported by ``specdraft bench``. Measuring shows progress on stderr.

Each GEMM of the forward (qkv, o, gate_up, down, lm_head: its own weight shape) gets its own
choice: invariance is a property of one weight's products, so different roles may use different
kernels. Example: for the qkv weight, candidates ``aten:1`` (not invariant), ``onednn:2``
(invariant, 20 ms per token) and ``onednn:4`` (invariant, 18 ms) → ``onednn:4``: a 1-row decode
multiplies 3 zero rows too, and is still the fastest.

Two candidates are the fused kernels' own and invariant by construction (one chain per output,
whatever the rows): ``quant:1`` for float32 weights that are exact 4-/8-bit blocks, ``bf16:1`` for
bfloat16 weights where the processor has AVX512-BF16 (on a 2-core Zen 4 EPYC it replaced oneDNN
for every bfloat16 GEMM of the default model: a decode step 17.6 → 11.9 ms at 512 keys).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llm_worker.model import native, quant
from llm_worker.model.attention_kernels import ATTENTION_PADS as ATTENTION_PADS
from llm_worker.model.attention_kernels import attention_min_rows as attention_min_rows
from llm_worker.model.attention_kernels import pad_rows_bmm as pad_rows_bmm
from llm_worker.model.kernel_estimate import estimate_seconds
from specdraft.common import LoadWatch, Progress, atomic_write_text, cache_root, file_lock

log = logging.getLogger(__name__)

LIBRARIES = ("aten", "onednn", "quant", "bf16")
"""aten: ``F.linear`` (MKL on CPU, cuBLAS on CUDA); onednn: weights prepacked for oneDNN (CPU);
quant: float32 weights that are exactly 4- or 8-bit blocks (the default model's GGUF Q4_1 / Q8_0),
read packed and rebuilt exactly by the fused kernels (``quant``, ``native``; CPU, float32);
bf16: bfloat16 weights packed by input pairs for the fused kernels' AVX512-BF16 GEMM (CPU,
bfloat16; row-invariant by construction, like ``quant``)."""
PAD_ROWS = (1, 2, 4, 8, 16)
BLOCK_ROWS = (64, 32, 16)
"""Largest blocks tried, largest first, for a role no unblocked candidate is invariant for."""
CHECK_ROWS = (*range(1, 18), 24, 33, 48, 65, 128, 257, 1024)
"""Row counts a row alone is compared with: every draft size up to 16, larger trees and batches,
and prefill chunks."""
TIME_ROWS = (1, 2, 4, 8, 16, 32, 64)
FORWARD_ROWS = (1, 4, 16, 64)
"""Row counts at which whole assignments are timed in the forward's order."""
ROW_WEIGHTS = {1: 64.0, 2: 16.0, 4: 16.0, 8: 16.0, 16: 16.0, 32: 4.0, 64: 8.0}
"""How often a forward of each timed size comes in the score (``score``), after one 128-token
answer to a 512-token prompt: 64 single-row forwards (``ar``'s all, and a speculative mode's
steps without a draft), 64 verifying drafts of 2 to 32 rows, and the prompt's prefill (two
256-row chunks, about eight times a 64-row forward). A workload's shape, not a machine's speed."""
FORWARD_CANDIDATES = 3
"""Per role, the invariant candidates (the fastest alone first) tried in the forward's order."""


@dataclass(frozen=True)
class Kernel:
    library: str
    min_rows: int
    max_rows: int | None = None  # None: any number of rows in one product

    @property
    def name(self) -> str:
        base = f"{self.library}:{self.min_rows}"
        return base if self.max_rows is None else f"{base}:{self.max_rows}"

    @staticmethod
    def parse(text: str) -> Kernel:
        """``"onednn:4"`` → Kernel("onednn", 4); ``"onednn:4:32"`` → Kernel("onednn", 4, 32)."""
        library, *rows = text.split(":")
        ok = library in LIBRARIES and len(rows) in (1, 2) and all(r.isdigit() and int(r) >= 1 for r in rows)
        if not ok or (len(rows) == 2 and int(rows[1]) < int(rows[0])):
            raise ValueError(
                f"unknown kernel {text!r}: expected LIBRARY:MIN_ROWS[:MAX_ROWS] with LIBRARY in {LIBRARIES}"
            )
        return Kernel(library, int(rows[0]), int(rows[1]) if len(rows) == 2 else None)


ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
"""The GEMMs of a forward, each with its own weight shape and its own kernel choice."""


@dataclass
class KernelReport:
    """What was measured, per GEMM role: the chosen kernel, each candidate's invariance, and the
    invariant candidates' seconds per forward (a layer role's time counts all layers)."""

    chosen: dict[str, str]  # role -> kernel name
    invariant: dict[str, dict[str, bool]] = field(default_factory=dict)  # role -> kernel -> verdict
    seconds: dict[str, dict[str, dict[int, float]]] = field(
        default_factory=dict
    )  # role -> kernel -> rows -> s
    unavailable: dict[str, list[str]] = field(default_factory=dict)  # role -> kernels that cannot run here
    forward_seconds: dict[str, dict[int, float]] = field(
        default_factory=dict
    )  # assignment ("qkv=..,o=..") -> rows -> s of the GEMMs of one forward, in its order
    measured: bool = True

    def kernels(self) -> dict[str, Kernel]:
        return {role: Kernel.parse(name) for role, name in self.chosen.items()}

    def to_json(self) -> dict[str, object]:
        return {
            "format": 4,
            "chosen": self.chosen,
            "invariant": self.invariant,
            "ms_per_forward": {
                role: {k: {str(n): round(1000 * t, 3) for n, t in v.items()} for k, v in by_kernel.items()}
                for role, by_kernel in self.seconds.items()
            },
            "unavailable": self.unavailable,
            "ms_per_forward_in_order": {
                name: {str(n): round(1000 * t, 3) for n, t in v.items()}
                for name, v in self.forward_seconds.items()
            },
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> KernelReport:
        if data.get("format") != 4 or set(data["chosen"]) != set(ROLES):
            raise ValueError("another format")
        return KernelReport(
            chosen={str(r): str(k) for r, k in data["chosen"].items()},
            invariant={str(r): {str(k): bool(v) for k, v in d.items()} for r, d in data["invariant"].items()},
            seconds={
                str(r): {str(k): {int(n): float(ms) / 1000 for n, ms in v.items()} for k, v in d.items()}
                for r, d in data["ms_per_forward"].items()
            },
            unavailable={str(r): [str(k) for k in v] for r, v in data.get("unavailable", {}).items()},
            forward_seconds={
                str(a): {int(n): float(ms) / 1000 for n, ms in v.items()}
                for a, v in data.get("ms_per_forward_in_order", {}).items()
            },
        )


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN weights run here in ``dtype`` (its bfloat16 path needs AVX-512 or
    AVX-NE-CONVERT: on an AVX2-only processor only float32 is offered)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _onednn_runs(dtype)
    )


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    try:
        Linear(torch.zeros(8, 8, dtype=dtype), None, Kernel("onednn", 1))(torch.zeros(1, 8, dtype=dtype))
    except RuntimeError as exc:
        log.info("oneDNN's prepacked %s GEMM cannot run on this processor: %s", dtype, exc)
        return False
    return True


def quant_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed-block GEMM runs here (a weight may still not be exactly blocks)."""
    return device.type == "cpu" and dtype == torch.float32 and native.load() is not None


def bf16_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the bfloat16 GEMM of the fused kernels runs here (a processor with AVX512-BF16)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    fused = native.load()
    return fused is not None and bool(fused.bf16_dot())


def candidates(device: torch.device, dtype: torch.dtype) -> list[Kernel]:
    libraries = ["aten"] + (["onednn"] if onednn_available(device, dtype) else [])
    padded = [Kernel(lib, rows) for lib in libraries for rows in PAD_ROWS]
    # invariant at every row count by construction: no padding, no blocks
    own = [Kernel("quant", 1)] if quant_available(device, dtype) else []
    own += [Kernel("bf16", 1)] if bf16_available(device, dtype) else []
    return padded + own


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A [n, k] weight (k even) as ``bf16_linear`` reads it: panels of 16 outputs (the last
    zero-padded) by pairs of inputs, [ceil(n / 16), k / 2, 16, 2] bfloat16."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"bf16: a weight with an odd number of inputs ({k}) cannot be packed by pairs")
    panels = -(-n // 16)
    padded = weight.new_zeros(panels * 16, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def blocked(kernels: Sequence[Kernel]) -> list[Kernel]:
    """The blocked variants of ``kernels`` (``BLOCK_ROWS``), largest blocks first."""
    return [
        Kernel(k.library, k.min_rows, block) for block in BLOCK_ROWS for k in kernels if k.min_rows <= block
    ]


class Linear:
    """y = x W^T + b through one kernel for every row count: x [n, in] → [n, out]; fewer rows
    than the kernel's minimum are padded with zero rows, more than its maximum run in blocks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out]
        self.kernel = kernel
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight, None) if kernel.library == "onednn" else None
        )
        self.blocks: quant.PackedWeight | None = None
        self.fused: Any = None
        if kernel.library == "quant":
            self.fused = native.load()
            self.blocks = quant.pack_exact(weight) if self.fused is not None else None
            if self.blocks is None:
                raise RuntimeError("quant: the weight is not exact 4- or 8-bit blocks (or no fused kernels)")
        self.pairs: torch.Tensor | None = None
        if kernel.library == "bf16":
            if not bf16_available(weight.device, weight.dtype):
                raise RuntimeError("bf16: needs bfloat16 weights and the fused kernels with AVX512-BF16")
            self.fused = native.load()
            self.pairs = pack_bf16(weight)
            self.bias = bias.float() if bias is not None else None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this product holds: its weight and bias, and the packed forms of them."""
        b = self.blocks
        packed = (b.codes, b.scales, b.offsets) if b is not None else ()
        return [t for t in (self.weight, self.bias, self.packed, self.pairs, *packed) if t is not None]

    def nbytes(self) -> int:
        """Bytes of weights one product reads."""
        if self.blocks is not None:
            return self.blocks.nbytes()
        if self.pairs is not None:
            return self.pairs.numel() * self.pairs.element_size()
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        block = self.kernel.max_rows
        if block is not None and x.shape[0] > block:
            return torch.cat([self._product(x[i : i + block]) for i in range(0, x.shape[0], block)])
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            b = self.blocks
            return self.fused.quant_linear(x.contiguous(), b.codes, b.scales, b.offsets, self.bias, b.n)
        if self.pairs is not None:
            return self.fused.bf16_linear(x.contiguous(), self.pairs, self.bias, self.weight.shape[0])
        n = x.shape[0]
        pad = self.kernel.min_rows - n
        if pad > 0:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y[:n] if pad > 0 else y


ALL_PLACES_UP_TO = 65
"""Every row of a product up to this place is compared with the row alone (tiles of 16 rows made
row 16 of a 32-row bfloat16 product differ on a Sapphire Rapids VM, its first and last agreeing)."""


def is_invariant(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: Sequence[int]
) -> bool:
    """Whether row i of ``linear(x[:m])`` equals ``linear(x[i:i+1])`` bit for bit, for every m in
    ``rows``, at every place i below ``ALL_PLACES_UP_TO`` and at the middle and last row
    (x: [max(rows), in])."""
    alone: dict[int, torch.Tensor] = {}
    for m in rows:
        out = linear(x[:m])
        for i in sorted({*range(min(m, ALL_PLACES_UP_TO)), m // 2, m - 1}):
            if i not in alone:
                alone[i] = linear(x[i : i + 1])[0]
            if not torch.equal(out[i], alone[i]):
                return False
    return True


def time_forward(
    gemms: Sequence[Callable[[torch.Tensor], torch.Tensor]], inputs: Sequence[torch.Tensor], repeats: int
) -> float:
    """Median seconds of one pass over ``gemms`` (each applied to its input)."""
    samples = []
    for _ in range(repeats + 1):  # the first warms up
        begin = time.perf_counter()
        for gemm, x in zip(gemms, inputs, strict=True):
            gemm(x)
        samples.append(time.perf_counter() - begin)
    samples = sorted(samples[1:])
    return samples[len(samples) // 2]


def choose(invariant: Mapping[str, bool], seconds: Mapping[str, Mapping[int, float]]) -> str | None:
    """The invariant kernel with the lowest ``score``; None if no candidate is invariant. Ties go
    to the earlier name in ``invariant``."""
    best, best_score = None, float("inf")
    for name, ok in invariant.items():
        if not ok or name not in seconds:
            continue
        if score(seconds[name]) < best_score:
            best, best_score = name, score(seconds[name])
    return best


def measure_kernels(
    weights: Weights,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int = 3,
) -> KernelReport:
    """Check and time every candidate for each GEMM role, then choose in the forward's order.
    ``weights``: role -> its weight (and bias) in every layer, as the forward multiplies them.
    Invariance is checked on the first (the shapes are the same in every layer); a role no
    candidate is invariant for gets blocked candidates (``BLOCK_ROWS``). The time is one pass
    over all of a role's layers, so that each weight is read from memory as it would be; the
    choice then tries the best candidates of each role in whole forwards (``choose_in_order``).
    Inputs are random, scaled like normalised activations."""
    gen = torch.Generator().manual_seed(0)
    report = KernelReport(chosen={})
    inputs: dict[str, torch.Tensor] = {}
    per_candidate, per_assignment, assignments = estimate_seconds(weights, device, dtype, repeats)
    total = len(candidates(device, dtype)) * sum(per_candidate.values()) + assignments * per_assignment
    progress = Progress("choosing GEMM kernels on this machine: checking and timing", total)
    done = 0.0

    def advance(seconds: float) -> None:
        nonlocal done
        done += seconds
        progress.update(done / total)

    for role in ROLES:
        layers = weights[role]
        weight = layers[0][0]
        x = torch.randn(max(CHECK_ROWS), weight.shape[1], generator=gen).to(device=device, dtype=dtype)
        inputs[role] = x
        rows = CHECK_ROWS if role != "lm_head" else [m for m in CHECK_ROWS if m <= 128]
        invariant: dict[str, bool] = {}
        seconds: dict[str, dict[int, float]] = {}
        runnable: list[Kernel] = []

        for stage in ("unblocked", "blocked"):
            if stage == "blocked":
                if any(invariant.values()):
                    break
                log.info("no GEMM kernel is row-invariant for %s %s at every row count: blocks", role, dtype)
            for kernel in candidates(device, dtype) if stage == "unblocked" else blocked(list(runnable)):
                sizes = rows if kernel.max_rows is None else sorted({*rows, *range(1, kernel.max_rows + 1)})
                try:
                    invariant[kernel.name] = is_invariant(Linear(*layers[0], kernel), x, sizes)
                except RuntimeError as exc:  # e.g. oneDNN's bfloat16 path needs AVX-512 or AVX-NE-CONVERT
                    log.info("GEMM kernel %s cannot run here (%s %s): %s", kernel.name, role, dtype, exc)
                    report.unavailable.setdefault(role, []).append(kernel.name)
                    continue
                runnable.append(kernel)
                if invariant[kernel.name]:
                    linears = [Linear(w, b, kernel) for w, b in layers]
                    seconds[kernel.name] = {
                        n: time_forward(linears, [x[:n]] * len(linears), repeats) for n in TIME_ROWS
                    }
                    del linears
                advance(per_candidate[role])
        chosen = choose(invariant, seconds)
        if chosen is None:
            chosen = runnable[-1].name
            log.error(
                "no batch-invariant GEMM kernel for %s %s on this machine (%s, %s): tokens may differ "
                "between modes; using %s",
                role,
                tuple(weight.shape),
                device,
                dtype,
                chosen,
            )
        report.chosen[role] = chosen
        report.invariant[role] = invariant
        report.seconds[role] = seconds
    report.chosen = choose_in_order(weights, inputs, report, repeats, lambda: advance(per_assignment))
    progress.done()
    return report


def score(seconds: Mapping[int, float]) -> float:
    """Σ_n w(n) t(n), w from ``ROW_WEIGHTS`` (seconds: rows -> seconds of a forward's GEMMs)."""
    return sum(ROW_WEIGHTS.get(n, 1.0) * t for n, t in seconds.items())


def assignment_name(assignment: Mapping[str, str]) -> str:
    return ",".join(f"{role}={assignment[role]}" for role in ROLES)


def choose_in_order(
    weights: Weights,
    inputs: Mapping[str, torch.Tensor],
    report: KernelReport,
    repeats: int,
    on_timed: Callable[[], None] = lambda: None,
) -> dict[str, str]:
    """Whole forwards' GEMMs timed in the forward's order at ``FORWARD_ROWS``: the roles' own
    choices and, per library, every role on its best kernel of that library; from the fastest of
    those, one pass over the roles: each role's most promising invariant candidates (the best of
    each library and the ``FORWARD_CANDIDATES`` best alone) replace its kernel, and a replacement
    that lowers the score is kept. Roles with no invariant candidate keep theirs. The timings
    land in ``report.forward_seconds``; ``on_timed`` is called after each assignment timed."""
    linears: dict[tuple[str, str], list[Linear]] = {}

    def timed(assignment: dict[str, str]) -> float:
        name = assignment_name(assignment)
        if name not in report.forward_seconds:
            order: list[Linear] = []
            xs: list[torch.Tensor] = []
            for role in ROLES:
                key = (role, assignment[role])
                if key not in linears:
                    kernel = Kernel.parse(assignment[role])
                    linears[key] = [Linear(w, b, kernel) for w, b in weights[role]]
            for i in range(len(weights["qkv"])):
                for role in ("qkv", "o", "gate_up", "down"):
                    order.append(linears[(role, assignment[role])][i])
                    xs.append(inputs[role])
            order.append(linears[("lm_head", assignment["lm_head"])][0])
            xs.append(inputs["lm_head"])
            report.forward_seconds[name] = {
                n: time_forward(order, [x[:n] for x in xs], repeats) for n in FORWARD_ROWS
            }
            on_timed()
        return score(report.forward_seconds[name])

    def ranked(role: str) -> list[str]:
        alone = report.seconds.get(role, {})
        return sorted(alone, key=lambda k: score(alone[k]))

    starts = [dict(report.chosen)]
    for library in LIBRARIES:
        uniform = dict(report.chosen)
        for role in ROLES:
            uniform[role] = next((k for k in ranked(role) if k.startswith(library + ":")), uniform[role])
        starts.append(uniform)
    best, best_score = starts[0], timed(starts[0])
    for start in starts[1:]:
        if (start_score := timed(start)) < best_score:
            best, best_score = start, start_score
    for role in ROLES:
        ranked_role = ranked(role)
        tries = dict.fromkeys(ranked_role[:FORWARD_CANDIDATES])
        for library in LIBRARIES:
            tries.update(dict.fromkeys([k for k in ranked_role if k.startswith(library + ":")][:1]))
        for kernel in tries:
            if kernel == best[role]:
                continue
            trial = {**best, role: kernel}
            trial_score = timed(trial)
            if trial_score < best_score:
                best, best_score = trial, trial_score
        for key in [k for k in linears if k[0] == role and k[1] != best[role]]:
            del linears[key]  # prepacked copies no later trial uses
    return best


def machine_id(device: str) -> str:
    """A short id of the processor the verdicts were measured on: invariance is a property of a
    library on a machine, so a cache shared between, say, an Intel and an AMD node must not
    carry one's verdicts to the other."""
    parts = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("vendor_id", "model name", "cpu family", "model\t", "flags")):
                    parts.append(line.split(":", 1)[-1].strip())
                if line.strip() == "":  # the first processor is enough
                    break
    except OSError:
        parts.append(platform.processor())
    if device.startswith("cuda") and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(torch.device(device)))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:10]


Weights = Mapping[str, Sequence[tuple[torch.Tensor, torch.Tensor | None]]]
"""Every GEMM role's weight and bias, one per layer, as the forward multiplies them."""
KernelChoice = tuple[dict[str, Kernel], KernelReport | None]
"""The kernel of each GEMM role (``ROLES``), and what was measured to choose it (None: nothing)."""


def requested_kernels(
    requested: str, fingerprint: str, weights: Weights, device: torch.device, dtype: torch.dtype
) -> KernelChoice:
    """The choice among this module's candidates, as the CPU operations make it
    (``ops.Ops.choose_kernels``): ``requested`` "auto" is ``load_or_measure_kernels``' on the
    weights; else one kernel's name (``--kernel``) for every role, refused where it is oneDNN's
    and oneDNN prepacking cannot run here."""
    if requested == "auto":
        report = load_or_measure_kernels(fingerprint, weights, device, dtype)
        return report.kernels(), report
    kernel = Kernel.parse(requested)
    if kernel.library == "onednn" and not onednn_available(device, dtype):
        raise ValueError(f"kernel {requested!r}: oneDNN prepacking is not available for this device/dtype")
    return dict.fromkeys(ROLES, kernel), None


def cache_path(fingerprint: str, dtype: str, device: str) -> Path:
    own = "-bf16" if dtype == "bfloat16" and bf16_available(torch.device(device), torch.bfloat16) else ""
    key = (
        f"{fingerprint}-{dtype}-{device}-t{torch.get_num_threads()}-torch{torch.__version__}"
        f"-cpu{machine_id(device)}-{native.build_name().removeprefix('specdraft_fused_')[:8]}{own}"
    )  # the fused kernels' build: a changed packed GEMM is timed again; SPECDRAFT_NATIVE_BF16=0
    # (no bfloat16 GEMM of theirs) is another choice
    return cache_root() / "kernels" / (key.replace("/", "_").replace(":", "_") + ".json")


def load_or_measure_kernels(
    fingerprint: str,
    weights: Weights,
    device: torch.device,
    dtype: torch.dtype,
    use_cache: bool = True,
) -> KernelReport:
    """The cached choice, else a measured one, then cached: for good if no other process used
    this one's cores meanwhile (``specdraft.common.LoadWatch``), else for ``PROVISIONAL_SECONDS``
    (timings taken under load must not choose for every later run). Processes sharing the cache
    take turns (a lock file beside it): workers started together on one machine measure once and
    all use that choice, so they compute the same logits (another kernel sums in another order)."""
    path = cache_path(fingerprint, str(dtype).removeprefix("torch."), str(device))
    if not use_cache:
        with torch.inference_mode():
            return measure_kernels(weights, device, dtype)
    with file_lock(path.with_name(path.name + ".lock")):
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                report = KernelReport.from_json(data)
                report.measured = False
                if "under_load" not in data or time.time() - path.stat().st_mtime < PROVISIONAL_SECONDS:
                    return report
                log.info(
                    "choosing again: the cached kernel choice was timed under load (%s)", data["under_load"]
                )
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("ignoring unreadable kernel choice %s: %s", path, exc)
        log.info(
            "choosing GEMM kernels: checking batch invariance and timing (once per model, dtype, device)"
        )
        with torch.inference_mode(), LoadWatch(torch.get_num_threads()) as watch:
            report = measure_kernels(weights, device, dtype)
        data = report.to_json()
        if watch.busy:
            data["under_load"] = watch.describe()
            log.warning(
                "the GEMM kernels were timed under load (%s): the choice serves runs started in the "
                "next %.0f minutes only",
                watch.describe(),
                PROVISIONAL_SECONDS / 60,
            )
        atomic_write_text(path, json.dumps(data))
        return report


PROVISIONAL_SECONDS = 1800.0
"""How long a kernel choice timed under load (``LoadWatch``) is reused: long enough for workers
started together (and a test run) to share one choice and so compute the same logits, not so
long that a start-up that shared its cores chooses for good; the first start after it measures
again. A cost curve measured under load is not cached at all: it takes seconds, not minutes."""


def fastest_dtype(
    dtypes: Sequence[torch.dtype], rows: int, in_features: int, out_features: int, device: str = "cpu"
) -> torch.dtype:
    """The dtype whose ``rows`` × ``in_features`` → ``out_features`` GEMM runs fastest here
    (median of a few runs): bulk work such as writing training data picks its dtype by measurement,
    since the answer differs by processor (bfloat16 is 2-3× faster than float32 with AMX, several
    times slower on AVX2 alone)."""
    gen = torch.Generator().manual_seed(0)
    best, best_seconds = dtypes[0], float("inf")
    for dtype in dtypes:
        x = torch.randn(rows, in_features, generator=gen).to(device=device, dtype=dtype)
        w = torch.randn(out_features, in_features, generator=gen).to(device=device, dtype=dtype)
        seconds = time_forward([functools.partial(F.linear, weight=w)], [x], repeats=5)
        if seconds < best_seconds:
            best, best_seconds = dtype, seconds
    return best
