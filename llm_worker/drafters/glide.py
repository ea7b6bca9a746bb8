"""``glide``, ``glide+cape``: a learned draft network that glimpses the target's KV cache.

Each step the draft network (``glide_net``) first catches up on the committed tokens it has not
seen (one forward; its own KV cache for committed positions is kept per request), then drafts a
chain from the root, one token per forward, reading the target's *live* cache of one layer (no
copy; it ends before the root, as in training's block mask). The chain stops at the step budget,
at ``depth`` tokens, when the product of the draft's top-1 probabilities along it (its reach) falls
below ``min_reach``, or when another token would not pay for itself: its reach times the seconds a
step of the root alone takes, against the draft forward's measured seconds plus what the token
adds to the verify forward (the planner's cost curve, under the batch's load).

Greedy requests draft the draft's argmax. Sampled requests sample each chain token from the
draft's distribution q (the request's temperature / top-k / top-p over the draft vocabulary) with
the request's noise for that position (``llm_worker.sampling``): the target's own sample at that
position runs the same race over p, so the draft is right whenever both races have the same
winner — and the output stays exactly plain sampling's.

CAPE (``glide+cape``): at each depth the next-best draft tokens join as siblings of the chain
token — how many by the draft's top-1 confidence (``cape``: the extra siblings for confidence in
(0, .3], (.3, .6], (.6, .8], (.8, 1]; by default the checkpoint's table, derived from held-out
acceptance by ``specdraft train cape`` (``llm_worker.training.cape``), else the paper's 7/5/3/1)
— and the tree is verified in one forward.
Verification matches every node against the target's token, so siblings need no special rule.

Every node carries a feature (the draft's probability of it, bucketed) so the planner calibrates
acceptance by the draft's own confidence and keeps only the nodes that pay for their verify cost.

A mode's options are checked before its checkpoint is read; the network, its fused copy and its
RoPE tables (``GlideNetwork``) are loaded once per worker and shared by every spelling of the
mode (``checkpoint.SharedNetworks``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    ModeUnavailableError,
    UnknownModeError,
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
from llm_worker.drafters.glide_fused import DraftKV, DraftNetwork, FusedGlide
from llm_worker.drafters.glide_net import GlideConfig, GlideNet, cross_allowed
from llm_worker.model.target import TargetModel
from llm_worker.sampling import warp_logits
from llm_worker.types import ArtifactNeeds, DraftTree, causal_mask
from specdraft.common import shorten

CAPE_BOUNDS = (0.3, 0.6, 0.8, 1.0)
DEFAULT_CAPE = (7, 5, 3, 1)
FEATURE_BOUNDS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_WINDOW = 64


MAX_SIBLINGS = 16  # the most extra siblings a CAPE table may give a depth


def cape_band(confidence: float) -> int:
    """The index of the CAPE band holding a top-1 draft probability: ``cape_band(0.5)`` → 1."""
    for i, bound in enumerate(CAPE_BOUNDS):
        if confidence <= bound:
            return i
    return len(CAPE_BOUNDS) - 1


def cape_siblings(confidence: float, table: tuple[int, ...]) -> int:
    """Extra siblings at a depth whose top-1 draft probability is ``confidence``:
    ``cape_siblings(0.5, (7, 5, 3, 1))`` → 5."""
    return table[cape_band(confidence)]


def valid_cape(table: Sequence[object]) -> bool:
    """Whether ``table`` is a CAPE table: a count in [0, ``MAX_SIBLINGS``] per band."""
    return len(table) == len(CAPE_BOUNDS) and all(
        isinstance(x, int) and 0 <= x <= MAX_SIBLINGS for x in table
    )


def parse_cape(raw: str | None, default: tuple[int, ...] = DEFAULT_CAPE) -> tuple[int, ...]:
    if raw is None:
        return default
    try:
        table = tuple(int(x) for x in raw.split("/"))
    except ValueError:
        raise UnknownModeError(f"cape={shorten(raw)!r}: four counts like 7/5/3/1") from None
    if not valid_cape(table):
        raise UnknownModeError(f"cape={shorten(raw)!r}: four counts in [0, {MAX_SIBLINGS}] like 7/5/3/1")
    return table


@dataclass(frozen=True)
class GlideOptions:
    """One mode string's drafting settings (``glide:depth=6:window=32``), checked."""

    vanilla: bool = False
    """The ablation without cross-attention (the ``glide-vanilla`` checkpoint)."""
    depth: int = 8
    """The most chain tokens."""
    min_reach: float = 0.05
    """The chain stops when the product of the draft's top-1 probabilities falls below it."""
    window: int = DEFAULT_WINDOW
    """The draft's own attention starts this many tokens before a new request's root (0: all)."""
    cape: tuple[int, ...] | None = None
    """``glide+cape``'s siblings per confidence band given in the mode string; None: the
    checkpoint's table, else ``DEFAULT_CAPE``."""


def parse_options(options: dict[str, str]) -> GlideOptions:
    """A mode's options, checked (``UnknownModeError``) before any checkpoint is read:
    ``parse_options({"depth": "6"})`` → ``GlideOptions(depth=6)``; ``{"min_reach": "nan"}`` is
    refused."""
    raw_cape = options.get("cape")
    return GlideOptions(
        vanilla=bool(int_option(options, "vanilla", 0, 0, 1)),
        depth=int_option(options, "depth", 8, 1, 64),
        min_reach=float_option(options, "min_reach", 0.05, 0.0, 1.0),
        window=int_option(options, "window", DEFAULT_WINDOW, 0, 1 << 20),
        cape=parse_cape(raw_cape) if raw_cape is not None else None,
    )


@dataclass(eq=False)
class GlideNetwork(DraftNetwork[GlideNet, FusedGlide]):
    """``DraftNetwork`` for ``glide`` and ``glide+cape``: one per checkpoint and target."""

    FUSED = FusedGlide


@dataclass
class _State(DrafterState):
    """The draft network's KV for committed positions 0 .. len(tokens) - 1 of one request."""

    tokens: np.ndarray  # [n] int64, the committed ids the draft KV covers
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer [1, kv, len(tokens), d]
    fused: DraftKV | None = None  # the same, when the network runs on the fused kernels


class GlideDrafter(Drafter):
    gated = True  # a catch-up forward and a forward per chain token before the planner decides

    def __init__(
        self,
        network: GlideNetwork,
        depth: int,
        min_reach: float,
        cape: tuple[int, ...] | None,
        window: int = 0,
    ) -> None:
        self.network = network  # shared with the other glide drafters of the checkpoint
        self.target = network.target
        self.net = network.net
        self.cfg: GlideConfig = network.net.cfg
        self.d2t = network.d2t  # [V] target id of each draft id
        self.depth, self.min_reach, self.cape = depth, min_reach, cape
        self.window = window  # 0: the draft's own attention covers the whole context
        self.embed = self.target.model.get_input_embeddings()
        self.cos, self.sin = network.cos, network.sin
        self.needs = ArtifactNeeds(kv_layers=frozenset({self.cfg.target_layer}))
        self.token_seconds: float | None = None  # one chain token's draft forward, measured (EMA)
        self._to_draft: dict[int, int] | None = None  # target id -> draft id (``depth_ranks``)
        self.fast = network.fast  # None: the network runs in torch

    def tensors(self) -> Iterable[torch.Tensor]:
        return self.network.tensors()

    def _forward(
        self,
        tokens: list[int],
        start: int,
        cached: int,
        state: _State,
        ctx: DraftContext,
    ) -> torch.Tensor:
        """Rows ``tokens`` at positions start.. after the draft's own KV (``start`` entries); the
        target's cache holds ``cached`` positions. Returns the last row's draft logits [V] and
        extends the draft's KV."""
        n = len(tokens)
        positions = torch.arange(start, start + n)
        buffers = ctx.kv_buffers(self.cfg.target_layer) if self.fast is not None else None
        fusable = buffers is not None and buffers.keys.dtype in (torch.float32, torch.bfloat16)
        if self.fast is not None and fusable:
            if state.fused is None:
                state.fused = self.fast.new_kv()
            if state.fused.length == 0 and self.window and n > self.window:
                # a fresh request: the draft's own attention starts a window before the root (the
                # target's cache, which the cross-attention reads whole, holds the rest)
                state.fused.offset = start + n - self.window
                tokens, n = tokens[-self.window :], self.window
                positions = positions[-self.window :]
            assert state.fused.offset + state.fused.length == int(positions[0])
            x = self.embed(torch.tensor(tokens)).float()  # [n, hidden]
            if not self.cfg.cross_attention:
                return self.fast.forward(x, state.fused, None, None)
            return self.fast.forward(x, state.fused, buffers, positions.clamp(max=cached).clamp(min=1))
        target_kv = ctx.kv(self.cfg.target_layer)
        device = self.cos.device  # the target's
        positions = positions.to(device)
        x = self.embed(torch.tensor(tokens, device=device)).float()[None]  # [1, n, hidden]
        allowed = causal_mask(n, start + n, start)[None, None].to(device)
        cross = cross_allowed(positions[None], cached, positions.clamp(max=cached)[None])
        keys, values = target_kv
        logits, state.kv = self.net(
            x,
            self.cos[positions][None],
            self.sin[positions][None],
            allowed,
            (keys[None], values[None]) if self.cfg.cross_attention else None,
            cross if self.cfg.cross_attention else None,
            past=state.kv,
        )
        return logits[0, -1]

    def _another_pays(self, reach: float, drafted: int, ctx: DraftContext) -> bool:
        """Whether one more chain token is worth its draft forward: the tokens it may add (at most
        ``reach``, the chance the chain survives so far, each saving a step of the root alone)
        against the draft forward's measured seconds and what the token adds to the verify."""
        if ctx.verify_seconds is None or self.token_seconds is None:
            return True
        step = ctx.verify_seconds(0)
        more = ctx.verify_seconds(drafted + 1) - ctx.verify_seconds(drafted)
        return reach * step > self.token_seconds + more

    def _truncate(self, state: _State, length: int) -> None:
        state.tokens = state.tokens[:length]
        if state.fused is not None:
            if length < state.fused.offset:  # before the window: start afresh
                state.fused.offset, state.fused.length = 0, 0
            state.fused.length = min(state.fused.length, length - state.fused.offset)
        if state.kv is not None:
            state.kv = [(k[:, :, :length], v[:, :, :length]) for k, v in state.kv]
            if length == 0:
                state.kv = None

    def _catch_up(self, ctx: DraftContext) -> tuple[_State, torch.Tensor]:
        """The draft's KV extended over the committed tokens it has not seen (kept where they
        still match); returns the request's draft state and the root row's draft logits [V]."""
        tokens = np.array(ctx.tokens, dtype=np.int64)  # a copy: the engine's buffer moves on
        cached = len(tokens) - 1  # the target's cache ends before the root
        state = ctx.request_state.drafter
        if not isinstance(state, _State):
            state = ctx.request_state.drafter = _State(np.empty(0, dtype=np.int64), None)
        keep = shared_prefix(state.tokens, tokens[:cached])
        self._truncate(state, keep)
        logits = self._forward(tokens[keep:].tolist(), keep, cached, state, ctx)
        state.tokens = tokens
        return state, logits

    def depth_ranks(
        self, ctx: DraftContext, truth: Sequence[int], ranks: int = 16
    ) -> list[tuple[float, int]]:
        """The chain teacher-forced along ``truth`` (the target's own next tokens after the root):
        per depth, the draft's top-1 probability and the rank of the true token among the draft's
        ``ranks`` most likely (1: its top-1; 0: not among them, or outside the draft vocabulary).
        Each depth reads the true token before it, as on a path whose every node so far was
        accepted: what CAPE's siblings would have hit (``llm_worker.training.cape``)."""
        total = len(ctx.tokens)
        if total < 2 or not truth:
            return []
        if self._to_draft is None:
            self._to_draft = {int(t): d for d, t in enumerate(self.d2t.tolist())}
        out: list[tuple[float, int]] = []
        with torch.inference_mode():
            state, logits = self._catch_up(ctx)
            for depth, token in enumerate(truth, start=1):
                probs = torch.softmax(logits.float(), dim=-1)
                top = torch.topk(probs, min(ranks, probs.numel()))
                ranked = top.indices.tolist()
                want = self._to_draft.get(int(token))
                out.append((float(top.values[0]), ranked.index(want) + 1 if want in ranked else 0))
                if depth < len(truth):
                    logits = self._forward([int(token)], total + depth - 1, total - 1, state, ctx)
            self._truncate(state, total)
        return out

    def propose(self, ctx: DraftContext) -> DraftTree:
        total = len(ctx.tokens)
        cached = total - 1  # the target's cache ends before the root
        if cached < 1 or ctx.budget < 1:
            return DraftTree.empty()
        sampled = not ctx.sampling.greedy
        nodes: list[int] = []
        parents: list[int] = []
        features: list[str] = []
        with torch.inference_mode():
            state, logits = self._catch_up(ctx)
            parent, reach = -1, 1.0
            limit = min(self.depth, ctx.budget)
            for depth in range(1, limit + 1):
                probs = torch.softmax(logits.float(), dim=-1)  # [V] the draft's own distribution
                top = float(probs.max())
                if sampled and ctx.noise is not None:
                    q = warp_logits(logits[None], ctx.sampling)[0]  # [V]
                    choice = ctx.noise.choose(q, total + depth - 1, ids=self.d2t)
                else:
                    choice = int(probs.argmax())
                chain_node = len(nodes)
                nodes.append(int(self.d2t[choice]))
                parents.append(parent)
                features.append(f"g{bucket(float(probs[choice]), FEATURE_BOUNDS)}")
                if self.cape is not None:
                    extra = min(cape_siblings(top, self.cape), ctx.budget - len(nodes))
                    ranked = torch.topk(probs, min(extra + 1, probs.numel())).indices.tolist()
                    for alt in [r for r in ranked if r != choice][:extra]:
                        nodes.append(int(self.d2t[alt]))
                        parents.append(parent)
                        features.append(f"g{bucket(float(probs[alt]), FEATURE_BOUNDS)}")
                reach *= top
                if depth == limit or reach < self.min_reach or len(nodes) >= ctx.budget:
                    break
                if not self._another_pays(reach, len(nodes), ctx):
                    break
                parent = chain_node
                began = time.perf_counter()
                logits = self._forward([int(self.d2t[choice])], total + depth - 1, cached, state, ctx)
                seconds = time.perf_counter() - began
                self.token_seconds = (
                    seconds if self.token_seconds is None else 0.9 * self.token_seconds + 0.1 * seconds
                )
            self._truncate(state, total)
        return DraftTree(tuple(nodes), tuple(parents), features=tuple(features))


def checkpoint_cape(meta: dict[str, Any]) -> tuple[int, ...] | None:
    """The CAPE table a checkpoint carries (``specdraft train cape``: derived from held-out
    acceptance), or None."""
    raw = (meta.get("cape") or {}).get("table")
    return tuple(raw) if isinstance(raw, list) and valid_cape(raw) else None


def _load_glide(target: TargetModel, path: Path) -> GlideNetwork:
    def build(ckpt: DrafterCheckpoint) -> GlideNet:
        net = GlideNet(GlideConfig.from_json(ckpt.config))
        net.load_state_dict(ckpt.weights)
        return net

    net, ckpt = load_drafter(path, "glide", target.info.weights_id or target.info.fingerprint, build)
    cfg = net.cfg
    if (
        int(ckpt.d2t.max()) >= target.info.vocab_size
        or ckpt.d2t.numel() != cfg.draft_vocab
        or cfg.head_dim != target.info.head_dim
    ):
        raise ModeUnavailableError(f"{path}: the drafter does not fit this model's vocabulary or heads")
    if target.info.num_layers <= cfg.target_layer:
        raise ModeUnavailableError(f"{path}: the drafter reads a layer this model does not have")
    return GlideNetwork.build(target, net, ckpt.d2t, ckpt.meta)


def load_glide(
    target: TargetModel, name: str, directory: Path | None, shared: SharedNetworks | None = None
) -> GlideNetwork:
    """The checkpoint ``name`` for ``target`` (``--drafters-dir`` first, then the shipped one) as
    a network drafters share; through ``shared``, loaded once for all the worker's drafters."""
    weights_id = target.info.weights_id or target.info.fingerprint
    try:
        path = locate_drafter(name, "glide", weights_id, directory)
        if shared is None:
            return _load_glide(target, path)
        return shared.get(target, path, lambda: _load_glide(target, path))
    except CheckpointError as exc:
        raise ModeUnavailableError(str(exc)) from None


def _make(target: TargetModel, options: dict[str, str], resources: DraftResources, cape: bool) -> Drafter:
    opts = parse_options(options)
    if target.info.backend not in ("fast", "hf"):
        raise ModeUnavailableError("glide needs a backend that exposes its KV cache")
    name = "glide-vanilla" if opts.vanilla else "glide"
    network = load_glide(target, name, resources.drafters_dir, resources.networks)
    table = (opts.cape or checkpoint_cape(network.meta) or DEFAULT_CAPE) if cape else None
    return GlideDrafter(network, opts.depth, opts.min_reach, table, opts.window)


@DRAFTERS.register(
    "glide",
    "a learned draft network reading the target's KV cache (GLIDE)",
    ("vanilla", "depth", "min_reach", "window"),
)
def _make_glide(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return _make(target, options, resources, cape=False)


@DRAFTERS.register(
    "glide+cape",
    "GLIDE with confidence-aware sibling candidates (CAPE), verified as a tree",
    ("vanilla", "depth", "min_reach", "cape", "window"),
)
def _make_glide_cape(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return _make(target, options, resources, cape=True)
