"""``edd``, ``edd+pct``: a one-layer draft decoder over the target's hidden states (EDD).

The network (``edd_net``) reads the target's hidden states of one layer at the committed
positions as a soft prompt. Each step the drafter first catches up: the soft prompt's K/V for the
committed positions it has not seen (one projection per position, kept per request; positions
after a divergence are recomputed). Then it drafts from the root — the last committed token,
which has no hidden state yet — in rows of its own *block*: the root's row reads the whole soft
prompt and itself; a draft token's row reads the soft prompt, the root and its own path.

- ``edd``: a chain, one draft forward per token: the draft's argmax (greedy) or its sample.
- ``edd+pct``: a tree by PCT (``pct``): per depth, the ``width`` frontier nodes of highest
  expected acceptance (the product of the draft's probabilities along the path) whose children
  could still pay are expanded together in one draft forward, each into its ``topk`` most likely
  children; then ``pct.prune`` keeps the node set that maximises the expected gain on the
  measured cost curve, t(0) · Σ a - (t(n) - t(0)), and the tree is verified in one forward.

Both stop at ``depth``, at ``min_reach`` (a node of lower expected acceptance is not expanded),
at the step budget, and where another node would not pay for its verify cost and the draft
forward's measured seconds.

Greedy requests draft the draft's argmax first. Sampled requests put first, at each node, the
draft token sampled from the draft's distribution q (the request's temperature / top-k / top-p
over the draft vocabulary) with the request's noise for that position (``noise.choose``); the
target's own sample at that position runs the same race over p, and verification matches each
node against it — so any tree leaves the output exactly plain sampling's.

Every node carries a feature (the draft's probability of it, bucketed) for the planner.

On the fast backend's fused kernels the network runs through the target's operations
(``edd_fused``: one K/V buffer per request, the soft prompt first and the step's block rows
after it); elsewhere through torch (``edd_net``).

A mode's options are checked before its checkpoint is read; the network, its fused copy and its
RoPE tables (``EddNetwork``) are loaded once per worker and shared by every spelling of both
modes (``checkpoint.SharedNetworks``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    ModeUnavailableError,
    bucket,
    float_option,
    int_option,
    shared_prefix,
)
from llm_worker.drafters.checkpoint import (
    CheckpointError,
    DrafterCheckpoint,
    SharedNetworks,
    load_drafter,
    locate_drafter,
)
from llm_worker.drafters.edd_fused import FusedEdd
from llm_worker.drafters.edd_net import EddConfig, EddNet, target_head_rows
from llm_worker.drafters.glide_fused import DraftKV, DraftNetwork
from llm_worker.drafters.pct import expand_order, prune
from llm_worker.model.target import TargetModel
from llm_worker.sampling import warp_logits
from llm_worker.types import ArtifactNeeds, DraftTree

CHECKPOINT = "edd"
FEATURE_BOUNDS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class EddOptions:
    """One mode's drafting shape (``edd``: a chain, ``topk = width = 1``)."""

    depth: int = 8
    """The deepest draft token."""
    min_reach: float = 0.05
    """A node of lower expected acceptance is not expanded."""
    topk: int = 1
    """Children per expanded node: the draft's most likely tokens."""
    width: int = 1
    """The most nodes expanded per depth (one draft forward each depth)."""


@dataclass(eq=False)
class EddNetwork(DraftNetwork[EddNet, FusedEdd]):
    """``DraftNetwork`` for ``edd`` and ``edd+pct``: one per checkpoint and target."""

    FUSED = FusedEdd


@dataclass
class _State(DrafterState):
    """The soft prompt's K/V for committed positions 0 .. len(tokens) - 1 of one request."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # [T - 1] ids
    keys: torch.Tensor | None = None  # [1, kv, len(tokens), d]
    values: torch.Tensor | None = None  # [1, kv, len(tokens), d]
    fused: DraftKV | None = None  # the same, when the network runs on the fused kernels


@dataclass
class _Block:
    """The draft rows of one step: row 0 the root, then every expanded node."""

    paths: list[list[int]]  # [rows] each row's block rows from the root to itself
    keys: torch.Tensor | None = None  # [1, kv, rows, d] (None: in the fused buffer after the prompt)
    values: torch.Tensor | None = None  # [1, kv, rows, d]


def _children(probs: torch.Tensor, topk: int, first: int | None) -> list[int]:
    """The draft ids of a node's children: ``first`` (a sampled token) then the most likely
    others, ``topk`` in all; or the ``topk`` most likely. probs: [V]."""
    ranked = torch.topk(probs, min(topk + 1, probs.numel())).indices.tolist()
    if first is None:
        return ranked[:topk]
    return [first, *[r for r in ranked if r != first]][:topk]


class EddDrafter(Drafter):
    gated = True  # draft forwards run before the planner decides

    def __init__(self, network: EddNetwork, options: EddOptions) -> None:
        self.network = network  # shared with the other EDD drafters of the checkpoint
        self.target = network.target
        self.net = network.net
        self.cfg: EddConfig = network.net.cfg
        self.d2t = network.d2t  # [V] target id of each draft id
        self.options = options
        self.embed = self.target.model.get_input_embeddings()
        self.cos, self.sin = network.cos, network.sin  # [max_context, d]
        self.needs = ArtifactNeeds(hidden_layers=frozenset({self.cfg.prompt_layer}))
        self.forward_seconds: float | None = None  # one block forward, measured (EMA)
        self.fast = network.fast  # None: the network runs in torch

    def tensors(self) -> Iterable[torch.Tensor]:
        return self.network.tensors()

    def _catch_up(self, ctx: DraftContext) -> _State:
        """The soft prompt's K/V extended over the committed positions 0 .. T-2 it lacks (kept
        where the tokens still match)."""
        tokens = np.asarray(ctx.tokens)
        cached = len(tokens) - 1  # positions with a hidden state: all but the root
        state = ctx.request_state.drafter
        if not isinstance(state, _State):
            state = ctx.request_state.drafter = _State()
        keep = shared_prefix(state.tokens, tokens[:cached])
        if self.fast is not None:
            kv = state.fused = state.fused or self.fast.new_kv()
            kv.length = min(kv.length, keep)
            if keep < cached:
                self.fast.extend_prompt(kv, ctx.hidden(self.cfg.prompt_layer)[keep:cached])
        elif keep < cached:
            hidden = ctx.hidden(self.cfg.prompt_layer)[keep:cached].float()  # [n, hidden]
            k, v = self.net.prompt_kv(hidden[None], self.cos[None, keep:cached], self.sin[None, keep:cached])
            if state.keys is not None and state.values is not None and keep:
                k = torch.cat((state.keys[:, :, :keep], k), dim=2)
                v = torch.cat((state.values[:, :, :keep], v), dim=2)
            state.keys, state.values = k, v
        elif state.keys is not None and state.values is not None:
            state.keys, state.values = state.keys[:, :, :cached], state.values[:, :, :cached]
        state.tokens = np.array(tokens[:cached], dtype=np.int64)  # a copy: the engine's buffer moves on
        return state

    def _rows(
        self, state: _State, block: _Block | None, tokens: list[int], position: int, parents: list[int]
    ) -> tuple[torch.Tensor, _Block]:
        """New block rows for ``tokens`` (target ids) at ``position``, each the child of block row
        ``parents[i]`` (-1: the root's own row); returns their draft logits [m, V] and the block."""
        m = len(tokens)
        rows = 0 if block is None else len(block.paths)
        paths = [
            ([] if p < 0 or block is None else block.paths[p]) + [rows + i] for i, p in enumerate(parents)
        ]
        x = self.embed(torch.tensor(tokens, device=self.cos.device)).float()  # [m, hidden]
        began = time.perf_counter()
        if self.fast is not None and state.fused is not None:
            visible = torch.zeros(m, rows + m, dtype=torch.bool)
            for i, path in enumerate(paths):
                visible[i, path] = True
            positions = torch.full((m,), position, dtype=torch.long)
            logits = self.fast.rows(state.fused, x, positions, rows, visible)
            joined = _Block((block.paths if block is not None else []) + paths)
        else:
            logits, joined = self._torch_rows(state, block, x, position, paths)
        seconds = time.perf_counter() - began
        self.forward_seconds = (
            seconds if self.forward_seconds is None else 0.9 * self.forward_seconds + 0.1 * seconds
        )
        return logits, joined

    def _torch_rows(
        self, state: _State, block: _Block | None, x: torch.Tensor, position: int, paths: list[list[int]]
    ) -> tuple[torch.Tensor, _Block]:
        """``_rows`` through the torch network: x [m, hidden] the new rows' embeddings."""
        assert state.keys is not None and state.values is not None
        m = x.shape[0]
        prompt = state.keys.shape[2]
        rows = 0 if block is None else len(block.paths)
        allowed = torch.zeros(1, 1, m, prompt + rows + m, dtype=torch.bool)
        allowed[..., :prompt] = True
        for i, path in enumerate(paths):
            allowed[0, 0, i, [prompt + r for r in path]] = True
        allowed = allowed.to(x.device)  # built on the host, copied once
        keys, values = state.keys, state.values
        if block is not None and block.keys is not None and block.values is not None:
            keys, values = torch.cat((keys, block.keys), dim=2), torch.cat((values, block.values), dim=2)
        cos = self.cos[position].expand(1, m, -1)
        sin = self.sin[position].expand(1, m, -1)
        logits, (k, v) = self.net(x[None], cos, sin, (keys, values), allowed)
        if block is None or block.keys is None or block.values is None:
            return logits[0], _Block(paths, k, v)
        return logits[0], _Block(
            block.paths + paths, torch.cat((block.keys, k), dim=2), torch.cat((block.values, v), dim=2)
        )

    def propose(self, ctx: DraftContext) -> DraftTree:
        total = len(ctx.tokens)
        if total < 2 or ctx.budget < 1:
            return DraftTree.empty()
        opts = self.options
        sampled = not ctx.sampling.greedy and ctx.noise is not None
        tokens: list[int] = []  # [n] target ids
        parents: list[int] = []  # [n] -1 = the root
        accept: list[float] = []  # [n] expected acceptance
        features: list[str] = []
        with torch.inference_mode():
            state = self._catch_up(ctx)
            logits, block = self._rows(state, None, [int(ctx.tokens[-1])], total - 1, [-1])
            expanding = [(-1, 0)]  # (candidate node or -1 for the root, its block row)
            limit = min(opts.depth, ctx.budget)
            for depth in range(1, limit + 1):
                position = total + depth - 1  # the children's sequence position
                fresh: list[int] = []
                for row_index, (node, _) in enumerate(expanding):
                    row = logits[row_index]  # [V]
                    probs = (
                        warp_logits(row[None], ctx.sampling)[0] if sampled else torch.softmax(row.float(), -1)
                    )
                    first = ctx.noise.choose(probs, position, ids=self.d2t) if sampled and ctx.noise else None
                    for choice in _children(probs, opts.topk, first):
                        q = float(probs[choice])
                        fresh.append(len(tokens))
                        tokens.append(int(self.d2t[choice]))
                        parents.append(node)
                        accept.append(q * (accept[node] if node >= 0 else 1.0))
                        features.append(f"e{bucket(q, FEATURE_BOUNDS)}")
                if depth == limit or len(tokens) >= 2 * ctx.budget:
                    break
                chosen = expand_order(
                    fresh, accept, opts.width, opts.min_reach, ctx.verify_seconds, self.forward_seconds or 0.0
                )
                if not chosen:
                    break
                rows_of = dict(expanding)
                logits, block = self._rows(
                    state, block, [tokens[i] for i in chosen], position, [rows_of[parents[i]] for i in chosen]
                )
                first_row = len(block.paths) - len(chosen)
                expanding = [(i, first_row + j) for j, i in enumerate(chosen)]
        kept = prune(parents, accept, ctx.verify_seconds, ctx.budget)
        index = {node: i for i, node in enumerate(kept)}
        return DraftTree(
            tuple(tokens[i] for i in kept),
            tuple(index[parents[i]] if parents[i] >= 0 else -1 for i in kept),
            features=tuple(features[i] for i in kept),
        )


def _load_edd(target: TargetModel, path: Path) -> EddNetwork:
    info = target.info

    def build(ckpt: DrafterCheckpoint) -> EddNet:
        cfg = EddConfig.from_json(ckpt.config)
        net = EddNet(cfg)
        weights = dict(ckpt.weights)
        if cfg.shared_head and int(ckpt.d2t.max()) < info.vocab_size:  # the target's own rows
            weights["head.weight"] = target_head_rows(target.model, ckpt.d2t)
        net.load_state_dict(weights)
        return net

    net, ckpt = load_drafter(path, "edd", info.weights_id or info.fingerprint, build)
    cfg = net.cfg
    if (
        int(ckpt.d2t.max()) >= info.vocab_size
        or ckpt.d2t.numel() != cfg.draft_vocab
        or cfg.head_dim != info.head_dim
        or cfg.hidden_size != info.hidden_size
        or not 0 <= cfg.prompt_layer <= info.num_layers
    ):
        raise ModeUnavailableError(
            f"{path}: the drafter does not fit this model's vocabulary, layers or heads"
        )
    return EddNetwork.build(target, net, ckpt.d2t, ckpt.meta)


def load_edd(target: TargetModel, directory: Path | None, shared: SharedNetworks | None = None) -> EddNetwork:
    """The ``edd`` checkpoint for ``target`` (``--drafters-dir`` first, then the shipped one) as a
    network drafters share; through ``shared``, loaded once for all the worker's drafters."""
    weights_id = target.info.weights_id or target.info.fingerprint
    try:
        path = locate_drafter(CHECKPOINT, "edd", weights_id, directory)
        if shared is None:
            return _load_edd(target, path)
        return shared.get(target, path, lambda: _load_edd(target, path))
    except CheckpointError as exc:
        raise ModeUnavailableError(str(exc)) from None


def parse_options(options: dict[str, str], tree: bool) -> EddOptions:
    """A mode's options, checked (``UnknownModeError``) before any checkpoint is read."""
    depth = int_option(options, "depth", 8 if not tree else 6, 1, 64)
    min_reach = float_option(options, "min_reach", 0.05 if not tree else 0.02, 0.0, 1.0)
    if not tree:
        return EddOptions(depth=depth, min_reach=min_reach)
    topk = int_option(options, "topk", 4, 1, 16)
    width = int_option(options, "width", 4, 1, 64)
    return EddOptions(depth=depth, min_reach=min_reach, topk=topk, width=width)


def _make(target: TargetModel, options: dict[str, str], resources: DraftResources, tree: bool) -> Drafter:
    opts = parse_options(options, tree)
    return EddDrafter(load_edd(target, resources.drafters_dir, resources.networks), opts)


@DRAFTERS.register(
    "edd",
    "a one-layer draft decoder over the target's hidden states as a soft prompt (EDD), a chain",
    ("depth", "min_reach"),
)
def _make_edd(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return _make(target, options, resources, tree=False)


@DRAFTERS.register(
    "edd+pct",
    "EDD with a pruned candidate tree (PCT) by the draft's confidence and the cost curve",
    ("depth", "min_reach", "topk", "width"),
)
def _make_edd_pct(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return _make(target, options, resources, tree=True)
