"""``fuse``: one token tree from several drafters at once.

Each step every source drafter (``sources=pld.suffix.recycle``; by default every one of ``pld``,
``suffix``, ``rest``, ``dresd`` this worker can run; options of a source as ``SOURCE.OPTION``:
``fuse:sources=pld.rest:rest.ctx=0``) proposes with the step's budget,
and their trees are merged into one trie (``fuse_trees``: the same token path is one node). A
node's feature names who proposed it, so the planner learns each source's acceptance per depth
and confidence, as it does for a single drafter, and prunes the fused tree by expected gain on
the measured verify cost curve; a node several sources agree on gets a key of its own, so the
planner also learns what agreement is worth. Example: ``pld`` drafts [4, 2] (feature ``m3``),
``suffix`` drafts [4, 7] (``suffix:own:m4:p0.6:n2``) → tokens (4, 2, 7), parents (-1, 0, 0),
features (``pld&suffix:m3``, ``pld:m3``, ``suffix:own:m4:p0.6:n2``).

After verification each source also hears the verdict on its own tree (``verdict_on``: mapped by
token path) in its own per-request state, and the accepted tokens are counted per source
(``FuseState.accepted``, ``FuseDrafter.accepted``). The target's candidates and the finished
request reach every source, as if it ran alone.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain

import numpy as np
import torch

from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    ModeUnavailableError,
    RequestState,
    UnknownModeError,
)
from llm_worker.model.target import TargetModel
from llm_worker.types import (
    NO_SOURCE,
    ArtifactNeeds,
    DraftBatch,
    DraftTree,
    ForwardCandidates,
    Outcome,
    VerifyResult,
)
from specdraft.common import shorten

DEFAULT_SOURCES = ("pld", "suffix", "rest", "dresd")
"""Tried in this order when ``sources=`` is not given; those this worker cannot run (``rest``
without a datastore, ``dresd`` without a dense index) are left out. Learned drafters cost forwards,
so they join only when named, and so does ``recycle``: on 16 open-ended held-out prompts (2-core
EPYC) its wide trees took the fused mode from 1.01-1.04x ``ar`` to 0.67x
(docs/measurements/2026-11-27-fuse-and-ivf.md); with its context rows, 1.05x without it against
1.02x with it on the same kind of prompts (2-core Xeon,
docs/measurements/2026-11-27-recycle-context.md)."""


def fused_feature(by_source: Mapping[str, str]) -> str:
    """The planner's key of a node from the sources that proposed it and their own features:
    ``{"pld": "m3"}`` → ``"pld:m3"``; ``{"suffix": "suffix:own:m4:p0.6:n2", "pld": "m3"}`` →
    ``"pld&suffix:m3"`` (names sorted, then the first one's feature). A feature that already starts
    with its source's name keeps it once: ``{"suffix": "suffix:own:m4:p0.6:n2"}`` →
    ``"suffix:own:m4:p0.6:n2"``, not ``"suffix:suffix:own:..."``."""
    names = sorted(by_source)
    return f"{'&'.join(names)}:{by_source[names[0]].removeprefix(names[0] + ':')}"


def fuse_trees(trees: Mapping[str, DraftTree]) -> DraftTree:
    """``trees`` (by source name) merged into one trie: a node per distinct token path, in the
    order the paths first appear (sources in ``trees``' order, each in its node order, so parents
    come first). A node keeps the context position of the first source that cited one
    (``NO_SOURCE`` otherwise) and gets ``fused_feature`` of every source that proposed it.
    Example: see the module's docstring."""
    child: dict[tuple[int, int], int] = {}  # (fused parent, token) -> fused node
    tokens: list[int] = []
    parents: list[int] = []
    positions: list[int] = []
    proposers: list[dict[str, str]] = []  # [num_nodes] source -> its feature for the node
    for name, tree in trees.items():
        index: list[int] = []  # [len(tree)] the fused node of each of its nodes
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
            up = index[parent] if parent >= 0 else -1
            node = child.get((up, token))
            if node is None:
                node = child[(up, token)] = len(tokens)
                tokens.append(token)
                parents.append(up)
                positions.append(NO_SOURCE)
                proposers.append({})
            proposers[node].setdefault(name, tree.feature(i))
            if positions[node] == NO_SOURCE:
                positions[node] = tree.source(i)
            index.append(node)
    return DraftTree(tuple(tokens), tuple(parents), tuple(positions), tuple(map(fused_feature, proposers)))


def verdict_on(tree: DraftTree, accepted: Sequence[int], bonus: int) -> VerifyResult:
    """What verification says of ``tree`` (a source's own proposal) given the tokens the target
    accepted on the fused tree, ``accepted`` [n], and its ``bonus``: the verifier's rule
    (``llm_worker.verify.verifier.verify_tokens``) with the target's token known at depths
    1 .. n + 1 along that path. A node hanging off the root or off an accepted node is ACCEPTED
    if it carries the target's token at a depth ≤ n, REJECTED if it carries another token; every
    other node is UNREACHED, and so is a node carrying the bonus token itself: the planner did not
    verify it (it would have been accepted otherwise), and what the target says after it is not
    known. The source's bonus is the target's token after its own accepted path.

    Example: tree [5, 6, 7] + [5, 8] (tokens (5, 6, 7, 8), parents (-1, 0, 1, 0)), accepted
    [5, 8], bonus 9 → outcomes (ACCEPTED, REJECTED, UNREACHED, ACCEPTED), accepted nodes (0, 3),
    bonus 9.
    """
    said = [*accepted, bonus]  # the target's token at depth 1 .. n + 1 along the accepted path
    depths = tree.depths()
    on_path = [False] * len(tree)
    outcomes: list[Outcome] = []
    path: list[int] = []
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        if parent >= 0 and not on_path[parent]:
            outcomes.append(Outcome.UNREACHED)
        elif token != said[depths[node] - 1]:
            outcomes.append(Outcome.REJECTED)
        elif depths[node] <= len(accepted):
            outcomes.append(Outcome.ACCEPTED)
            on_path[node] = True
            path.append(node)
        else:  # the bonus token: not verified as a draft
            outcomes.append(Outcome.UNREACHED)
    return VerifyResult(tuple(path), said[len(path)], tuple(outcomes))


class FuseState(DrafterState):
    """One request's state in ``fuse``: a ``RequestState`` per source (each keeps its own drafter
    state there; tenant and datastore pin shared with the request's), the source trees of the step
    in flight, and the accepted tokens per source."""

    def __init__(self, request: RequestState, names: Iterable[str]) -> None:
        self.states = {
            name: RequestState(datastore_version=request.datastore_version, tenant=request.tenant)
            for name in names
        }
        self.proposed: dict[str, DraftTree] = {}
        """This step's tree of each source (a batch as its trie), until the verdict comes."""
        self.accepted: Counter[str] = Counter()
        """Accepted draft tokens of this request that each source had proposed (a token several
        sources proposed counts for each): e.g. ``{"pld": 30, "suffix": 41, "recycle": 12}``."""


class FuseDrafter(Drafter):
    """Runs ``sources`` (created drafters, keyed by their ``name``) and fuses their trees."""

    def __init__(self, sources: Sequence[Drafter]) -> None:
        self.sources = {source.name: source for source in sources}
        self.needs = ArtifactNeeds.union(source.needs for source in sources)
        self.gated = any(source.gated for source in sources)
        self.candidates = max((source.candidates for source in sources), default=0)
        self.accepted: Counter[str] = Counter()
        """Accepted draft tokens each source had proposed, over every request this drafter served
        (``FuseState.accepted`` is one request's): for benchmarks, e.g.
        ``engine.runtime("fuse").drafter.accepted["suffix"]``."""

    def _state(self, request: RequestState) -> FuseState:
        if not isinstance(request.drafter, FuseState):
            request.drafter = FuseState(request, self.sources)
        return request.drafter

    def propose(self, ctx: DraftContext) -> DraftTree:
        request = ctx.request_state
        state = self._state(request)
        trees: dict[str, DraftTree] = {}
        for name, source in self.sources.items():
            own = state.states[name]
            own.datastore_version = request.datastore_version  # one pin for every source
            source_ctx = copy.copy(ctx)  # the same step, the source's own request state
            source_ctx.request_state = own
            draft = source.propose(source_ctx)
            if own.datastore_version and not request.datastore_version:
                request.datastore_version = own.datastore_version
            trees[name] = draft.trie().tree if isinstance(draft, DraftBatch) else draft
        state.proposed = trees
        return fuse_trees(trees)

    def observe(self, tree: DraftTree, result: VerifyResult, state: RequestState) -> None:
        fused = self._state(state)
        accepted = [tree.tokens[node] for node in result.accepted]
        for name, own_tree in fused.proposed.items():
            if not len(own_tree):
                continue
            verdict = verdict_on(own_tree, accepted, result.bonus)
            fused.accepted[name] += verdict.num_accepted
            self.accepted[name] += verdict.num_accepted
            self.sources[name].observe(own_tree, verdict, fused.states[name])
        fused.proposed = {}

    def observe_candidates(self, state: RequestState, rows: ForwardCandidates) -> None:
        fused = self._state(state)
        for name, source in self.sources.items():
            if source.candidates:
                source.observe_candidates(fused.states[name], rows.narrowed(source.candidates))

    def finish(self, state: RequestState, tokens: np.ndarray, prompt_length: int) -> None:
        fused = self._state(state)
        for name, source in self.sources.items():
            source.finish(fused.states[name], tokens, prompt_length)

    def release(self, state: RequestState) -> None:
        fused = self._state(state)
        for name, source in self.sources.items():
            source.release(fused.states[name])

    def tensors(self) -> Iterable[torch.Tensor]:
        return chain.from_iterable(source.tensors() for source in self.sources.values())


def source_modes(options: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    """The mode string each of ``names`` (sources) runs: its name with the fuse options
    ``SOURCE.OPTION`` given to it. Example: options ``{"sources": "pld.rest", "rest.ctx": "0"}``,
    names ``["pld", "rest"]`` → ``{"pld": "pld", "rest": "rest:ctx=0"}``. An option for a source
    not among ``names`` is an ``UnknownModeError``."""
    modes = {name: name for name in names}
    for key, value in sorted(options.items()):
        source, dot, option = key.partition(".")
        if not dot:
            continue
        if source not in modes:
            raise UnknownModeError(
                f"fuse option {shorten(key)!r}: {shorten(source)!r} is not a source here "
                f"(sources: {'.'.join(names)})"
            )
        modes[source] += f":{option}={value}"
    return modes


def create_sources(
    target: TargetModel, options: Mapping[str, str], resources: DraftResources
) -> list[Drafter]:
    """The drafters ``sources=`` names (dot-separated mode names, each with its defaults and the
    options ``SOURCE.OPTION`` give it: ``source_modes``), or, without ``sources=``, every one of
    ``DEFAULT_SOURCES`` this worker can run. A name that is no mode, or one that cannot be a source
    (``ar``, ``fuse``), or a bad source option, is an ``UnknownModeError``; a named source this
    worker cannot run, a ``ModeUnavailableError``."""
    named = options.get("sources")
    if named is None:
        sources = []
        for name, mode in source_modes(options, DEFAULT_SOURCES).items():
            try:
                sources.append(DRAFTERS.create(mode, target, resources))
            except ModeUnavailableError:
                continue
            except UnknownModeError as exc:
                raise UnknownModeError(f"fuse source {name!r}: {exc}") from None
        return sources
    names = named.split(".")
    if not all(names):
        raise UnknownModeError(f"fuse: sources={shorten(named)!r} names an empty source")
    if len(set(names)) < len(names):
        raise UnknownModeError(f"fuse: sources={shorten(named)!r} names a source twice")
    for name in names:
        if name in ("ar", "fuse"):
            raise UnknownModeError(f"fuse: {name!r} cannot be a source")
    sources = []
    for name, mode in source_modes(options, names).items():
        try:
            sources.append(DRAFTERS.create(mode, target, resources))
        except UnknownModeError as exc:
            raise UnknownModeError(f"fuse source {shorten(name)!r}: {exc}") from None
        except ModeUnavailableError as exc:
            raise ModeUnavailableError(f"fuse source {name!r}: {exc}") from None
    return sources


@DRAFTERS.register(
    "fuse",
    "one token tree from several drafters (sources=pld.suffix...; a source's options as "
    "SOURCE.OPTION, e.g. rest.ctx=0), pruned by each source's learned prior",
    ("sources",),
    source_options=True,
)
def _make_fuse(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return FuseDrafter(create_sources(target, options, resources))
