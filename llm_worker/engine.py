"""The decode loop: propose → one target forward → verify → commit.

One request at a time per ``SequenceState``; every mode, ``ar`` included, runs the same loop
(``ar``'s drafter proposes nothing, so each step verifies the root alone and yields the bonus
token). The engine never looks at a mode's name: it asks the registry for a drafter, the
planner for how much of its draft to verify, and ``llm_worker.verify.steps`` for how to verify
what kind of draft it got (a tree: one forward with a tree mask; a batch: D rows of one forward).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llm_worker.batching import BatchingConfig, BatchScheduler, BatchSession
from llm_worker.config import DEFAULT_MODE, EngineConfig, SamplingParams
from llm_worker.costs import CurveCheck, measure_curve_and_cache
from llm_worker.drafters import DRAFTERS, DraftContext, Drafter, DraftResources, RequestState, canonical_mode
from llm_worker.drafters.base import storage_bytes
from llm_worker.logits import MAX_LOGPROBS, token_logprob, top_k_rows
from llm_worker.model.artifacts import ARTIFACTS
from llm_worker.model.target import ForwardOutput, SequenceState, TargetModel
from llm_worker.penalties import Penalties
from llm_worker.planner import ALONE, BatchLoad, CostCurve, DraftBudget, DraftPlanner, load_or_measure_curve
from llm_worker.prefix_cache import PrefixCache, block_names
from llm_worker.results import GenerationResult, Provenance, TokenLogprob
from llm_worker.sampling import SamplingNoise
from llm_worker.speculation import Pricer, SpeculationPolicy
from llm_worker.stats import GenerationStats
from llm_worker.stopping import StopStrings
from llm_worker.types import (
    CANDIDATE_HISTORY,
    NO_SOURCE,
    ArtifactKey,
    ArtifactNeeds,
    Draft,
    DraftTree,
    ForwardCandidates,
)
from llm_worker.verify.steps import decider, verification_for

NO_BUDGET = DraftBudget(0, 0)
MAX_MODE_RUNTIMES = 64

log = logging.getLogger(__name__)


def _in_vocabulary(draft: Draft, vocab_size: int) -> bool:
    """Whether every drafted token id is one the model has: ids from a datastore or a cache are
    data, and one out of range would fail the forward (a device-side assert on CUDA)."""
    rows = (draft.tokens,) if isinstance(draft, DraftTree) else draft.rows
    return all(0 <= t < vocab_size for row in rows for t in row)


class InvalidRequestError(ValueError):
    """A request the engine refuses before doing any work."""


class GenerationCancelled(Exception):
    """The request's ``cancel`` event was set while its prompt was being prefilled."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    mode: str = DEFAULT_MODE
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_at_eos: bool = True
    draft_budget: int | None = None  # most draft tokens verified per step; None = the planner's choice
    cancel: threading.Event | None = field(default=None, compare=False)
    """Set by a server whose client went away: a prefill stops at its next chunk (a step cannot
    be interrupted; the prefill of a long prompt is many forwards in the first step)."""
    tenant: str = ""
    """The namespace of online drafting: a drafter that learns from what the service said
    drafts for this request from this tenant's text only (a server derives it from the caller's
    credential and the request, ``specdraft.security.tenant_namespace``)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop after generating any of these (included in the output), ``stop_at_eos`` or not."""
    stop: StopStrings | None = field(default=None, compare=False)
    """Stop strings and how to decode (built by a worker, which knows the tokenizer): the
    output stops at the token whose text completes one."""
    logprobs: int | None = None
    """None: no log-probabilities; k in 0..20: each generated token's, with its k likeliest
    alternatives (``llm_worker.logits.token_logprob``)."""


@dataclass(frozen=True)
class StepOutput:
    """Tokens one step committed, streamed as they come."""

    token_ids: list[int]


class _Artifacts:
    """The artifacts a drafter declared (``llm_worker.model.artifacts``): those the forwards
    record, kept here for committed positions, and the rest read from the target when asked."""

    def __init__(self, target: TargetModel, state: SequenceState, needs: ArtifactNeeds) -> None:
        self.target, self.state, self.needs = target, state, needs
        self.device = torch.device(target.info.device)  # where every buffer here lives
        self.length = 0
        self.recordings = ARTIFACTS.recordings(needs)
        self.buffers: dict[ArtifactKey[Any], torch.Tensor] = {}  # key -> [capacity, ...]
        self.last: dict[ArtifactKey[Any], torch.Tensor] = {}  # key -> [...] (kinds kept last)

    def record(self, out: ForwardOutput, rows: list[int]) -> None:
        if not self.recordings or not rows:
            return
        m = len(rows)
        consecutive = rows == list(range(rows[0], rows[0] + m))  # most steps: a slice, no gather
        index = None if consecutive else torch.tensor(rows, device=out.logits.device)
        for rec in self.recordings:
            if rec.keep_last:
                self.last[rec.key] = out.artifacts[rec.key][rows[-1]]
                continue
            found = out.artifacts[rec.key]
            values = found[rows[0] : rows[0] + m] if index is None else found.index_select(0, index)
            self._append(rec.key, values)
        self.length += m

    def stored(self) -> list[ArtifactKey[Any]]:
        """The keys kept for every committed position (what a prefix cache must carry)."""
        return [rec.key for rec in self.recordings if not rec.keep_last]

    def extend(self, recorded: Mapping[ArtifactKey[Any], torch.Tensor], m: int) -> None:
        """Append ``m`` positions recorded elsewhere (a prefix cache's copies): key → [m, ...]."""
        for key in self.stored():
            self._append(key, recorded[key].to(self.device))
        self.length += m

    def rows(self, start: int, stop: int) -> dict[ArtifactKey[Any], torch.Tensor]:
        """Copies of the kept keys' values at positions start .. stop - 1."""
        return {key: self.buffers[key][start:stop].clone() for key in self.stored()}

    def _append(self, key: ArtifactKey[Any], values: torch.Tensor) -> None:
        m = int(values.shape[0])
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < self.length + m:
            capacity = max(2 * self.length + m, 1024)
            grown = torch.empty(capacity, *values.shape[1:], dtype=values.dtype, device=self.device)
            if buf is not None:
                grown[: self.length] = buf[: self.length]
            buf = self.buffers[key] = grown
        buf[self.length : self.length + m] = values

    def recorded(self, key: ArtifactKey[Any]) -> torch.Tensor:
        last = self.last.get(key)
        return last if last is not None else self.buffers[key][: self.length]

    def read(self, key: ArtifactKey[Any]) -> Any:
        return ARTIFACTS.read(self, key)

    def draft_context(
        self,
        tokens: np.ndarray,
        budget: int,
        request_state: RequestState,
        price: Pricer,
        sampling: SamplingParams,
        noise: SamplingNoise,
    ) -> DraftContext:
        """What a drafter may read this step: the committed ``tokens`` ([T]), and the artifacts
        it declared (kept here, or read from the target)."""
        return DraftContext(
            tokens,
            budget,
            self.read,
            request_state=request_state,
            verify_seconds=price,
            sampling=sampling,
            noise=noise,
        )


class _Output:
    """The committed sequence of one request and what it has emitted.

    ``tokens[:length]`` is prompt + generated; its last token is the root of the next draft.
    """

    def __init__(self, req: GenerationRequest, eos_ids: tuple[int, ...]) -> None:
        self.max_new = req.max_new_tokens
        self.eos = set(eos_ids) if req.stop_at_eos else set()
        self.stop_ids = set(req.stop_token_ids)
        self.stop_watch = req.stop.watch() if req.stop is not None else None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.tokens = np.zeros(len(req.prompt_ids) + req.max_new_tokens + 1, dtype=np.int64)  # [capacity]
        self.tokens[: len(req.prompt_ids)] = req.prompt_ids
        self.length = len(req.prompt_ids)
        self.generated: list[int] = []
        self.provenance = Provenance()
        self.finish = ""  # "stop" (end of sequence, a stop token id or string) or "length" once finished

    @property
    def root(self) -> int:
        return int(self.tokens[self.length - 1])

    def context(self) -> np.ndarray:
        return self.tokens[: self.length]

    def emit(self, tokens: list[int], sources: list[int], drafter: str) -> list[int]:
        """Append tokens up to an end-of-sequence token, a stop (token id or string) or the
        length limit; return those kept. A stop inside an accepted draft cuts it there: the
        tokens after it are never emitted, as plain decoding would never have made them."""
        kept = []
        for token, source in zip(tokens, sources, strict=True):
            self.provenance.add(len(self.generated), source, drafter)
            self.generated.append(token)
            kept.append(token)
            self.tokens[self.length] = token
            self.length += 1
            if token in self.eos:
                self.finish = "stop"
                break
            if token in self.stop_ids:
                self.finish, self.stop_reason = "stop", token
                break
            matched = self.stop_watch(token) if self.stop_watch is not None else None
            if matched is not None:
                self.finish, self.stop_reason = "stop", matched
                break
            if len(self.generated) >= self.max_new:
                self.finish = "length"
                break
        return kept


class _ModeRuntime:
    """What the engine keeps per mode across requests: the drafter and its planners.

    Greedy and sampled requests accept drafts at different rates, so each learns its own.
    """

    def __init__(self, drafter: Drafter, greedy: DraftPlanner | None, sampled: DraftPlanner | None) -> None:
        self.drafter = drafter
        self.planners = {True: greedy, False: sampled}
        self.lock = threading.Lock()


class Engine:
    def __init__(
        self,
        target: TargetModel,
        config: EngineConfig | None = None,
        curve: CostCurve | None = None,
        resources: DraftResources | None = None,
        batching: BatchingConfig | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """``batching``: run every request's forwards through one scheduler thread, all active
        requests' new tokens in one forward (``llm_worker.batching``); None: each request runs
        its own forwards in the thread that asks for its steps. ``prefix_cache``: share another
        engine's over the same target; None: a new one as ``config`` sizes it."""
        self.target = target
        self.config = config or EngineConfig()
        self.resources = resources or DraftResources()
        self.scheduler = BatchScheduler(target, batching) if batching is not None else None
        self.dropped_drafts = 0
        """Drafts dropped because a token id lay outside the vocabulary (untrusted sources:
        shards, the Redis cache; exported as ``specdraft_drafts_dropped_untrusted``)."""
        self._curve = curve
        self._curve_check: CurveCheck | None = None
        """Checks a curve this engine loaded or measured itself against the forwards it times
        (``llm_worker.costs.CurveCheck``); None for a curve given by the caller, and under
        batching, where a forward's time is shared by the requests in it."""
        self._active = 0  # streams in progress: a forward is timed alone only when there is one
        # guards ``_active`` (reentrant: a stream abandoned mid-way may be finalized by the
        # garbage collector in a thread that holds it)
        self._active_lock = threading.RLock()
        self._modes: OrderedDict[str, _ModeRuntime] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        if prefix_cache is None and self.config.prefix_cache_bytes > 0:
            prefix_cache = PrefixCache(self.config.prefix_cache_bytes, self.config.prefix_block_tokens)
        self.prefix_cache = prefix_cache
        """KV of prompt prefixes reused across requests (``llm_worker.prefix_cache``); None: off.
        Used only where the target's forward is batch-invariant (``TargetModel.prefix_reuse``)."""

    # -- set-up -----------------------------------------------------------------------------

    @property
    def cost_curve(self) -> CostCurve:
        """The verify cost curve, measured (or read from the cache) on first use."""
        with self._lock:
            if self._curve is None:
                max_size = self.config.planner.max_draft_tokens + 1
                self._curve = load_or_measure_curve(self.target, self.config.cost, max_size)
                if self.scheduler is None:
                    target, cost = self.target, self.config.cost
                    self._curve_check = CurveCheck(
                        self._curve, lambda: measure_curve_and_cache(target, cost, max_size), deferred=True
                    )
            return self._curve

    def _check_curve(self, draft: Draft, context: int, seconds: float) -> None:
        """Show the curve check a step's forward (``draft``'s nodes and the root after
        ``context`` cached tokens, ``seconds``) if this request runs alone. A disagreement only
        marks a measurement as due: it runs before the next request starts with no other in
        flight (``_measure_if_due``), never inside a request's stream."""
        check = self._curve_check
        if check is not None and self._active == 1 and isinstance(draft, DraftTree):
            check.observe(1 + len(draft), context, seconds)

    def _measure_if_due(self) -> None:
        """Measure the cost curve again if the check asked for it (called with no stream in
        flight); every planner plans with the new curve from then on."""
        check = self._curve_check
        if check is None or not check.due or not check.measure_if_due():
            return
        with self._lock:
            self._curve = check.curve
            for rt in self._modes.values():
                for planner in rt.planners.values():
                    if planner is not None:
                        planner.curve = check.curve

    def runtime(self, mode: str) -> _ModeRuntime:
        """The drafter and planners of ``mode``, kept for the modes used last, at most
        ``MAX_MODE_RUNTIMES`` of them holding at most ``config.max_drafter_bytes`` together
        (``drafter_bytes``; the mode just asked for is always kept, and a request keeps its own
        even if it is dropped meanwhile): clients choose the mode strings, so the cache must not
        grow with every variant they send."""
        key = canonical_mode(mode)  # may raise UnknownModeError
        with self._lock:
            rt = self._modes.get(key)
            if rt is not None:
                self._modes.move_to_end(key)
                return rt
        # may raise UnknownModeError / ModeUnavailableError
        drafter = DRAFTERS.create(mode, self.target, self.resources)
        planners: list[DraftPlanner | None] = [None, None]
        if drafter.proposes:
            planners = [DraftPlanner(self.cost_curve, self.config.planner) for _ in range(2)]
        with self._lock:
            rt = self._modes.setdefault(key, _ModeRuntime(drafter, *planners))
            for planner in rt.planners.values():  # the curve may have been measured again meanwhile
                if planner is not None and self._curve is not None:
                    planner.curve = self._curve
            self._modes.move_to_end(key)
            while len(self._modes) > 1 and (
                len(self._modes) > MAX_MODE_RUNTIMES or self._drafter_bytes() > self.config.max_drafter_bytes
            ):
                self._modes.popitem(last=False)
            return rt

    @property
    def cached_modes(self) -> int:
        """How many modes' runtimes are kept now (at most ``MAX_MODE_RUNTIMES``)."""
        return len(self._modes)

    @property
    def drafter_bytes(self) -> int:
        """The memory the kept modes' drafters hold (``Drafter.tensors``): a network that several
        modes share counts once."""
        with self._lock:
            return self._drafter_bytes()

    def _drafter_bytes(self) -> int:
        return storage_bytes(t for rt in self._modes.values() for t in rt.drafter.tensors())

    def validate(self, req: GenerationRequest) -> None:
        """Refuse a request this engine cannot run (``InvalidRequestError``, with a precise
        message) before doing any work; ``stream`` calls it unless its caller did."""
        info = self.target.info
        if not req.prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in req.prompt_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
        if req.draft_budget is not None and req.draft_budget < 0:
            raise InvalidRequestError(f"draft_budget must be >= 0, got {req.draft_budget}")
        if req.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        bad = [t for t in req.stop_token_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})"
            )
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
        total = len(req.prompt_ids) + req.max_new_tokens
        if total > info.max_context:
            raise InvalidRequestError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"exceeds the model's context of {info.max_context} tokens"
            )
        try:
            req.sampling.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    # -- the loop ---------------------------------------------------------------------------

    def generate(self, req: GenerationRequest) -> GenerationResult:
        result = None
        for item in self.stream(req):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    def stream(
        self, req: GenerationRequest, validated: bool = False
    ) -> Iterator[StepOutput | GenerationResult]:
        """Yields a StepOutput per step, then the GenerationResult.

        ``validated``: the caller has passed ``req`` through ``validate`` already (a worker does,
        to refuse a bad request before its stream starts), so it is not checked twice.
        Each step runs under ``torch.inference_mode`` in the thread that asks for it (a server
        may resume the stream from different pool threads; inference mode is thread-local).
        """
        if not validated:
            self.validate(req)
        rt = self.runtime(req.mode)
        session = self.scheduler.session() if self.scheduler is not None else None
        steps = self._decode(req, rt, session)
        with self._active_lock:  # streams starting meanwhile wait for a measurement
            if self._active == 0:
                self._measure_if_due()
            self._active += 1
        try:
            while True:
                with torch.inference_mode(), session.step() if session else contextlib.nullcontext():
                    item = next(steps, None)
                if item is None:
                    return
                yield item
        finally:
            with self._active_lock:
                self._active -= 1
            steps.close()
            if session is not None:
                session.close()

    def close(self) -> None:
        """Stop the batch scheduler's thread (requests still waiting get an error)."""
        if self.scheduler is not None:
            self.scheduler.stop()

    def _prefill(
        self,
        target: TargetModel,
        state: SequenceState,
        artifacts: _Artifacts,
        prompt: torch.Tensor,
        needs: ArtifactNeeds,
        cancel: threading.Event | None = None,
    ) -> torch.Tensor:
        """Run the prompt (in chunks), commit it, and return the last row's logits: [vocab];
        ``GenerationCancelled`` before a chunk once ``cancel`` is set."""
        chunk = max(1, self.config.prefill_chunk)
        logits = None
        for lo in range(0, len(prompt), chunk):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled(f"cancelled after {lo} of {len(prompt)} prompt tokens")
            piece = prompt[lo : lo + chunk]
            out = target.forward(state, piece, None, needs, last_logits_only=True)
            rows = list(range(len(piece)))
            target.commit(state, rows)
            artifacts.record(out, rows)
            logits = out.logits[-1]
        assert logits is not None
        return logits

    @staticmethod
    def _reuse_prefix(
        cache: PrefixCache | None,
        target: TargetModel,
        state: SequenceState,
        artifacts: _Artifacts,
        req: GenerationRequest,
    ) -> int:
        """Copy the prompt's longest cached prefix into ``state``; the prompt tokens it covers."""
        if cache is None:
            return 0
        hit = cache.lookup(req.tenant, req.prompt_ids, artifacts.stored())
        if hit is None:
            return 0
        target.import_kv(state, hit.keys, hit.values)
        artifacts.extend(hit.recorded, hit.tokens)
        return hit.tokens

    @staticmethod
    def _store_prefix(
        cache: PrefixCache,
        target: TargetModel,
        state: SequenceState,
        artifacts: _Artifacts,
        req: GenerationRequest,
    ) -> None:
        """Offer the prefilled prompt's blocks to the cache (it copies those it lacks)."""

        def export(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, dict[Any, torch.Tensor]]:
            keys, values = target.export_kv(state, start, stop)
            return keys, values, artifacts.rows(start, stop)

        cache.insert(req.tenant, req.prompt_ids, export, artifacts.stored())

    def _propose(
        self,
        rt: _ModeRuntime,
        planner: DraftPlanner,
        ctx: DraftContext,
        confidence: float,
        budget: DraftBudget,
        load: BatchLoad,
    ) -> Draft:
        """The drafter's proposal, dropped if a token id lies outside the vocabulary, cut to what
        ``planner`` keeps after ``len(ctx.tokens)`` committed tokens: under the mode's lock (the
        drafter and its planners are shared by the mode's requests)."""
        drafter = rt.drafter
        with rt.lock:
            draft = drafter.propose(ctx)
            if len(draft) and not _in_vocabulary(draft, self.target.info.vocab_size):
                log.warning("%s drafted a token id outside the vocabulary: draft dropped", drafter.name)
                self.dropped_drafts += 1
                draft = DraftTree.empty()
            if len(draft):
                draft = verification_for(draft).plan(
                    planner, draft, len(ctx.tokens), confidence, budget, load
                )
        return draft

    @staticmethod
    def _observe_candidates(
        rt: _ModeRuntime,
        state: RequestState,
        history: np.ndarray,
        root: int,
        tree: DraftTree,
        logits: torch.Tensor,
    ) -> None:
        """Show the drafter the target's likeliest next tokens after the root and each node of
        ``tree`` (``logits``: [1 + len(tree), vocab], the verify forward's rows; ``history``: the
        committed tokens before the root)."""
        k = min(rt.drafter.candidates, logits.shape[-1])
        top = top_k_rows(logits[: 1 + len(tree)], k)  # [1 + len(tree), k]
        rows = ForwardCandidates.of_tree(history, root, tree, top)
        with rt.lock:
            rt.drafter.observe_candidates(state, rows)

    def _decode(
        self, req: GenerationRequest, rt: _ModeRuntime, session: BatchSession | None = None
    ) -> Generator[StepOutput | GenerationResult]:
        """One request's steps (``_steps``); however they end, the drafter releases what the
        request still holds (``Drafter.release``: e.g. a retrieval in flight)."""
        request_state = RequestState(tenant=req.tenant)
        try:
            yield from self._steps(req, rt, session, request_state)
        finally:
            rt.drafter.release(request_state)

    def _steps(
        self,
        req: GenerationRequest,
        rt: _ModeRuntime,
        session: BatchSession | None,
        request_state: RequestState,
    ) -> Generator[StepOutput | GenerationResult]:
        """One request's steps: propose → one target forward → verify → commit → observe."""
        target: TargetModel = session if session is not None else self.target
        drafter, planner = rt.drafter, rt.planners[req.sampling.greedy]
        needs, sampling = drafter.needs, req.sampling
        noise = SamplingNoise(sampling.seed, target.info.vocab_size)
        penalties = Penalties(sampling, req.prompt_ids) if sampling.penalized else None
        decide = decider(sampling, noise, penalties)
        logprobs: list[TokenLogprob] | None = None if req.logprobs is None else []
        stats = GenerationStats()
        began = time.perf_counter()

        state = target.start()
        artifacts = _Artifacts(target, state, needs)
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long, device=artifacts.device)
        cache = self.prefix_cache if target.prefix_reuse else None
        block = cache.block_tokens if cache is not None else self.config.prefix_block_tokens
        if target.prefix_reuse and block > 0:  # a batched forward reads a shared prefix once
            state.prefix_block = block
            names = block_names(req.tenant, req.prompt_ids, block, len(req.prompt_ids) // block)
            state.prefix_names = tuple(names)
        cached = self._reuse_prefix(cache, target, state, artifacts, req)
        logits = self._prefill(target, state, artifacts, prompt[cached:], needs, req.cancel)
        if cache is not None:
            self._store_prefix(cache, target, state, artifacts, req)
        stats.cached_prompt_tokens = cached
        first = decide(logits[None], DraftTree.empty(), len(req.prompt_ids)).bonus
        policy = SpeculationPolicy(planner, rt.lock, drafter.gated, root_logits=logits)
        stats.observe_prefill(time.perf_counter() - began)
        out = _Output(req, target.info.eos_token_ids)
        emitted = out.emit([first], [NO_SOURCE], drafter.name)
        if penalties is not None:
            penalties.commit(emitted)
        if logprobs is not None:
            logprobs.append(token_logprob(logits, first, req.logprobs or 0))
        yield StepOutput(emitted)

        while not out.finish:
            # propose
            t0 = time.perf_counter()
            draft: Draft = DraftTree.empty()
            remaining = req.max_new_tokens - len(out.generated)
            budget = planner.step_budget(remaining, req.draft_budget) if planner is not None else NO_BUDGET
            # the others in the forward, one snapshot a step (it takes the scheduler's lock)
            load = policy.load(session.load()) if session is not None else ALONE
            drafting = policy.before_step(load, budget.tree_nodes > 0, stats)
            price = policy.price(load, out.length) if drafting else None
            if planner is not None and price is not None:
                ctx = artifacts.draft_context(
                    out.context(), budget.tree_nodes, request_state, price, sampling, noise
                )
                draft = self._propose(rt, planner, ctx, policy.confidence, budget, load)
            t1 = time.perf_counter()
            if price is not None:
                policy.after_propose(load, len(draft), t1 - t0)
            # one target forward over the root and the draft, verify, commit (t2 - t1: the one
            # place the verify forward is timed)
            step = verification_for(draft).step(target, state, out.root, draft, needs, decide, out.length)
            artifacts.record(step.forward, step.rows)
            t2 = time.perf_counter()
            self._check_curve(draft, out.length, t2 - t1)

            # observe
            root, before = out.root, out.length - 1  # the root's position (emit appends after it)
            emitted = out.emit(step.tokens, step.sources, drafter.name)
            if penalties is not None:
                penalties.commit(emitted)
            if logprobs is not None:  # token i was decided by committed row i of the forward
                rows, top = step.forward.logits, req.logprobs or 0
                deciding = zip(step.rows, emitted, strict=False)  # emitted may stop short of the rows
                logprobs.extend(token_logprob(rows[r], t, top) for r, t in deciding)
            if session is not None:
                session.observe(len(step.tokens))
            if drafter.candidates and isinstance(step.decided, DraftTree):
                history = out.tokens[max(0, before - CANDIDATE_HISTORY) : before]  # emit wrote after these
                self._observe_candidates(rt, request_state, history, root, step.decided, step.forward.logits)
            t3 = time.perf_counter()  # the candidates' cost counts as drafting
            accepted = step.result.num_accepted
            stats.observe_step(len(draft), accepted, len(emitted), t1 - t0 + t3 - t2, t2 - t1)
            if len(step.decided):
                stats.observe_depths(max(step.decided.depths()), accepted)
            root_logits = step.forward.logits[step.rows[-1]]
            policy.after_step(price, len(draft), accepted, t1 - t0, t0, root_logits)
            if len(draft) and planner is not None:
                with rt.lock:
                    planner.observe(step.decided, step.result, policy.confidence)
                    drafter.observe(step.decided, step.result, request_state)
            yield StepOutput(emitted)

        if drafter.proposes:
            with rt.lock:
                drafter.finish(request_state, out.context(), len(req.prompt_ids))
        stats.seconds = time.perf_counter() - began
        version = request_state.datastore_version
        spans = out.provenance.spans
        yield GenerationResult(
            out.generated, req.mode, out.finish, stats, spans, version, out.stop_reason, logprobs
        )
