"""The operations seam under the fast forward: what ``forward.Forward``'s layer loop asks of a
backend, written once against this interface.

A forward over several calls embeds every call's rows, then per layer: residual add + RMSNorm
(``norm``), the fused q/k/v GEMM (``linear``'s layer), RoPE and the KV cache write (``rope_store``),
attention over each row's visible cached keys (``attention``), the output GEMM, ``norm``, the
gate/up GEMM, SiLU·up (``activation``), the down GEMM; then the final ``norm`` and ``logits``.
Everything a backend needs to know about the calls (their rows, caches, masks) it lays out once
per forward in ``layout``, from the calls' places (``CallRows``); the forward passes the layout
back to ``rope_store`` and ``attention`` untouched.

The GEMMs' kernels are the implementation's choice too (``choose_kernels``): the forward hands it
every GEMM role's weights once, at load, and runs each role on the kernel it returns.

Implementations: ``ops_torch.TorchOps`` (torch operations, any device: the ``--no-fused`` path)
and ``ops_cpu.FusedCpuOps`` (the fused CPU kernels of ``native``), both choosing their kernels by
``kernels``' measurement; ``ops_triton.TritonOps`` (row-invariant Triton kernels, the default on
CUDA), whose GEMM is its own kernel, chosen without measuring. Each is
made from an ``OpsContext`` by a factory named in ``OPS``. Every implementation must keep each
row's numbers independent of the other rows of its forward (batch invariance, see ``fast_llama``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llm_worker.model.kernels import Kernel, KernelChoice, Linear, Weights
from llm_worker.model.kv_pool import KVState
from llm_worker.model.target import TargetInfo
from llm_worker.verify.tree import TreeBuffers


@dataclass(frozen=True)
class OpsContext:
    """What an implementation is made with: the model's shape, where and in what it computes."""

    info: TargetInfo
    device: torch.device
    dtype: torch.dtype  # the weights' (and the hidden states')
    attn_dtype: torch.dtype  # RoPE tables and attention's arithmetic (float32 on CPU)
    chunk: int  # keys per reduction chunk of a chunked attention (``TorchOps``)


@dataclass
class CallRows:
    """One call's place in a forward over several: its cache, its rows and what they see."""

    state: KVState
    row: int  # its first row in the forward
    n: int  # its rows
    start: int  # its committed length: the cache position of its first row
    tree: TreeBuffers | None  # None: a causal chain
    positions: torch.Tensor  # [n] each row's position

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.n)


def shared_prefixes(calls: Sequence[CallRows]) -> list[tuple[int, int]]:
    """Per call of one pooled buffer: (the slot to read its shared prefix from, that prefix's
    length; ``(slot, 0)``: none). A call shares the longest prefix it has committed under the same
    name (``SequenceState.prefix_names``) as another call of the forward that has committed it
    too, and reads it from the lowest slot that holds it, so every call with that prefix reads one
    copy. Example: calls in slots 3, 5 and 6 whose prompts start with the same 512-token system
    prompt (16 blocks of 32) and differ after it, all past it → [(3, 0), (3, 512), (3, 512)]."""
    owners: dict[tuple[int, bytes], int] = {}  # (block, name) -> the lowest slot that has committed it
    usable: list[int] = []
    for call in calls:
        state = call.state
        block = state.prefix_block
        usable.append(min(len(state.prefix_names), call.start // block) if block else 0)
    for i in sorted(range(len(calls)), key=lambda i: calls[i].state.slot):
        state = calls[i].state
        for name in state.prefix_names[: usable[i]]:
            owners.setdefault((state.prefix_block, name), state.slot)
    out: list[tuple[int, int]] = []
    for i, call in enumerate(calls):
        state = call.state
        found = (state.slot, 0)
        for b in range(usable[i] - 1, -1, -1):
            owner = owners[(state.prefix_block, state.prefix_names[b])]
            if owner != state.slot:
                found = (owner, (b + 1) * state.prefix_block)
                break
        out.append(found)
    return out


def by_buffer(calls: Sequence[CallRows]) -> list[list[CallRows]]:
    """``calls`` grouped by the buffer their caches live in, in order of first appearance: the
    pool's (every pooled call, by slot) or a request's own (one call each). A backend whose kernels
    index one buffer per launch lays out a group at a time."""
    groups: dict[int, list[CallRows]] = {}  # buffer -> calls
    for call in calls:
        key = -1 if call.state.pool is not None else id(call.state)
        groups.setdefault(key, []).append(call)
    return list(groups.values())


class Ops(Protocol):
    """The operations of the forward (see the module docstring)."""

    name: str
    kv_dtype: torch.dtype
    """The dtype its KV cache holds."""

    def layout(self, calls: Sequence[CallRows], total: int, pad: int) -> Any:
        """What ``rope_store`` and ``attention`` need of the calls (caches reserved already):
        ``total`` rows, then ``pad`` zero rows the GEMMs need (nothing reads their results)."""
        ...

    def scope(self, own_threads: bool) -> AbstractContextManager[None]:
        """Held around a forward (``own_threads``: every GEMM runs on the fused kernels' pool)."""
        ...

    def choose_kernels(self, weights: Weights, requested: str) -> KernelChoice:
        """The kernel of each GEMM role (``kernels.ROLES``) for ``weights`` (role -> its weight and
        bias in every layer, as the forward multiplies them), and what was measured to choose them
        (None: nothing). ``requested``: "auto" (this implementation's own choice) or a kernel's
        name for every role (``--kernel``); a ValueError where that one cannot run here."""
        ...

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> Linear:
        """A GEMM layer over ``weight`` [out, in] run by ``kernel``."""
        ...

    def norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta) * weight); without delta (h, rms_norm(h) * weight)."""
        ...

    def rope_store(
        self, layout: Any, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Rotate the queries and keys of qkv [rows, (heads + 2 kv) d] with each row's cos and
        sign-folded sin [total, d]; the keys and values into ``layer``'s cache; the rotated
        queries [total, heads, d]."""
        ...

    def attention(self, layout: Any, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Softmax attention of q [total, heads, d] over each row's visible keys of ``layer``:
        [total + pad, heads · d] in the weights' dtype (pad rows zero)."""
        ...

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) · up of gate_up [rows, 2 I]: [rows, I]."""
        ...

    def logits(self, head: Linear, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed rows h: float32 logits."""
        ...

    def branching_rows_limit(self, length: int) -> int | None:
        """Rows a tree after ``length`` committed positions may have (None: any)."""
        ...

    def variant(self) -> str:
        """What distinguishes its numbers (cost curves are keyed by it)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Its part of the target's ``kernel_info``."""
        ...


OpsFactory = Callable[[OpsContext], Ops | None]
"""Makes an implementation for a context, or None where it cannot run there."""

OPS: dict[str, OpsFactory] = {}
"""Implementations by name (``register``); ``fast_llama`` picks one per target."""


def register(name: str) -> Callable[[OpsFactory], OpsFactory]:
    def add(factory: OpsFactory) -> OpsFactory:
        OPS[name] = factory
        return factory

    return add
