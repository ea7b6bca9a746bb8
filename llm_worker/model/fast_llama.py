"""A lean forward for Llama-family checkpoints over a preallocated KV cache.

Same weights and the same arithmetic as transformers' forward (tests compare the two), with
what speculative decoding needs built in:

- the KV cache is preallocated: a commit moves at most the accepted rows, never re-concatenates
  the whole cache; requests' caches sit side by side in one pool (``_KVPool``), so that a
  forward over many requests (``forward_many``) runs their decode steps' attention as one
  batched GEMM chain (``_grouped``) rather than a small one per request;
- any tree attention mask, position ids from tree depths;
- the hidden state of any layer and the post-RoPE query of any head, at no extra cost;
- **batch invariance**: a token's logits (and its hidden states and K/V) are bit-identical
  whether it is computed alone, inside a draft tree or chain of any size, at any position of the
  forward, or in a prefill chunk — so every speculative mode reproduces ``ar`` exactly, in every
  dtype, with no near-tie excuse. Each operation is row-invariant: RMSNorm, RoPE (a table of every
  position's cos/sin, computed once), SiLU·up and residuals work row by row; GEMMs run one kernel
  for every row count (``kernels``: chosen among those that are invariant on this machine,
  padding forwards with fewer rows than the kernel's minimum); attention sums over keys in a
  fixed grid of ``attention_chunk`` keys from position 0 (``_attention``), so more queries never
  change how one query's keys are reduced.

q/k/v and gate/up projections are fused into one matrix each (the module weights become
views of the fused matrices, so no memory is duplicated). A batch of drafts runs as the
equivalent tree (``TargetModel.forward_batch``): a separate batched attention would reduce each
row's own keys in another order than a decode of the same token.

Covers model types whose forward is the Llama one: llama, mistral (no sliding window inside
the context), qwen2 (q/k/v biases).
"""

from __future__ import annotations

import heapq
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llm_worker.model import native
from llm_worker.model.kernels import ROLES, Kernel, KernelChooser, Linear, attention_min_rows, pad_rows_bmm
from llm_worker.model.target import (
    ForwardCall,
    ForwardOutput,
    KVBuffers,
    SequenceState,
    TargetInfo,
    TargetModel,
)
from llm_worker.types import ArtifactNeeds, causal_mask
from llm_worker.verify.tree import TreeBuffers

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
_GROW = 512  # KV capacity grows in steps of this many positions
ATTENTION_CHUNK = 256  # keys per reduction chunk of the attention (divides _GROW)
_PREFILL_ROWS = 1024  # the largest forward whose attention invariance is checked (prefill chunks: 256)
POOL_SLOTS = 16  # requests whose caches share the pool (more get caches of their own)
GROUPED_MAX_ROWS = 32  # calls of up to this many rows run their attention grouped (decode steps, trees)


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


@dataclass
class _Layer:
    ln_attn: torch.Tensor  # [hidden]
    qkv: Linear  # [hidden] → [(heads + 2 * kv_heads) * head_dim]
    o: Linear  # [heads * head_dim] → [hidden]
    ln_mlp: torch.Tensor  # [hidden]
    gate_up: Linear  # [hidden] → [2 * intermediate]
    down: Linear  # [intermediate] → [hidden]


@dataclass
class _Part:
    """One call's place in a forward over several: its rows and where they go."""

    state: _KVState
    row: int  # its first row in the forward
    n: int  # its rows
    start: int  # its committed length: the cache slot of its first row
    positions: torch.Tensor  # [n] each row's position
    mask: torch.Tensor  # [n, T] its attention mask (``_bias``)
    bias: torch.Tensor | None = None  # [group · n, T] the mask repeated per query head of a group

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.n)

    @property
    def pooled(self) -> bool:
        return self.state.pool is not None and self.n <= GROUPED_MAX_ROWS


@dataclass
class _Group:
    """Pooled calls whose attention runs as one batched GEMM chain over the pool's slots lo..hi
    (``FastLlamaTarget._grouped``); slots in between that are not members compute zero queries
    whose results are dropped."""

    lo: int
    hi: int
    n_max: int  # query tokens per slot: every member's rows, padded with zero queries
    rows: torch.Tensor  # [m] the members' rows in the forward
    slots: torch.Tensor  # [m] each row's slot
    cache: torch.Tensor  # [m] each row's cache position (its call's start + its row)
    dest: torch.Tensor  # [m] each row's place among the group's queries: (slot − lo) · n_max + row
    bias: torch.Tensor  # [slots, rows, T] masks, query rows laid out as ``_grouped``'s (``_query_rows``)


BufferMaker = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""(slots, capacity) → zeroed keys [layers, slots, kv, capacity, d] and values [..., d + 1]."""


class _KVPool:
    """The KV caches of up to ``max_slots`` requests side by side in one buffer (keys
    [layers, slots, kv, capacity, d], values [..., d + 1]), so that attention can run every
    pooled request's decode rows as one batched GEMM over a slice of slots (``_grouped``) instead
    of one small GEMM chain per request. Slots and capacity grow by reallocation (every slot
    shares the capacity of the longest request); a slot is freed when its state is collected.
    Callers hold the target's lock: growth must not race a forward's or a commit's writes."""

    def __init__(self, make: BufferMaker, max_slots: int) -> None:
        self.make = make
        self.max_slots = max_slots
        self.keys, self.values = make(0, _GROW)
        self._free: list[int] = []  # slots below ``slots`` nobody holds, as a heap
        self._released: list[int] = []  # appended by finalizers (any thread), drained under the lock

    @property
    def slots(self) -> int:
        return int(self.keys.shape[1])

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def acquire(self) -> int | None:
        """The lowest free slot (so the slots in use stay packed), or None when the pool is full."""
        while self._released:
            heapq.heappush(self._free, self._released.pop())
        if not self._free:
            if self.slots >= self.max_slots:
                return None
            self._resize(min(self.max_slots, max(1, 2 * self.slots)), self.capacity)
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        self._released.append(slot)  # list.append is atomic: safe from a finalizer in any thread

    def reserve(self, capacity: int) -> None:
        if capacity > self.capacity:
            self._resize(self.slots, capacity)

    def _resize(self, slots: int, capacity: int) -> None:
        keys, values = self.make(slots, capacity)
        old_slots, old_capacity = self.slots, self.capacity
        keys[:, :old_slots, :, :old_capacity] = self.keys
        values[:, :old_slots, :, :old_capacity] = self.values
        self.keys, self.values = keys, values
        for slot in range(old_slots, slots):
            heapq.heappush(self._free, slot)


class _KVState(SequenceState):
    """One request's cache: a slot of the pool, or its own buffers when the pool is full."""

    def __init__(
        self,
        pool: _KVPool | None,
        slot: int,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> None:
        self.length = 0
        self.pool = pool
        self.slot = slot
        self._keys = keys
        self._values = values
        if pool is not None:
            weakref.finalize(self, pool.release, slot)

    @property
    def keys(self) -> torch.Tensor:
        """[layers, 1, kv_heads, capacity, head_dim]"""
        if self.pool is not None:
            return self.pool.keys[:, self.slot : self.slot + 1]
        assert self._keys is not None
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        """[layers, 1, kv_heads, capacity, head_dim + 1]: the last column is 1"""
        if self.pool is not None:
            return self.pool.values[:, self.slot : self.slot + 1]
        assert self._values is not None
        return self._values

    def set_buffers(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        assert self.pool is None
        self._keys, self._values = keys, values


def _fuse(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate Linear weights along the output dim; the modules then view the fused matrix."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


def _fuse_bias(linears: Sequence[torch.nn.Linear]) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    parts = [
        lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
        for lin in linears
    ]
    return torch.cat(parts).contiguous()


class FastLlamaTarget(TargetModel):
    """The fast forward; batch-invariant (see the module docstring) given invariant GEMM kernels."""

    def __init__(
        self,
        model: Any,
        info: TargetInfo,
        gemm_kernels: Mapping[str, Kernel] | KernelChooser | None = None,
        attention_chunk: int = ATTENTION_CHUNK,
        pool_slots: int = POOL_SLOTS,
        fused: bool = True,
    ) -> None:
        """``gemm_kernels``: a kernel per role (``kernels.ROLES``), or a chooser handed the fused
        weights (``kernels.measured_chooser``); None: torch's own BLAS call for every role.
        ``pool_slots``: requests whose caches share one buffer (``_KVPool``); 0: each its own.
        ``fused``: the work between the GEMMs in ``native``'s fused CPU kernels where they can
        run here; False (or where they cannot): torch operations."""
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast backend: {reason}")
        if attention_chunk < 1 or _GROW % attention_chunk:
            raise ValueError(f"attention_chunk must divide {_GROW}, got {attention_chunk}")
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
        self.fused = (
            native.load()
            if fused
            and self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and info.head_dim % 8 == 0
            and info.head_dim <= 256
            else None
        )
        """The fused kernels (``native``), or None: the forward's torch-operation path."""
        self.kv_dtype = self.dtype if self.fused is not None else self.attn_dtype
        """The KV cache's dtype: the weights' with the fused kernels (bfloat16 keys and values are
        widened exactly as attention reads them: half the bytes a decode step reads from the cache
        for the same float32 arithmetic; keys rounded once, after RoPE, as a bfloat16 model's
        own cache holds them), the attention's (float32 on CPU) on the torch path."""
        group = info.num_heads // info.num_kv_heads
        self.attention_rows = (
            1
            if self.fused
            else attention_min_rows(
                info.num_kv_heads,
                group,
                info.head_dim,
                attention_chunk,
                _PREFILL_ROWS,
                self.device,
                self.attn_dtype,
            )
        )  # query rows attention's batched GEMMs are padded to (measured here: invariant from it)
        # Forwards, commits and new states take the lock: the pool may move when it grows.
        self._lock = threading.RLock()
        self._pool = _KVPool(self._buffers, pool_slots)
        self.grouped_attention = False if self.fused else self._grouped_exact()
        """Whether pooled requests' attention runs grouped (``_grouped``): checked bitwise against
        ``_attention`` on this machine (batched GEMMs whose rows do not depend on the batch)."""
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
        head = model.lm_head
        weights: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {role: [] for role in ROLES}
        report = None
        for layer in inner.layers:  # q/k/v and gate/up fused: the GEMMs the forward runs
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            weights["qkv"].append((_fuse(qkv), _fuse_bias(qkv)))
            o_bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
            weights["o"].append((attn.o_proj.weight.detach(), o_bias))
            weights["gate_up"].append((_fuse([mlp.gate_proj, mlp.up_proj]), None))
            weights["down"].append((mlp.down_proj.weight.detach(), None))
        weights["lm_head"].append((head.weight.detach(), head.bias))
        if callable(gemm_kernels):
            gemm_kernels, report = gemm_kernels(weights)
        self.kernels = dict(gemm_kernels or dict.fromkeys(ROLES, Kernel("aten", 1)))  # role -> kernel
        self.min_rows = min(k.min_rows for k in self.kernels.values())  # the forward pads to this
        self.kernel_report = report
        self.own_threads = all(k.library in ("quant", "bf16") for k in self.kernels.values())
        """Whether the fused kernels share rows on their own pool (every GEMM is a packed one of
        theirs) or on torch's OpenMP threads (GEMMs on oneDNN/MKL, whose OpenMP workers would spin
        against the pool's)."""
        try:
            self.lm_head = Linear(*weights["lm_head"][0], self.kernels["lm_head"])
            self.layers = [
                _Layer(
                    ln_attn=layer.input_layernorm.weight.detach(),
                    qkv=Linear(*weights["qkv"][i], self.kernels["qkv"]),
                    o=Linear(*weights["o"][i], self.kernels["o"]),
                    ln_mlp=layer.post_attention_layernorm.weight.detach(),
                    gate_up=Linear(*weights["gate_up"][i], self.kernels["gate_up"]),
                    down=Linear(*weights["down"][i], self.kernels["down"]),
                )
                for i, layer in enumerate(inner.layers)
            ]
        except RuntimeError as exc:  # a forced kernel this processor cannot run (--kernel)
            chosen = ", ".join(f"{role} {k.name}" for role, k in self.kernels.items())
            raise ValueError(f"GEMM kernels ({chosen}) cannot run on this machine: {exc}") from None

    @property
    def supports_queries(self) -> bool:
        return True

    @property
    def kernel_variant(self) -> str:
        names = ",".join(k.name.replace(":", "") for k in self.kernels.values())
        if self.fused:  # the build's digest: changed kernels are measured again
            return f"-{names}-{native.build_name().removeprefix('specdraft_fused_')[:8]}"
        return f"-{names}-c{self.chunk}-a{self.attention_rows}"

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
        info: dict[str, Any] = {
            "gemm_kernels": {role: k.name for role, k in self.kernels.items()},
            "weight_bytes_read": self.weight_bytes(read=True),
            "fused_kernels": self.fused is not None,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "attention_chunk": None if self.fused else self.chunk,
            "attention_min_rows": self.attention_rows,
            "grouped_attention": self.grouped_attention,
        }
        if self.kernel_report is not None:
            info["gemm_kernel_candidates"] = self.kernel_report.to_json()
        return info

    # -- KV state ---------------------------------------------------------------------------

    def start(self) -> SequenceState:
        with self._lock:
            slot = self._pool.acquire()
            if slot is not None:
                return _KVState(self._pool, slot)
            keys, values = self._buffers(1, _GROW)
            return _KVState(None, -1, keys, values)

    def _buffers(self, slots: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [layers, slots, kv, capacity, d]; values [layers, slots, kv, capacity, d + 1] whose
        last column is 1 (the attention's softmax denominator, see ``_attention``)."""
        i = self.info
        shape = (i.num_layers, slots, i.num_kv_heads, capacity, i.head_dim)
        values = torch.zeros((*shape[:-1], i.head_dim + 1), dtype=self.kv_dtype, device=self.device)
        values[..., -1] = 1
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device), values

    def _reserve(self, state: _KVState, needed: int) -> None:
        """Capacity for ``needed`` positions, rounded up to the attention's key chunks (a multiple
        of ``_GROW``, which the chunk divides)."""
        capacity = state.keys.shape[3]
        if needed <= capacity:
            return
        wanted = max(needed, min(capacity * 2, self.info.max_context + _GROW))
        new_capacity = -(-wanted // _GROW) * _GROW
        if state.pool is not None:
            state.pool.reserve(new_capacity)
            return
        keys, values = self._buffers(1, new_capacity)
        keys[:, :, :, : state.length] = state.keys[:, :, :, : state.length]
        values[:, :, :, : state.length] = state.values[:, :, :, : state.length]
        state.set_buffers(keys, values)

    def branching_rows_limit(self, state: SequenceState) -> int | None:
        """Rows up to the next key-chunk boundary. A tree node's key sits at slot start + row of
        the cache, where decoding it alone puts it at start + depth; inside one chunk that only
        moves it past zeros of its siblings (no-ops of the chunk's sequential reduction), but a
        node whose key crossed into the next chunk would be summed in another chunk than alone.
        The fused attention has no grid (a query sums its visible keys in order): no limit."""
        if self.fused:
            return None
        return self.chunk - state.length % self.chunk

    def kv(self, state: SequenceState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(state, _KVState)
        d = self.info.head_dim
        return state.keys[layer, 0, :, : state.length], state.values[layer, 0, :, : state.length, :d]

    def kv_buffers(self, state: SequenceState, layer: int) -> KVBuffers | None:
        assert isinstance(state, _KVState)
        if state.pool is not None:
            return KVBuffers(state.pool.keys[layer], state.pool.values[layer], state.slot)
        return KVBuffers(state.keys[layer], state.values[layer], 0)

    def commit(self, state: SequenceState, rows: Sequence[int]) -> None:
        assert isinstance(state, _KVState)
        rows = list(rows)
        start = state.length
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.device) + start
            dest = slice(start, start + len(rows))
            with self._lock:  # the pool must not move while the rows are copied
                keys, values = state.keys, state.values
                keys[:, :, :, dest] = keys.index_select(3, index)
                values[:, :, :, dest] = values.index_select(3, index)
        state.length = start + len(rows)

    # -- forward ----------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each row, [n, hidden] (one fused kernel, float32 inside)."""
        return F.rms_norm(x, weight.shape, weight, self.eps)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """RoPE of x [n, heads, d] with cos and sign-folded sin [n, 1, d] (``cos``, ``sin_signed``):
        x·cos + (x2, x1)·(−sin1, sin2) = transformers' x·cos + (−x2, x1)·sin, the negation moved
        into the table (exact)."""
        n, heads, d = x.shape
        swapped = x.view(n, heads, 2, d // 2).flip(2).view(n, heads, d)  # (x2, x1)
        return x * cos + swapped * sin_signed

    def _attention(
        self,
        q: torch.Tensor,  # [n, heads, d] post-RoPE queries
        keys: torch.Tensor,  # [kv, capacity, d] this layer's cache, the new rows written
        values: torch.Tensor,  # [kv, capacity, d + 1] values, then a column of ones
        bias: torch.Tensor,  # [group · n, T] 0 where the query row may see the key, −inf elsewhere
    ) -> torch.Tensor:
        """Attention over the first T = chunks · C cached keys, row by row invariant: [n, heads · d].

        Scores are one GEMM over the head dimension, then scaled and the mask added;
        exp(score − row max) is elementwise (the max is exact in any order); then one GEMM per key
        chunk of C keys multiplies the weights by the values *and* by the ones column, so the
        numerator and the softmax denominator come out of the same sequential reduction over the
        chunk's keys, in which a blocked key (weight exactly 0) is a no-op wherever it sits. The
        chunks accumulate in order and the numerator is divided by the denominator. A query's
        result depends only on its own visible keys and the chunk each falls in: more rows in the
        forward add blocked keys and all-zero chunks only. Query head h reads KV head h // group
        (transformers' ``repeat_kv``).
        """
        n, heads, d = q.shape
        kv = keys.shape[0]
        group, t = heads // kv, bias.shape[1]
        c = self.chunk
        qg = q.view(n, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * n, d)  # [kv, group·n, d]
        pad = self.attention_rows
        scores = (
            pad_rows_bmm(qg, keys[:, :t].transpose(1, 2), pad).mul_(1.0 / math.sqrt(d)).add_(bias)
        )  # [kv, g·n, T]
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # [kv, group·n, T]
        total = pad_rows_bmm(weights[:, :, :c], values[:, :c], pad)  # [kv, group·n, d + 1]
        for start in range(c, t, c):  # (a plain bmm and an add: baddbmm was 2x slower at these shapes)
            total += pad_rows_bmm(weights[:, :, start : start + c], values[:, start : start + c], pad)
        out = total[..., :d] / total[..., d:]
        return out.view(kv, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)

    def _grouped(
        self,
        q: torch.Tensor,  # [m, heads, d] post-RoPE queries of every member's rows
        keys: torch.Tensor,  # [slots, kv, capacity, d] the pool's slots lo..hi, new rows written
        values: torch.Tensor,  # [slots, kv, capacity, d + 1]
        bias: torch.Tensor,  # [slots, group · n_max, T] (``_Group.bias``)
        dest: torch.Tensor,  # [m] each row's place among the slots' queries (``_Group.dest``)
        n_max: int,
    ) -> torch.Tensor:
        """``_attention`` of several requests at once: [m, heads · d], each row bit-identical to
        its request's own ``_attention``. The queries of slot s are laid out [kv, n_max · group, d]
        (a zero query where a slot has fewer rows; zero rows up to ``attention_rows``), the slots
        stacked along the batch dimension of
        the same two batched GEMMs (scores over T keys, then weights · values chunk by chunk), so
        a request's rows see its own keys and mask in the same reduction grid as alone: a row's
        GEMM results do not depend on the batch or the row count (``_grouped_exact`` checks it on
        this machine), a key beyond the request's own T is blocked (its weight exactly 0) and so
        are all-zero trailing chunks (x + 0 = x)."""
        _, heads, d = q.shape
        slots, kv = keys.shape[0], keys.shape[1]
        group, t, c = heads // kv, bias.shape[2], self.chunk
        used, rows = n_max * group, bias.shape[1]  # query rows, and padded to the GEMMs' minimum
        queries = q.new_zeros(slots * n_max, heads, d).index_copy_(0, dest, q)
        qg = queries.view(slots, n_max, kv, group, d).permute(0, 2, 1, 3, 4).reshape(slots * kv, used, d)
        if rows > used:
            qg = F.pad(qg, (0, 0, 0, rows - used))
        k = keys[:, :, :t].reshape(slots * kv, t, d)
        v = values[:, :, :t].reshape(slots * kv, t, d + 1)
        scores = torch.bmm(qg, k.transpose(1, 2)).mul_(1.0 / math.sqrt(d))  # [slots · kv, rows, T]
        scores.view(slots, kv, rows, t).add_(bias[:, None])
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        total = torch.bmm(weights[:, :, :c], v[:, :c])  # [slots · kv, rows, d + 1]
        for start in range(c, t, c):
            total += torch.bmm(weights[:, :, start : start + c], v[:, start : start + c])
        out = total[:, :used, :d] / total[:, :used, d:]
        out = out.view(slots, kv, n_max, group, d).permute(0, 2, 1, 3, 4).reshape(slots * n_max, heads * d)
        return out.index_select(0, dest)

    def _grouped_exact(self) -> bool:
        """Whether ``_grouped`` gives every row bitwise what ``_attention`` gives its request alone,
        on random caches of mixed lengths, row counts and group sizes, on this machine."""
        i = self.info
        gen = torch.Generator().manual_seed(0)
        c, kv, d, group = self.chunk, i.num_kv_heads, i.head_dim, i.num_heads // i.num_kv_heads
        capacity = 3 * c
        keys = torch.randn(4, kv, capacity, d, generator=gen).to(self.device, self.attn_dtype)
        values = torch.randn(4, kv, capacity, d + 1, generator=gen).to(self.device, self.attn_dtype)
        values[..., -1] = 1
        calls = [(c - 1, 1), (2 * c + 5, 3), (0, 1), (3 * c - 7, 2)]  # (start, rows) per slot
        for members in ([0], [1], [0, 1], [0, 1, 2, 3], [1, 3]):
            n_max = max(calls[s][1] for s in members)
            starts_ends = [(calls[s][0], calls[s][0] + calls[s][1]) for s in members]
            t = max(-(-end // c) * c for _, end in starts_ends)
            lo, hi = min(members), max(members) + 1
            bias = torch.zeros(hi - lo, n_max, t, dtype=self.attn_dtype, device=self.device)
            queries: list[torch.Tensor] = []
            dest: list[int] = []
            alone: list[torch.Tensor] = []
            for s, (start, end) in zip(members, starts_ends, strict=True):
                n = end - start
                mask = self._bias(start, n, None)
                bias[s - lo, :n, : mask.shape[1]] = mask
                bias[s - lo, :n, mask.shape[1] :] = float("-inf")
                q = torch.randn(n, i.num_heads, d, generator=gen).to(self.device, self.attn_dtype)
                queries.append(q)
                dest.extend((s - lo) * n_max + r for r in range(n))
                alone.append(self._attention(q, keys[s], values[s], mask.repeat(group, 1)))
            together = self._grouped(
                torch.cat(queries),
                keys[lo:hi],
                values[lo:hi],
                self._query_rows(bias),
                torch.tensor(dest, device=self.device),
                n_max,
            )
            if not torch.equal(together, torch.cat(alone)):
                return False
        return True

    def _bias(self, start: int, n: int, tree: TreeBuffers | None) -> torch.Tensor:
        """[n, T] additive mask: 0 where row i may look, −inf elsewhere.

        Row i sees the committed prefix and, among the new rows, its tree ancestors and itself
        (a chain: rows 0..i). T is the end of the new rows rounded up to whole key chunks."""
        end = start + n
        t = -(-end // self.chunk) * self.chunk
        allowed = torch.zeros(n, t, dtype=torch.bool, device=self.device)
        allowed[:, :start] = True
        if tree is not None:
            allowed[:, start:end] = tree.mask.to(self.device)
        else:
            allowed[:, start:end] = causal_mask(n).to(self.device)
        bias = torch.zeros(n, t, dtype=self.attn_dtype, device=self.device)
        return bias.masked_fill_(~allowed, float("-inf"))

    def forward(
        self,
        state: SequenceState,
        tokens: torch.Tensor,
        tree: TreeBuffers | None,
        needs: ArtifactNeeds,
        last_logits_only: bool = False,
    ) -> ForwardOutput:
        return self.forward_many([ForwardCall(state, tokens, tree, needs, last_logits_only)])[0]

    def _part(self, call: ForwardCall, row: int) -> _Part:
        """Check ``call`` against the context limit, make room in its cache, and lay it out."""
        assert isinstance(call.state, _KVState)
        n = int(call.tokens.shape[0])
        start = call.state.length
        tree = call.tree
        offsets = tree.position_offsets if tree is not None else torch.arange(n)
        last_position = start + int(offsets[-1] if tree is None else offsets.max())
        if last_position >= self.info.max_context:
            raise ValueError(
                f"context of {last_position + 1} tokens exceeds the model's limit of {self.info.max_context}"
            )
        self._reserve(call.state, start + n)
        part = _Part(call.state, row, n, start, offsets + start, self._bias(start, n, tree))
        if not (self.grouped_attention and part.pooled):
            group = self.info.num_heads // self.info.num_kv_heads
            part.bias = part.mask.repeat(group, 1)  # [group · n, T], rows as in _attention's qg
        return part

    def _group(self, parts: Sequence[_Part]) -> _Group | None:
        """Lay out the pooled calls' grouped attention (``_grouped``), or None if there are fewer
        than two."""
        members = [p for p in parts if p.bias is None]
        if len(members) < 2:  # one request: its own attention is the same, with fewer operations
            for p in members:
                p.bias = p.mask.repeat(self.info.num_heads // self.info.num_kv_heads, 1)
            return None
        lo = min(p.state.slot for p in members)
        hi = max(p.state.slot for p in members) + 1
        n_max = max(p.n for p in members)
        t = max(p.mask.shape[1] for p in members)
        bias = torch.zeros(hi - lo, n_max, t, dtype=self.attn_dtype, device=self.device)
        rows: list[int] = []
        slots: list[int] = []
        cache: list[int] = []
        dest: list[int] = []
        for p in members:
            slot = p.state.slot
            bias[slot - lo, : p.n, : p.mask.shape[1]] = p.mask
            bias[slot - lo, : p.n, p.mask.shape[1] :] = float("-inf")
            rows.extend(range(p.row, p.row + p.n))
            slots.extend([slot] * p.n)
            cache.extend(range(p.start, p.start + p.n))
            dest.extend(range((slot - lo) * n_max, (slot - lo) * n_max + p.n))

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return _Group(
            lo,
            hi,
            n_max,
            index(rows),
            index(slots),
            index(cache),
            index(dest),
            self._query_rows(bias),
        )

    def _query_rows(self, bias: torch.Tensor) -> torch.Tensor:
        """[slots, n_max, T] token masks → [slots, rows, T], a row per query head of a group and
        zero rows (which see every key) up to ``attention_rows``: ``_grouped``'s layout."""
        group = self.info.num_heads // self.info.num_kv_heads
        rows = bias.repeat_interleave(group, dim=1)
        extra = self.attention_rows - rows.shape[1]
        return F.pad(rows, (0, 0, 0, extra)) if extra > 0 else rows

    def forward_many(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        """One forward over every call's rows: embeddings, norms, RoPE and the GEMMs run on all
        rows at once (each row-invariant, so a row's numbers do not depend on its neighbours);
        attention of the pooled calls of up to ``GROUPED_MAX_ROWS`` rows (decode steps, draft
        trees) as one group over their slots (``_grouped``), of the others (prefill chunks,
        requests beyond the pool) per call over its own cache (``_attention``), the two
        bit-identical."""
        with self._lock:
            return self._forward_many(calls)

    def _forward_many(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        if self.fused is not None:
            with native.serial_torch(self.own_threads):
                return self._forward_fused(calls)
        info = self.info
        parts: list[_Part] = []
        for call in calls:
            parts.append(self._part(call, sum(p.n for p in parts)))
        grouped = self._group(parts)  # after every _part: reserving may have grown the pool
        total = sum(p.n for p in parts)
        heads, kv_heads, head_dim = info.num_heads, info.num_kv_heads, info.head_dim

        positions = torch.cat([p.positions for p in parts]).to(self.device)  # [total]
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [total, 1, d]
        tokens = torch.cat([c.tokens for c in calls]) if len(calls) > 1 else calls[0].tokens
        # Fewer rows than the GEMM kernels' smallest minimum: zero rows are added to the embeddings
        # once here rather than in every GEMM, and dropped around attention (nothing reads them).
        # A GEMM whose kernel needs more rows still pads its own input (``Linear``).
        pad = max(0, self.min_rows - total)
        h = self.embed(tokens.to(self.device))  # [total, hidden]
        if pad:
            h = F.pad(h, (0, 0, 0, pad))  # [total + pad, hidden]

        outs = _Outputs(calls, [p.rows for p in parts])
        outs.keep_hidden(0, h)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._rms(h, layer.ln_attn))[:total].to(self.attn_dtype)  # [total, (q + 2 kv) d]
            qk = self._rotate(qkv[:, : q_size + kv_size].view(total, heads + kv_heads, head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]  # [total, heads, d], [total, kv, d]
            v = qkv[:, q_size + kv_size :].view(total, kv_heads, head_dim)
            attn = q.new_empty(total, heads * head_dim)
            if grouped is not None:
                pool_keys, pool_values = self._pool.keys[index], self._pool.values[index]
                pool_keys[grouped.slots, :, grouped.cache] = k[grouped.rows]
                pool_values[grouped.slots, :, grouped.cache, :head_dim] = v[grouped.rows]
                span = slice(grouped.lo, grouped.hi)
                attn[grouped.rows] = self._grouped(
                    q[grouped.rows],
                    pool_keys[span],
                    pool_values[span],
                    grouped.bias,
                    grouped.dest,
                    grouped.n_max,
                )
            outs.keep_queries(index, q)
            for part in parts:
                rows = part.rows
                if part.bias is None:
                    continue  # grouped above
                start, end = part.start, part.start + part.n
                keys, values = part.state.keys[index, 0], part.state.values[index, 0]  # [kv, capacity, d]
                keys[:, start:end] = k[rows].transpose(0, 1)
                values[:, start:end, :head_dim] = v[rows].transpose(0, 1)
                attn[rows] = self._attention(q[rows], keys, values, part.bias)  # [n, heads · d]
            attn = attn.to(self.dtype)
            h = h + layer.o(F.pad(attn, (0, 0, 0, pad)) if pad else attn)
            gate, up = layer.gate_up(self._rms(h, layer.ln_mlp)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
            if index + 1 < len(self.layers):
                outs.keep_hidden(index + 1, h)
        h = self._rms(h[:total], self.norm)
        outs.keep_hidden(len(self.layers), h)  # the last layer's state after the final norm
        return outs.with_logits(self.lm_head, h)

    # -- the fused forward ------------------------------------------------------------------

    def _fused_groups(
        self, calls: Sequence[ForwardCall]
    ) -> tuple[list[_FusedGroup], list[slice], torch.Tensor]:
        """Check every call against the context limit, make room in its cache, and lay the rows
        out by the buffer their cache lives in: the pool's slots (one group) or a request's own
        buffers (a group each). Returns the groups, each call's rows and every row's position."""
        spans: list[slice] = []
        positions: list[torch.Tensor] = []
        members: dict[int, list[tuple[_KVState, int, int, torch.Tensor]]] = {}  # buffer -> parts
        row = 0
        for call in calls:
            state = call.state
            assert isinstance(state, _KVState)
            n = int(call.tokens.shape[0])
            tree = call.tree
            offsets = tree.position_offsets if tree is not None else torch.arange(n)
            start = state.length
            last_position = start + int(offsets.max())
            if last_position >= self.info.max_context:
                raise ValueError(
                    f"context of {last_position + 1} tokens exceeds the model's limit of "
                    f"{self.info.max_context}"
                )
            self._reserve(state, start + n)
            visible = tree.mask if tree is not None else causal_mask(n)
            key = -1 if state.pool is not None else id(state)
            members.setdefault(key, []).append((state, row, n, visible))
            spans.append(slice(row, row + n))
            positions.append(offsets + start)
            row += n
        groups = []
        for parts in members.values():
            width = max(n for _, _, n, _ in parts)
            count = sum(n for _, _, n, _ in parts)
            visible = torch.zeros(count, width, dtype=torch.bool)
            rows: list[int] = []
            slots: list[int] = []
            starts: list[int] = []
            cache: list[int] = []
            at = 0
            for state, first, n, mask in parts:
                visible[at : at + n, :n] = mask
                rows.extend(range(first, first + n))
                slots.extend([max(state.slot, 0)] * n)
                starts.extend([state.length] * n)
                cache.extend(range(state.length, state.length + n))
                at += n

            def index(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.long)

            own = parts[0][0] if parts[0][0].pool is None else None
            groups.append(_FusedGroup(own, index(rows), index(slots), index(starts), index(cache), visible))
        return groups, spans, torch.cat(positions)

    def _forward_fused(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        """``_forward_many`` with the work between the GEMMs in the fused kernels (``native``):
        per layer residual add + RMSNorm, RoPE + the cache write, attention, SiLU·up."""
        fused = self.fused
        assert fused is not None
        fused.use_pool(self.own_threads)  # for this thread's kernels
        info = self.info
        heads, head_dim = info.num_heads, info.head_dim
        groups, spans, positions = self._fused_groups(calls)
        total = spans[-1].stop
        cos, sin = self.cos[positions], self.sin_signed[positions]  # [total, d] each
        tokens = torch.cat([c.tokens for c in calls]) if len(calls) > 1 else calls[0].tokens
        pad = max(0, self.min_rows - total)  # rows up to the GEMM kernels' smallest minimum
        h = self.embed(tokens.to(self.device))  # [total, hidden]
        if pad:
            h = F.pad(h, (0, 0, 0, pad))
        outs = _Outputs(calls, spans)
        outs.keep_hidden(0, h)
        scale = 1.0 / math.sqrt(head_dim)
        h, x = fused.add_rms_norm(h, None, self.layers[0].ln_attn, self.eps)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(x)  # [total + pad, (heads + 2 kv) d]
            q = torch.empty(total, heads, head_dim, dtype=torch.float32)
            attn = (torch.zeros if pad else torch.empty)(total + pad, heads * head_dim, dtype=self.dtype)
            for g in groups:
                keys, values = self._layer_cache(g, index)
                fused.rope_store(qkv, cos, sin, q, keys, values, g.rows, g.slots, g.cache)
                fused.attention(q, keys, values, g.rows, g.slots, g.starts, g.visible, scale, attn)
            outs.keep_queries(index, q)
            h, x = fused.add_rms_norm(h, layer.o(attn), layer.ln_mlp, self.eps)
            down = layer.down(fused.silu_mul(layer.gate_up(x)))
            last = index + 1 == len(self.layers)
            h, x = fused.add_rms_norm(
                h, down, self.norm if last else self.layers[index + 1].ln_attn, self.eps
            )
            if not last:
                outs.keep_hidden(index + 1, h)
        x = x[:total]
        outs.keep_hidden(len(self.layers), x)  # the last layer's state after the final norm
        return outs.with_logits(self.lm_head, x)

    def _layer_cache(self, group: _FusedGroup, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's buffers at ``layer``: keys [slots, kv, capacity, d], values [..., d + 1]."""
        if group.own is None:
            return self._pool.keys[layer], self._pool.values[layer]
        return group.own.keys[layer], group.own.values[layer]


class _Outputs:
    """The outputs of a forward over several calls (``spans``: each call's rows), filled in as the
    layers run: hidden states and queries each call asked for, then logits."""

    def __init__(self, calls: Sequence[ForwardCall], spans: Sequence[slice]) -> None:
        self.calls, self.spans = calls, spans
        self.outs = [ForwardOutput(logits=torch.empty(0)) for _ in calls]
        self.heads: list[dict[int, list[int]]] = []  # per call: layer -> query heads wanted
        for call in calls:
            by_layer: dict[int, list[int]] = {}
            for layer_index, head in call.needs.query_heads:
                by_layer.setdefault(layer_index, []).append(head)
            self.heads.append(by_layer)

    def keep_hidden(self, layer: int, h: torch.Tensor) -> None:
        """h [rows, hidden]: the state entering ``layer`` (after the final norm for the last)."""
        for call, span, out in zip(self.calls, self.spans, self.outs, strict=True):
            if layer in call.needs.hidden_layers:
                out.hidden[layer] = h[span]

    def keep_queries(self, layer: int, q: torch.Tensor) -> None:
        """q [rows, heads, d]: ``layer``'s post-RoPE queries."""
        for span, out, by_layer in zip(self.spans, self.outs, self.heads, strict=True):
            for head in by_layer.get(layer, ()):
                out.queries[(layer, head)] = q[span, head]

    def with_logits(self, lm_head: Linear, h: torch.Tensor) -> list[ForwardOutput]:
        """Logits of h [rows, hidden] (final-normed) for every row of a call, or its last row only
        (a prefill chunk needs no more)."""
        calls, spans = self.calls, self.spans
        if len(calls) == 1:
            chosen = h[-1:] if calls[0].last_logits_only else h
        else:
            wanted = [
                torch.arange(s.stop - 1 if c.last_logits_only else s.start, s.stop)
                for c, s in zip(calls, spans, strict=True)
            ]
            chosen = h[torch.cat(wanted).to(h.device)]
        logits = lm_head(chosen).float()
        row = 0
        for call, span, out in zip(calls, spans, self.outs, strict=True):
            count = 1 if call.last_logits_only else span.stop - span.start
            out.logits = logits[row : row + count]
            row += count
        return self.outs


@dataclass
class _FusedGroup:
    """The rows of a fused forward whose caches live in one buffer: the pool, or one request's
    own buffers (``own``)."""

    own: _KVState | None  # None: the pool
    rows: torch.Tensor  # [m] the rows in the forward
    slots: torch.Tensor  # [m] each row's slot in the buffer (0 for own buffers)
    starts: torch.Tensor  # [m] its call's committed length: it sees cache positions [0, start)
    cache: torch.Tensor  # [m] its own cache position: start + its row within its call
    visible: torch.Tensor  # [m, w] bool: it sees its call's new row i (cache position start + i)
