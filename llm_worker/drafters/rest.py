"""``rest`` / ``rest-batch``: drafts retrieved from a datastore (REST).

The datastore (in process, or shards over gRPC) matches the longest suffix of the context in its
corpus and returns the most frequent continuations with the count of every prefix. By default
(``ctx=1``) the context's own continuations are fused in (``fuse_context``: a prompt lookup with
REST's trie, weighing as much as the corpus sample) — also what drafts when the datastore does
not answer; ``ctx=0`` is REST alone. ``rest``
merges them into a draft tree, verified in one forward with a tree mask; ``rest-batch`` keeps
them as the rows of a batch (each candidate the full path from the root), verified as the rows
of one batched forward (DReSD's batch verification). Nodes carry an acceptance feature (match
length × frequency share), so the planner learns how often each kind of node is accepted and
trims the draft to what pays on this machine.

A request is pinned to the datastore version that answered its first retrieval (a swap during
the request does not mix versions); a datastore that fails or is slow costs drafts, never the
generation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from datastore_svc.protocols import PendingAnswer, PrefetchingRetriever, SparseAnswer, SparseRetriever
from datastore_svc.retrieval import (
    MAX_READ_TOKENS,
    NO_MATCH,
    Candidate,
    Retrieval,
    RetrievalConfig,
    context_retrieval,
    fuse_context,
    well_formed,
)
from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DrafterState,
    DraftResources,
    ModeUnavailableError,
    RequestState,
    UnknownModeError,
    affordable_nodes,
    bucket,
    int_option,
)
from llm_worker.model.target import TargetModel
from llm_worker.types import Draft, DraftBatch, DraftTree

log = logging.getLogger(__name__)


def rest_features(result: Retrieval) -> list[list[str]]:
    """Per candidate, per token: ``rest:c<match length>:p<share of occurrences>``."""
    total = max(result.sampled, 1)
    match = bucket(result.match_length, (1, 2, 4, 8))
    return [
        [f"rest:c{match}:p{bucket(n / total, (0.05, 0.15, 0.3, 0.6, 0.9))}" for n in cand.counts]
        for cand in result.candidates
    ]


def candidates_tree(result: Retrieval) -> DraftTree:
    """The candidates merged into one tree (shared prefixes once)."""
    if not result.candidates:
        return DraftTree.empty()
    return DraftTree.from_sequences([c.tokens for c in result.candidates], features=rest_features(result))


def candidates_batch(result: Retrieval) -> DraftBatch:
    """The candidates as batch rows, most frequent first (the datastore's order).

    Example: candidates [4, 2] (counts 3, 2) and [7] (count 1) → rows ((4, 2), (7,)).
    """
    cands = [c for c in result.candidates if c.tokens]
    if not cands:
        return DraftBatch.empty()
    features = [f for c, f in zip(result.candidates, rest_features(result), strict=True) if c.tokens]
    return DraftBatch(tuple(tuple(c.tokens) for c in cands), features=tuple(tuple(f) for f in features))


class RestDrafter(Drafter):
    """Retrieval, then ``shape`` turns the candidates into a draft: a tree (``rest``) or a batch
    of rows (``rest-batch``)."""

    def __init__(
        self,
        retriever: SparseRetriever,
        cfg: RetrievalConfig,
        shape: Callable[[Retrieval], Draft] = candidates_tree,
        fuse_separator: int | None = None,
        prefetch: bool | None = None,
        sized: bool = False,
    ) -> None:
        """``fuse_separator``: also draft from the context itself (``fuse_context``), indexing it
        with this separator (any id above the vocabulary); None = the datastore alone (REST).
        ``sized``: keep the tree to what a step can afford (``affordable_nodes``), at most
        ``cfg.max_nodes`` nodes and ``cfg.max_candidates`` candidates."""
        self.retriever = retriever
        self.cfg = cfg
        self.sized = sized
        self._shapes: dict[int, RetrievalConfig] = {}
        remote = retriever if isinstance(retriever, PrefetchingRetriever) else None
        if prefetch is None:  # not from shards on this host: they compute beside the forward
            prefetch = remote is not None and not remote.on_this_host
        self.prefetcher = remote if prefetch else None
        """Where retrieval is asked one step ahead (``_prefetched``): remote shards (by default
        those on other hosts: ``_prefetch``); an in-process store answers at once."""
        self._ahead = replace(
            cfg,
            max_length=max(
                min(2 * cfg.max_length + 1, 128, MAX_READ_TOKENS // cfg.max_occurrences), cfg.max_length
            ),
            max_nodes=min(4 * cfg.max_nodes, 1024),
            max_candidates=min(2 * cfg.max_candidates, 1024),
        )
        """What a prefetch asks for: room for the tokens the step commits (at most a draft's
        length and the bonus) before the draft's own, and wider, since those select a branch."""
        self.shape = shape
        self.fuse_separator = fuse_separator

    def shape_for(self, ctx: DraftContext) -> RetrievalConfig:
        """This step's retrieval shape: ``cfg``, or where ``sized``, its node and candidate caps
        cut to ``affordable_nodes`` under the step's verify prices."""
        if not self.sized or ctx.verify_seconds is None:
            return self.cfg
        nodes = affordable_nodes(ctx.verify_seconds, self.cfg.max_nodes)
        shape = self._shapes.get(nodes)
        if shape is None:
            candidates = min(self.cfg.max_candidates, max(1, nodes // 2))
            shape = self._shapes[nodes] = replace(self.cfg, max_nodes=nodes, max_candidates=candidates)
        return shape

    def retrieve(self, ctx: DraftContext) -> Retrieval | None:
        pinned = ctx.request_state.datastore_version
        cfg = self.shape_for(ctx)
        context = ctx.tokens[-cfg.c_max :]
        result: Retrieval | None = None
        try:
            if self.prefetcher is not None:
                answer = self._prefetched(self.prefetcher, ctx, context, pinned)
            else:
                answer = self.retriever.retrieve(context, cfg, pinned)
        except Exception as exc:  # a datastore problem costs drafts, never the generation
            log.warning("datastore retrieval failed, drafting from the context alone: %s", exc)
        else:
            result, version = answer
            if version and not pinned:
                ctx.request_state.datastore_version = version
            result = _without_malformed(result, cfg.max_length) if result is not None else None
        if self.fuse_separator is None:
            return result
        own = context_retrieval(ctx.tokens, self.fuse_separator, cfg)
        if result is None:
            return own
        return fuse_context(result, own, cfg.max_nodes, cfg.max_candidates)

    def _prefetched(
        self, prefetcher: PrefetchingRetriever, ctx: DraftContext, context: np.ndarray, pinned: str
    ) -> SparseAnswer:
        """This step's candidates from the retrieval sent at the request's last drafting step
        (none at its first), and the next step's retrieval sent now, to run during this step's
        verify forward.

        The retrieval sent at the last step asked for continuations of the context then, longer
        than a draft's by a draft and its bonus token (``_ahead``); the tokens committed since
        (accepted drafts and the bonus) select and shorten them (``continued``). Example: sent
        after [.. 7, 8], answered with [9, 4, 5, 6] and [9, 2]; 9 and 4 committed since →
        [5, 6]. Where no candidate follows the committed tokens, the shards, which answered in
        time, are asked again for this step. Shards that had not answered when taken are
        cancelled and not asked again: a slow shard costs candidates, never a wait.
        """
        state = ctx.request_state.drafter
        if not isinstance(state, _PrefetchState):
            state = _PrefetchState()
            ctx.request_state.drafter = state
        if state.pending is None:  # the request's first draft: from the context alone
            answer = SparseAnswer(NO_MATCH, pinned)
        else:
            taken = state.pending.take()
            committed = ctx.tokens[state.length :]
            answer = SparseAnswer(continued(taken.retrieval, committed, self.cfg.max_length), taken.version)
            if not answer.retrieval.candidates and state.pending.in_time:
                # the shards answer in time but not after these tokens: ask them again now
                answer = prefetcher.retrieve(context, self.cfg, answer.version or pinned)
        state.pending = prefetcher.prefetch(context, self._ahead, answer.version or pinned)
        state.length = len(ctx.tokens)
        return answer

    def release(self, state: RequestState) -> None:
        if isinstance(state.drafter, _PrefetchState) and state.drafter.pending is not None:
            state.drafter.pending.cancel()
            state.drafter.pending = None

    def propose(self, ctx: DraftContext) -> Draft:
        result = self.retrieve(ctx)
        return self.shape(result) if result is not None else DraftTree.empty()


class _PrefetchState(DrafterState):
    """One request's retrieval in flight (``RestDrafter._prefetched``)."""

    def __init__(self) -> None:
        self.pending: PendingAnswer | None = None
        self.length = 0
        """The context length the pending retrieval was sent after."""


def continued(result: Retrieval, committed: np.ndarray, max_length: int) -> Retrieval:
    """What ``result``, retrieved for a context, says after ``committed`` more tokens: the
    candidates that start with them, without them, cut to ``max_length``; prefix counts, match
    length and sampled occurrences follow.

    Example: candidates [9, 4, 5, 6] (counts 5, 3, 2, 2) and [9, 2] (5, 2), committed [9, 4],
    max_length 10 → one candidate [5, 6] (counts 2, 2) of 3 sampled occurrences, the match 2
    tokens longer.
    """
    k = len(committed)
    prefix = tuple(int(t) for t in committed)
    kept: dict[tuple[int, ...], Candidate] = {}
    sampled = result.sampled
    for cand in result.candidates:
        if len(cand.tokens) <= k or cand.tokens[:k] != prefix:
            continue
        if k:
            sampled = cand.counts[k - 1]
        tokens, counts = cand.tokens[k : k + max_length], cand.counts[k : k + max_length]
        old = kept.get(tokens)
        if old is None or old.counts < counts:
            kept[tokens] = Candidate(tokens, counts, cand.source)
    if not kept:
        return NO_MATCH
    occurrences = sampled if k else result.occurrences
    return Retrieval(tuple(kept.values()), result.match_length + k, occurrences, sampled)


def _without_malformed(result: Retrieval, max_length: int) -> Retrieval:
    """``result`` without the candidates no well-behaved datastore returns (``well_formed``)."""
    good = well_formed(result.candidates, max_length)
    if len(good) == len(result.candidates):
        return result
    log.warning("dropped %d malformed datastore candidates", len(result.candidates) - len(good))
    return replace(result, candidates=good)


def retrieval_config(options: dict[str, str]) -> RetrievalConfig:
    """The retrieval shape of a mode's options; each in its range, and N × L bounded
    (``MAX_READ_TOKENS``)."""
    try:
        return RetrievalConfig(
            c_min=int_option(options, "c_min", 1, 1, 64),
            c_max=int_option(options, "c_max", 16, 1, 64),
            max_occurrences=int_option(options, "n", 256, 1, 100_000),
            max_length=int_option(options, "l", 10, 1, 128),
            max_nodes=int_option(options, "nodes", 64, 1, 1024),
            max_candidates=int_option(options, "d", 32, 1, 1024),
        )
    except UnknownModeError:
        raise
    except ValueError as exc:
        raise UnknownModeError(f"rest options: {exc}") from None


REST_OPTIONS = ("c_min", "c_max", "n", "l", "nodes", "d", "ctx", "prefetch")


def _prefetch(options: dict[str, str]) -> bool | None:
    """``prefetch=1``: ask remote shards one step ahead; ``prefetch=0``: when drafting; by default
    (None) ahead unless every shard is on this host. Shards on loopback search on the cores the
    verify forward runs on, so asking ahead slows the forward more than it hides: on a 2-core EPYC
    with both shards on loopback, `rest` ran at 1.02× `ar` asking ahead against 1.30× when drafting
    (docs/measurements/2026-11-27-prefetch-and-gpu-prep.md)."""
    if "prefetch" not in options:
        return None
    return bool(int_option(options, "prefetch", 1, 0, 1))


def _fuse_separator(target: TargetModel, options: dict[str, str]) -> int | None:
    """``ctx=1`` (default): fuse the context's own continuations into the tree; ``ctx=0``: REST alone."""
    return target.info.vocab_size if int_option(options, "ctx", 1, 0, 1) else None


def _retriever(resources: DraftResources) -> SparseRetriever:
    if resources.datastore is None:
        raise ModeUnavailableError("needs a datastore (--datastore DIR or --datastore-addr HOST:PORT,...)")
    return resources.datastore


@DRAFTERS.register(
    "rest", "REST: continuations of the longest context suffix in a datastore, as a token tree", REST_OPTIONS
)
def _make_rest(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return RestDrafter(
        _retriever(resources),
        retrieval_config(options),
        fuse_separator=_fuse_separator(target, options),
        prefetch=_prefetch(options),
        sized="nodes" not in options,
    )


@DRAFTERS.register(
    "rest-batch",
    "REST drafts verified as a batch: the top-D continuations as the rows of one batched forward",
    REST_OPTIONS,
)
def _make_rest_batch(target: TargetModel, options: dict[str, str], resources: DraftResources) -> Drafter:
    return RestDrafter(
        _retriever(resources),
        retrieval_config(options),
        candidates_batch,
        _fuse_separator(target, options),
        _prefetch(options),
        sized="nodes" not in options,
    )
