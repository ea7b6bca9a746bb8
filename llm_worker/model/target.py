"""The target model as the engine sees it: one forward over new tokens, then a commit.

A forward appends KV entries for its rows after the committed prefix; ``commit(rows)`` keeps
the rows named (the root and the accepted path, in order) and drops the rest, so after a tree
step the cache holds exactly the committed sequence. Nothing is committed implicitly.

A batch of drafts runs through ``forward_batch`` (D rows side by side, each the root then one
draft) and ``commit_batch`` (the root and accepted tokens of one row). The fast backend computes
the rows as a real batch over the shared cache; the default here, which ``HFTarget`` uses, runs
the equivalent tree forward of the unmerged rows.

Two implementations: ``FastLlamaTarget`` (``llm_worker.model.fast_llama``) for Llama-family
checkpoints, and ``HFTarget`` here, which drives any transformers causal LM through its own
forward and ``DynamicCache``.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from llm_worker.model.artifacts import ARTIFACTS, Tap
from llm_worker.types import HIDDEN, QUERY, ArtifactKey, ArtifactNeeds
from llm_worker.verify.tree import TreeBuffers, tree_buffers


@dataclass(frozen=True)
class TargetInfo:
    name: str
    fingerprint: str  # identifies the weights (not the path): keys cost curves and head files
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    backend: str
    weights_id: str = ""  # identifies the weights whatever dtype they were loaded in (dense keys)


class _ByKind:
    """The built-in kinds of a forward's ``artifacts`` under their old names (tests, calibration)."""

    artifacts: dict[ArtifactKey[Any], torch.Tensor]

    @property
    def hidden(self) -> dict[int, torch.Tensor]:
        """layer -> the ``hidden_layers`` artifact."""
        return {key.args[0]: v for key, v in self.artifacts.items() if key.kind == HIDDEN}

    @property
    def queries(self) -> dict[tuple[int, int], torch.Tensor]:
        """(layer, head) -> the ``query_heads`` artifact."""
        return {(key.args[0], key.args[1]): v for key, v in self.artifacts.items() if key.kind == QUERY}


@dataclass
class ForwardOutput(_ByKind):
    logits: torch.Tensor  # [n, vocab] float32
    artifacts: dict[ArtifactKey[Any], torch.Tensor] = field(default_factory=dict)
    """What the call's needs record (``llm_worker.model.artifacts``), by key: [n, ...] a value per row."""


@dataclass
class BatchForwardOutput(_ByKind):
    """A batched forward's output: row r is the root, then draft row r (padded to L)."""

    logits: torch.Tensor  # [D, 1 + L, vocab] float32; columns past a row's length are padding
    artifacts: dict[ArtifactKey[Any], torch.Tensor] = field(default_factory=dict)  # key -> [D, 1 + L, ...]

    def row(self, r: int) -> ForwardOutput:
        """Row r as a chain forward's output: [1 + L, ...] per field."""
        return ForwardOutput(self.logits[r], {key: v[r] for key, v in self.artifacts.items()})


@dataclass
class ForwardCall:
    """One request's part of a forward over several requests (``TargetModel.forward_many``): the
    arguments of ``forward``."""

    state: SequenceState
    tokens: torch.Tensor  # [n] long
    tree: TreeBuffers | None
    needs: ArtifactNeeds
    last_logits_only: bool = False


@dataclass(frozen=True)
class KVBuffers:
    """One layer's whole cache buffers, for kernels that read a request's cache in place
    (``TargetModel.kv_buffers``): its committed positions are ``[slot, :, 0:length]``."""

    keys: torch.Tensor  # [slots, num_kv_heads, capacity, head_dim] float32, contiguous
    values: torch.Tensor  # [slots, num_kv_heads, capacity, >= head_dim] float32, contiguous
    slot: int


class SequenceState:
    """One request's KV cache; ``length`` counts committed positions."""

    length: int = 0
    batch_rows: list[list[int]] | None = None
    """After the default ``forward_batch``: the tree-forward rows of each batch row's positions."""
    prefix_names: tuple[bytes, ...] = ()
    """Names of the request's first tokens, ``prefix_block`` at a time: name i stands for its
    namespace and its first (i + 1) * prefix_block tokens (``prefix_cache.block_names``). On a
    batch-invariant forward two caches that carry name i hold the same bytes at positions
    [0, (i + 1) * prefix_block) once both have committed them, so a forward may read one copy for
    both (``ops.shared_prefixes``)."""
    prefix_block: int = 0


class TargetModel(ABC):
    info: TargetInfo
    model: Any
    """The transformers model whose weights the forward uses (its own forward: batched hidden
    states for datastore builds)."""

    @abstractmethod
    def start(self) -> SequenceState:
        """A fresh, empty KV state for one request."""

    @abstractmethod
    def forward(
        self,
        state: SequenceState,
        tokens: torch.Tensor,  # [n] long
        tree: TreeBuffers | None,  # None: a causal chain
        needs: ArtifactNeeds,
        last_logits_only: bool = False,
    ) -> ForwardOutput:
        """Run rows ``tokens`` after the committed prefix; positions are length + row depth.

        ``last_logits_only``: compute logits for the last row alone (a prefill needs no more).
        """

    def forward_many(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        """Each call's ``forward``, bit for bit as if it ran alone, each request attending only
        to its own cache. This default runs them one after another; a backend that computes them
        in one forward (the linear layers over every call's rows at once: the weights read once
        for all requests) overrides it (``FastLlamaTarget``)."""
        return [self.forward(c.state, c.tokens, c.tree, c.needs, c.last_logits_only) for c in calls]

    @abstractmethod
    def commit(self, state: SequenceState, rows: Sequence[int]) -> None:
        """Keep the KV of ``rows`` (ascending row indices of the last forward), drop the rest."""

    def forward_batch(
        self,
        state: SequenceState,
        tokens: torch.Tensor,  # [D, 1 + L] long: column 0 the root (the same in every row), then row r
        lengths: Sequence[int],  # [D] draft tokens of each row; columns past 1 + lengths[r] are padding
        needs: ArtifactNeeds,
    ) -> BatchForwardOutput:
        """Run D drafts side by side after the committed prefix; nothing is committed.

        Row r's column c sits at position length + c and sees the committed prefix and columns
        0..c of its own row, never another row. Logits at padding columns are garbage.

        This default is a fallback, not a batch: it runs the equivalent *tree* forward of the
        unmerged rows — the root once, every row its own branch, no padding, 1 + Σ lengths rows
        — through ``forward``, and scatters the result into [D, 1 + L]. The numbers are those of
        the batch (each position sees exactly the same keys); only the layout differs. Every
        backend takes it today (the fast one too: a separate batched attention would reduce each
        row's keys in another order than a decode of the same token, see ``fast_llama``); one with
        a real batched forward over a shared cache would override it.
        """
        d, width = int(tokens.shape[0]), int(tokens.shape[1])
        values = tokens.tolist()  # one copy to the host, not one per token
        flat = [int(values[0][0])]
        parents: list[int] = []
        index = torch.zeros(d, width, dtype=torch.long)  # [D, 1 + L] row of the tree forward; pads → 0
        batch_rows = []
        for r in range(d):
            rows = [0]
            parent = -1
            for c in range(1, 1 + int(lengths[r])):
                flat.append(int(values[r][c]))
                parents.append(parent)
                parent = len(flat) - 2  # the node just added
                rows.append(len(flat) - 1)
            index[r, : len(rows)] = torch.tensor(rows)
            batch_rows.append(rows)
        flat_tokens = torch.tensor(flat, dtype=tokens.dtype, device=tokens.device)  # [1 + Σ lengths]
        out = self.forward(state, flat_tokens, tree_buffers(tuple(parents)), needs)
        state.batch_rows = batch_rows
        index = index.to(out.logits.device)
        return BatchForwardOutput(out.logits[index], {key: v[index] for key, v in out.artifacts.items()})

    def commit_batch(self, state: SequenceState, row: int, count: int) -> None:
        """Keep columns 0 .. count - 1 (the root and count - 1 draft tokens) of batch row ``row``."""
        if state.batch_rows is None:
            raise RuntimeError("commit_batch without a forward_batch before it")
        rows = state.batch_rows[row][:count]
        state.batch_rows = None
        self.commit(state, rows)

    def branching_rows_limit(self, state: SequenceState) -> int | None:
        """Most rows (root included) a forward of a *branching* tree may have after ``state`` and
        stay bit-identical to decoding its tokens one by one; None: no limit. Chains never have one."""
        return None

    def keys(self, state: SequenceState, layer: int) -> torch.Tensor:
        """Post-RoPE keys of committed positions: [num_kv_heads, length, head_dim]."""
        return self.kv(state, layer)[0]

    def kv(self, state: SequenceState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and the values of committed positions, each [num_kv_heads, length,
        head_dim]: views of the cache, not copies."""
        raise NotImplementedError(f"the {self.info.backend} backend does not expose its KV cache")

    def kv_buffers(self, state: SequenceState, layer: int) -> KVBuffers | None:
        """``layer``'s cache as whole contiguous buffers and the request's slot in them, where the
        backend keeps it so (the fast backend); None elsewhere (read ``kv`` then)."""
        return None

    @property
    def prefix_reuse(self) -> bool:
        """Whether committed KV may be copied out of one request's cache and into another's
        (``export_kv`` / ``import_kv``) with every later logit bit-identical to a fresh prefill:
        true only of a batch-invariant forward (``llm_worker.prefix_cache``)."""
        return False

    def export_kv(self, state: SequenceState, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of committed positions start .. stop - 1: keys [layers, kv_heads, n, d] and
        values in the cache's own layout [layers, kv_heads, n, d'] (``import_kv`` takes them)."""
        raise NotImplementedError(f"the {self.info.backend} backend does not export its KV cache")

    def import_kv(self, state: SequenceState, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append positions ``export_kv`` copied (of the same tokens at the same positions) to
        ``state``'s committed cache, as if its forwards had computed them."""
        raise NotImplementedError(f"the {self.info.backend} backend does not import KV")

    @property
    def taps(self) -> frozenset[Tap]:
        """The points at which its forward hands out tensors for artifacts (``artifacts``)."""
        return frozenset()

    @property
    def supports_queries(self) -> bool:
        return False

    @property
    def kernel_variant(self) -> str:
        """What besides model, dtype and device changes the forward's speed (keys cost curves)."""
        return ""

    def weight_bytes(self) -> int | None:
        """Bytes of weights one decode forward reads (the bench's bandwidth limit); None: unknown."""
        return None

    def kernel_info(self) -> dict[str, Any]:
        """How the forward computes (kernel choices, what was measured to make them), for reports."""
        return {}

    def kv_cache_usage(self) -> tuple[int, int] | None:
        """(requests' KV caches held in the shared pool now, the pool's capacity in caches), for
        the worker's ``specdraft_kv_cache_usage_perc``; None: this target has no such pool."""
        return None


def weights_fingerprint(config: dict[str, Any], embed: torch.Tensor) -> str:
    """A short id of a checkpoint: its architecture plus a sample of its embedding matrix."""
    h = hashlib.sha256()
    keep = {k: v for k, v in sorted(config.items()) if not k.startswith("_") and k != "transformers_version"}
    h.update(json.dumps(keep, sort_keys=True, default=str).encode())
    h.update(embed[:16].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def weights_id(config: dict[str, Any], embed: torch.Tensor) -> str:
    """``weights_fingerprint`` of the embedding rounded to bfloat16: the same for a float32,
    bfloat16 (or, but for rare double roundings, float16) load of one checkpoint — hidden states
    of any of them serve as dense keys for the others."""
    keep = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    return weights_fingerprint(keep, embed[:16].detach().to(torch.bfloat16))


def eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list | tuple):
            ids.extend(int(e) for e in eos)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def describe(
    model: Any, tokenizer: Any, dtype: str, device: str, backend: str, max_context: int | None
) -> TargetInfo:
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text_cfg.num_attention_heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    limit = int(getattr(text_cfg, "max_position_embeddings", 0) or 4096)
    return TargetInfo(
        name=str(getattr(cfg, "_name_or_path", "") or cfg.model_type),
        fingerprint=weights_fingerprint(cfg.to_dict(), model.get_input_embeddings().weight),
        weights_id=weights_id(cfg.to_dict(), model.get_input_embeddings().weight),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        num_layers=int(text_cfg.num_hidden_layers),
        num_heads=int(heads),
        num_kv_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        hidden_size=int(text_cfg.hidden_size),
        max_context=min(limit, max_context) if max_context else limit,
        eos_token_ids=eos_ids(model, tokenizer),
        dtype=dtype,
        device=device,
        backend=backend,
    )


class _HFState(SequenceState):
    def __init__(self, cache: Any) -> None:
        self.length = 0
        self.cache = cache
        self.pending = 0  # rows appended by the last forward, not yet committed


class HFTarget(TargetModel):
    """Any transformers causal LM, through its own forward and ``DynamicCache``.

    Trees use a 4D boolean attention mask, which transformers passes through unchanged.
    Its taps are the hidden states of ``output_hidden_states`` (the residual stream below the
    last layer); per-head queries and the last layer's state before the final norm are not
    available.

    Batches of drafts take the default ``forward_batch``: the equivalent tree forward of the
    unmerged rows, not a batched forward. A real batch would need the ``DynamicCache`` repeated
    D times (``batch_repeat_interleave`` copies the whole cache per row, and every update
    concatenates it again); the tree forward computes the same attention with 1 + Σ lengths
    rows instead of D·(1 + L) and reads the cache once.
    """

    def __init__(self, model: Any, info: TargetInfo) -> None:
        self.model = model
        self.info = info
        self.device = torch.device(info.device)
        cfg = model.config
        window = getattr(cfg, "sliding_window", None)
        self.sliding_window = int(window) if window and getattr(cfg, "use_sliding_window", True) else None

    def start(self) -> SequenceState:
        from transformers import DynamicCache

        # Full-length layers even for sliding-window models: commits crop and gather freely,
        # and the masks below apply the window.
        return _HFState(DynamicCache())

    def forward(
        self,
        state: SequenceState,
        tokens: torch.Tensor,
        tree: TreeBuffers | None,
        needs: ArtifactNeeds,
        last_logits_only: bool = False,
    ) -> ForwardOutput:
        assert isinstance(state, _HFState)
        recordings = ARTIFACTS.published(self, needs)
        if state.pending:
            self.commit(state, [])
        n = int(tokens.shape[0])
        start = state.length
        offsets = tree.position_offsets if tree is not None else torch.arange(n)
        positions = (offsets + start).to(self.device)[None]
        kwargs: dict[str, Any] = {}
        if tree is not None and not tree.is_chain:
            allowed = torch.ones(n, start + n, dtype=torch.bool)
            allowed[:, start:] = tree.mask
            window = self.sliding_window
            if window:
                key_pos = torch.cat([torch.arange(start), offsets + start])
                allowed &= (offsets + start)[:, None] - key_pos[None, :] < window
            # Additive float mask: eager attention adds it, sdpa accepts it as is.
            dtype = self.model.get_input_embeddings().weight.dtype
            mask = torch.zeros(n, start + n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            kwargs["attention_mask"] = mask[None, None].to(self.device)
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            position_ids=positions,
            past_key_values=state.cache,
            use_cache=True,
            output_hidden_states=bool(recordings),  # every tap here is a hidden state
            logits_to_keep=1 if last_logits_only else 0,
            **kwargs,
        )
        state.pending = n
        rows = slice(None)
        artifacts = {r.key: r.select(r.key, out.hidden_states[r.tap[1]][0], rows) for r in recordings}
        return ForwardOutput(out.logits[0].float(), artifacts)

    @cached_property
    def taps(self) -> frozenset[Tap]:
        top = self.info.num_layers
        return frozenset({("hidden", i) for i in range(top + 1)} | {("residual", i) for i in range(top)})

    def kv(self, state: SequenceState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(state, _HFState)
        if state.pending:
            self.commit(state, [])
        if layer >= len(state.cache.layers):
            raise ValueError(f"no KV cache for layer {layer}")
        entry = state.cache.layers[layer]
        return entry.keys[0, :, : state.length], entry.values[0, :, : state.length]

    def commit(self, state: SequenceState, rows: Sequence[int]) -> None:
        assert isinstance(state, _HFState)
        n, start = state.pending, state.length
        rows = list(rows)
        if rows == list(range(len(rows))):
            if n - len(rows):
                state.cache.crop(-(n - len(rows)))
        else:
            index = torch.tensor(rows, device=self.device) + start
            for layer in state.cache.layers:
                keep_k = layer.keys.index_select(-2, index)
                keep_v = layer.values.index_select(-2, index)
                layer.keys = torch.cat([layer.keys[..., :start, :], keep_k], dim=-2)
                layer.values = torch.cat([layer.values[..., :start, :], keep_v], dim=-2)
        state.length = start + len(rows)
        state.pending = 0
