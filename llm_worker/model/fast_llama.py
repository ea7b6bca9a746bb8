"""A lean forward for Llama-family checkpoints over a preallocated KV cache.

Same weights and the same arithmetic as transformers' forward (tests compare the two), with
what speculative decoding needs built in:

- the KV cache is preallocated: a commit moves at most the accepted rows, never re-concatenates
  the whole cache; requests' caches sit side by side in one pool (``kv_pool.KVPool``), so that
  a forward over many requests (``forward_many``) runs their decode steps' attention together
  rather than a small one per request;
- any tree attention mask, position ids from tree depths;
- the hidden state of any layer and the post-RoPE query of any head, at no extra cost;
- **batch invariance**: a token's logits (and its hidden states and K/V) are bit-identical
  whether it is computed alone, inside a draft tree or chain of any size, at any position of the
  forward, or in a prefill chunk — so every speculative mode reproduces ``ar`` exactly, in every
  dtype, with no near-tie excuse. Each operation is row-invariant: RMSNorm, RoPE (a table of every
  position's cos/sin, computed once), SiLU·up and residuals work row by row; GEMMs run one kernel
  for every row count (``kernels``: chosen among those that are invariant on this machine,
  padding forwards with fewer rows than the kernel's minimum); attention reduces each query's
  keys in one order whatever the other queries (``ops_cpu``: each row's visible keys in cache
  order; ``ops_torch``: a fixed grid of ``attention_chunk`` keys from position 0; ``ops_triton``
  on CUDA: each row's visible keys as one list, in fixed chunks). On CUDA only the Triton
  operations are invariant: torch's (cuBLAS, ``--ops torch``) are not.

q/k/v and gate/up projections are fused into one matrix each (the module weights become
views of the fused matrices, so no memory is duplicated). A batch of drafts runs as the
equivalent tree (``TargetModel.forward_batch``): a separate batched attention would reduce each
row's own keys in another order than a decode of the same token.

The layer loop, the KV caches and the outputs are ``forward.Forward``'s, written once against
the operations interface ``ops.Ops``; this module loads a model into it and picks the
implementation: on CUDA the row-invariant Triton kernels (``ops_triton``), on CPU the fused CPU
kernels (``ops_cpu``) where they run, else torch operations (``ops_torch``), or any registered in
``ops.OPS``.

Covers model types whose forward is the Llama one: llama, mistral (no sliding window inside
the context), qwen2 (q/k/v biases).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from llm_worker.model import ops_cpu, ops_torch
from llm_worker.model import ops_triton as ops_triton  # registers "triton" (imports no triton)
from llm_worker.model.forward import Forward, Layer, fuse, fuse_bias
from llm_worker.model.graphs import StepGraphs
from llm_worker.model.kernels import ROLES, Kernel, Linear
from llm_worker.model.kv_pool import GROW, KVPool
from llm_worker.model.ops import OPS, Ops, OpsContext, OpsFactory
from llm_worker.model.target import TargetInfo
from llm_worker.verify.tree import TreeBuffers
from specdraft.common import Progress

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_CHUNK = 256  # keys per reduction chunk of the torch attention (divides kv_pool.GROW)
POOL_SLOTS = 16  # requests whose caches share the pool (more get caches of their own)
PACK_WEIGHTS_PER_SECOND = 15e6
"""Weights packed into exact 4-/8-bit blocks a second (``quant.pack_exact``, at every load) on a
busy 2-core EPYC: the estimate of the progress line of a load that packs for 5 s or more."""


def unsupported_reason(model: Any) -> str | None:
    """Why the fast path cannot run ``model`` (None if it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model type {cfg.model_type!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases are not supported"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return "sliding-window attention is not supported"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 is not supported"
    return None


def _pick_ops(ops: str | OpsFactory | None, fused: bool, ctx: OpsContext) -> Ops:
    """``ops`` by name or factory; None: on CUDA the row-invariant Triton kernels (``ops_triton``)
    where triton is installed, on CPU the fused kernels where ``fused`` and they run here; else
    torch operations."""
    if ops is None:
        if ctx.device.type == "cuda":
            chosen = OPS["triton"](ctx)
            if chosen is None:
                log.warning(
                    "the Triton operations cannot run here (triton not installed, or the model's "
                    "dtype): the CUDA forward runs torch operations (cuBLAS), which are not "
                    "batch-invariant: speculative modes may differ from ar in a near-tie"
                )
        else:
            chosen = OPS["cpu-fused"](ctx) if fused else None
        return chosen if chosen is not None else ops_torch.TorchOps(ctx)
    factory = OPS[ops] if isinstance(ops, str) else ops
    made = factory(ctx)
    if made is None:
        raise ValueError(f"fast backend: operations {ops!r} cannot run on {ctx.device} in {ctx.dtype}")
    return made


class FastLlamaTarget(Forward):
    """The fast forward; batch-invariant (see the module docstring) given invariant GEMM kernels."""

    def __init__(
        self,
        model: Any,
        info: TargetInfo,
        gemm_kernels: Mapping[str, Kernel] | str | None = None,
        attention_chunk: int = ATTENTION_CHUNK,
        pool_slots: int = POOL_SLOTS,
        fused: bool = True,
        ops: str | OpsFactory | None = None,
        graphs: bool = False,
    ) -> None:
        """``gemm_kernels``: a kernel per role (``kernels.ROLES``), or what to ask the operations
        for (``Ops.choose_kernels``: "auto", their own choice, or a kernel's name for every role);
        None: torch's own BLAS call for every role.
        ``pool_slots``: requests whose caches share one buffer (``KVPool``); 0: each its own.
        ``fused``: the work between the GEMMs in ``native``'s fused CPU kernels where they can
        run here; False (or where they cannot): torch operations. ``ops``: the operations by name
        in ``ops.OPS`` or a factory instead (then ``fused`` is not consulted). ``graphs``: decode
        and verify steps replayed from captured CUDA graphs (``graphs.StepGraphs``; the Triton
        operations only; without CUDA the same code runs eagerly, for the tests)."""
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast backend: {reason}")
        if attention_chunk < 1 or GROW % attention_chunk:
            raise ValueError(f"attention_chunk must divide {GROW}, got {attention_chunk}")
        if pool_slots < 0:
            raise ValueError(f"kv_pool_slots must be >= 0, got {pool_slots}")
        self.model = model
        self.info = info
        self.device = torch.device(info.device)
        cfg = model.config
        self.eps = float(cfg.rms_norm_eps)
        self.dtype = model.get_input_embeddings().weight.dtype
        # RoPE and attention compute in float32 on CPU whatever the weights' dtype (the fused
        # kernels' cache may hold bfloat16: ``kv_dtype``): CPU bfloat16 matmuls of attention's
        # small shapes are ~3x slower than float32 ones here, and float32 keeps the softmax exact
        # to more bits (flash attention accumulates in float32 too).
        self.attn_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.chunk = attention_chunk
        self.ops = _pick_ops(
            ops, fused, OpsContext(info, self.device, self.dtype, self.attn_dtype, attention_chunk)
        )
        self.kv_dtype = self.ops.kv_dtype
        """The KV cache's dtype: the weights' with the fused kernels, the attention's (float32 on
        CPU) on the torch path (``Ops.kv_dtype``)."""
        self._lock = threading.RLock()
        self._pool = KVPool(self._buffers, pool_slots)
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm.weight.detach()
        # cos/sin of every position, computed once by the model's own rotary embedding: a
        # position's values never depend on which other positions share its forward.
        positions = torch.arange(info.max_context, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.attn_dtype, device=self.device)
        cos, sin = inner.rotary_emb(probe, positions)
        half = info.head_dim // 2
        self.cos = cos[0]  # [max_context, head_dim]
        self.sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # [max_context, head_dim]
        self._load_layers(model, gemm_kernels)
        if graphs:
            self.graphs = StepGraphs(self, capture=self.device.type == "cuda")

    def _load_layers(self, model: Any, gemm_kernels: Mapping[str, Kernel] | str | None) -> None:
        """The layers' weights fused for the GEMMs the forward runs (q/k/v and gate/up: the
        modules' weights become views of the fused matrices, no memory duplicated), each on its
        role's kernel (a request: the kernels the operations choose for these weights)."""
        inner, head = model.model, model.lm_head
        weights: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {role: [] for role in ROLES}
        report = None
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            weights["qkv"].append((fuse(qkv), fuse_bias(qkv)))
            o_bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
            weights["o"].append((attn.o_proj.weight.detach(), o_bias))
            weights["gate_up"].append((fuse([mlp.gate_proj, mlp.up_proj]), None))
            weights["down"].append((mlp.down_proj.weight.detach(), None))
        weights["lm_head"].append((head.weight.detach(), head.bias))
        if isinstance(gemm_kernels, str):
            gemm_kernels, report = self.ops.choose_kernels(weights, gemm_kernels)
        self.kernels = dict(gemm_kernels or dict.fromkeys(ROLES, Kernel("aten", 1)))  # role -> kernel
        self.min_rows = min(k.min_rows for k in self.kernels.values())  # the forward pads to this
        self.kernel_report = report
        self.own_threads = all(k.library in ("quant", "bf16") for k in self.kernels.values())
        """Whether the fused kernels share rows on their own pool (every GEMM is a packed one of
        theirs) or on torch's OpenMP threads (GEMMs on oneDNN/MKL, whose OpenMP workers would spin
        against the pool's)."""
        linear = self.ops.linear
        packed = sum(
            w.numel() for role, ws in weights.items() for w, _ in ws if self.kernels[role].library == "quant"
        )
        estimate = packed / PACK_WEIGHTS_PER_SECOND
        progress = (
            Progress("packing the weights into 4-/8-bit blocks", estimate, note="") if estimate >= 5 else None
        )
        try:
            self.lm_head = linear(*weights["lm_head"][0], self.kernels["lm_head"])
            self.layers = []
            for i, layer in enumerate(inner.layers):
                self.layers.append(
                    Layer(
                        ln_attn=layer.input_layernorm.weight.detach(),
                        qkv=linear(*weights["qkv"][i], self.kernels["qkv"]),
                        o=linear(*weights["o"][i], self.kernels["o"]),
                        ln_mlp=layer.post_attention_layernorm.weight.detach(),
                        gate_up=linear(*weights["gate_up"][i], self.kernels["gate_up"]),
                        down=linear(*weights["down"][i], self.kernels["down"]),
                    )
                )
                if progress is not None:
                    progress.update((i + 1) / len(inner.layers))
            if progress is not None:
                progress.done()
        except RuntimeError as exc:  # a forced kernel this processor cannot run (--kernel)
            chosen = ", ".join(f"{role} {k.name}" for role, k in self.kernels.items())
            raise ValueError(f"GEMM kernels ({chosen}) cannot run on this machine: {exc}") from None

    @property
    def fused(self) -> Any:
        """The fused CPU kernels' module (``native``) when the forward runs on them, else None."""
        return self.ops.kernels if isinstance(self.ops, ops_cpu.FusedCpuOps) else None

    @property
    def grouped_attention(self) -> bool:
        """Whether pooled requests' attention runs grouped (``TorchOps._grouped``)."""
        return bool(self.ops.describe()["grouped_attention"])

    @property
    def attention_rows(self) -> int:
        """Query rows attention's batched GEMMs are padded to (1: none)."""
        return int(self.ops.describe()["attention_min_rows"])

    @property
    def supports_queries(self) -> bool:
        return True

    @property
    def kernel_variant(self) -> str:
        names = ",".join(k.name.replace(":", "") for k in self.kernels.values())
        return f"-{names}{self.ops.variant()}"

    def weight_bytes(self, read: bool = False) -> int:
        """Every layer's weights, the final norm and the LM head, at the dtype's width; ``read``:
        as one forward reads them (packed blocks where a GEMM reads those, ``kernels.Linear``)."""

        def size(lin: Linear) -> int:
            return lin.nbytes() if read else lin.weight.numel() * lin.weight.element_size()

        total = size(self.lm_head) + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            for t in (layer.ln_attn, layer.ln_mlp):
                total += t.numel() * t.element_size()
            total += sum(size(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total

    def kernel_info(self) -> dict[str, Any]:
        described = self.ops.describe()
        info: dict[str, Any] = {
            "gemm_kernels": {role: k.name for role, k in self.kernels.items()},
            "weight_bytes_read": self.weight_bytes(read=True),
            "fused_kernels": described["fused_kernels"],
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "attention_chunk": described["attention_chunk"],
            "attention_min_rows": described["attention_min_rows"],
            "grouped_attention": described["grouped_attention"],
        }
        if self.kernel_report is not None:
            info["gemm_kernel_candidates"] = self.kernel_report.to_json()
        return info

    def kv_cache_usage(self) -> tuple[int, int] | None:
        """The pool's slots in use and its most slots (a request the full pool cannot take keeps
        buffers of its own and is not counted); None without a pool (``pool_slots`` 0)."""
        used, total = self._pool.usage()
        return (used, total) if total else None

    # -- the torch operations' own steps (tests call them on the target) ----------------------

    def _torch_ops(self) -> ops_torch.TorchOps:
        assert isinstance(self.ops, ops_torch.TorchOps), "the torch-operation path (fused=False)"
        return self.ops

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._torch_ops().norm(x, None, weight, self.eps)[1]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        return ops_torch.TorchOps._rotate(x, cos, sin_signed)

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return self._torch_ops()._attention(q, keys, values, bias)

    def _bias(self, start: int, n: int, tree: TreeBuffers | None) -> torch.Tensor:
        return self._torch_ops()._bias(start, n, tree)
