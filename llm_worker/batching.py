"""Continuous batching: every active request's next forward in one target forward.

One scheduler thread owns the model. Each request still runs its own decode loop (the engine's
``_decode``: draft, plan, verify, commit) in its own thread, but its target forwards go through
a ``BatchSession``, a ``TargetModel`` that hands the forward to the scheduler and waits. The
scheduler collects the forwards waiting, runs them as one ``TargetModel.forward_many`` (the
linear layers over every request's new rows at once, attention per request over its own cache),
and wakes each request with its own output. Requests join and leave between forwards without
waiting for each other; a prompt is prefilled in chunks (``EngineConfig.prefill_chunk``), so a
long prompt shares forwards with the others' decode steps instead of stalling them.

When to run: as soon as every request that is inside a decode step (``BatchSession.step``), or
left one less than ``max_wait_seconds`` ago (a server passing the step's tokens to its client),
has its forward waiting — the others are paused between steps (a stream whose client reads
slowly) or finished — or, at the latest, ``max_wait_seconds`` after the first forward began to
wait or the last forward ended, whichever is later (a request still drafting joins the next
forward). Counting from the end of the last forward matters: requests that sent theirs while it
ran would otherwise go at once, without those it just woke, and the users split into two
half-full forwards that alternate for ever. A forward takes at most ``max_rows`` rows (the first
forward waiting always goes, whatever its size); the rest wait for the next.

Lossless: the fast backend's forward is batch-invariant (``fast_llama``), so a request's logits
are bit-identical whatever else shares its forward. If a forward over several requests fails
(one request's input is bad), each request's forward is run alone, so only that request gets
the error. A fault of the scheduler's own fails the forwards it was running (or, if its loop
itself fails, every forward waiting and every later one) with an error: no request waits for
ever. Neither the scheduler nor an error it hands back keeps a request's KV state alive.

The load each request sees (``BatchLoad``: the rows and the tokens of the *other* requests in
the last forward) prices its drafts (``DraftPlanner.plan``): a draft node must pay for its share
of the bigger forward, so speculation shrinks, then stops, as batching fills the machine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_worker.model.artifacts import Tap
from llm_worker.model.target import ForwardCall, ForwardOutput, KVBuffers, SequenceState, TargetModel
from llm_worker.planner import ALONE, BatchLoad
from llm_worker.types import ArtifactNeeds
from llm_worker.verify.tree import TreeBuffers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchingConfig:
    max_rows: int = 512
    """Most rows of one forward (a prefill chunk and the others' decode rows together)."""
    max_wait_seconds: float = 0.005
    """Longest a waiting forward waits for requests still drafting."""


@dataclass(eq=False)  # compared by identity: its call holds tensors
class _Pending:
    session: BatchSession
    call: ForwardCall
    since: float
    done: threading.Event = field(default_factory=threading.Event)
    output: ForwardOutput | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class BatchRecord:
    """One forward the scheduler ran: how many requests and rows it carried."""

    requests: int
    rows: int


class BatchScheduler:
    """The thread that owns the model and runs every waiting request's forward as one."""

    def __init__(
        self,
        target: TargetModel,
        config: BatchingConfig | None = None,
        on_batch: Callable[[BatchRecord], None] | None = None,
    ) -> None:
        self.target = target
        self.config = config or BatchingConfig()
        self.on_batch = on_batch
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._sessions: set[BatchSession] = set()
        self._stopped = False
        self._free_since = 0.0  # when the last forward ended
        self.forwards = 0
        self.requests = 0  # request-forwards: Σ requests per forward
        self._thread = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
        self._thread.start()

    # -- sessions ---------------------------------------------------------------------------

    def session(self) -> BatchSession:
        """A request's view of the target; ``close`` it when the request ends."""
        session = BatchSession(self)
        with self._cond:
            self._sessions.add(session)
        return session

    def _leave(self, session: BatchSession) -> None:
        with self._cond:
            self._sessions.discard(session)
            self._cond.notify_all()

    def _set_in_step(self, session: BatchSession, value: bool) -> None:
        with self._cond:
            session.in_step = value
            if not value:
                session.step_ended = time.perf_counter()
            self._cond.notify_all()

    @property
    def active(self) -> int:
        """Requests that have joined and not left."""
        with self._cond:
            return len(self._sessions)

    @property
    def mean_batch_size(self) -> float:
        """Requests per forward since start-up."""
        return self.requests / self.forwards if self.forwards else 0.0

    def load_for(self, session: BatchSession) -> BatchLoad:
        """What else the request's next forward will probably carry: the rows and tokens of
        the last forward of every other request that is expected in it (inside a step, or just
        out of one) — a stream whose client reads slowly, or a request done but not yet closed,
        adds no load."""
        rows = tokens = 0.0
        with self._cond:
            now = time.perf_counter()
            for other in self._sessions:
                if other is not session and other.last_rows and self._expected(other, now):
                    rows += other.last_rows
                    tokens += other.last_tokens
        if not rows:
            return ALONE
        return BatchLoad(rows, tokens, session.forward_rows, session.forward_seconds)

    # -- forwards ---------------------------------------------------------------------------

    def submit(self, session: BatchSession, call: ForwardCall) -> ForwardOutput:
        """Run ``call`` in the next forward; blocks until its output is ready."""
        item = _Pending(session, call, time.perf_counter())
        with self._cond:
            if self._stopped:
                raise RuntimeError("the batch scheduler has stopped")
            self._pending.append(item)
            self._cond.notify_all()
        item.done.wait()
        error, item.error = item.error, None
        if error is not None:
            # the error's traceback holds the scheduler's frame, whose batch holds the item: drop
            # both references, or the cycle keeps the request's KV state until a full collection
            try:
                raise error
            finally:
                error = item = None  # type: ignore[assignment]
        assert item.output is not None
        return item.output

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _deadline(self) -> float:
        """When the next forward goes even if requests in a step have not sent theirs: the wait
        counts from the later of the first forward's arrival and the end of the last forward, so
        requests that sent theirs while the last forward ran wait for those it just woke."""
        return max(self._pending[0].since, self._free_since) + self.config.max_wait_seconds

    def _expected(self, session: BatchSession, now: float) -> bool:
        """Whether a forward of ``session`` is likely soon: it is inside a step, or it left one
        within ``max_wait_seconds`` (a server passing the step's tokens to its client)."""
        return session.in_step or now - session.step_ended < self.config.max_wait_seconds

    def _ready(self, now: float) -> bool:
        if not self._pending:
            return False
        waiting = {p.session for p in self._pending}
        if all(s in waiting for s in self._sessions if self._expected(s, now)):
            return True
        return now >= self._deadline()

    def _take(self) -> list[_Pending]:
        """The forwards of the next batch: first come first, within ``max_rows``."""
        taken: list[_Pending] = []
        rows = 0
        for item in self._pending:
            n = int(item.call.tokens.shape[0])
            if taken and rows + n > self.config.max_rows:
                continue
            taken.append(item)
            rows += n
        self._pending = [p for p in self._pending if p not in taken]
        return taken

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopped and not self._ready(time.perf_counter()):
                        if self._pending:
                            left = self._deadline() - time.perf_counter()
                            self._cond.wait(timeout=max(left, 1e-4))
                        else:
                            self._cond.wait()
                    if self._stopped:
                        return
                    batch = self._take()
                try:
                    self._run(batch)
                except BaseException as exc:  # the scheduler's own fault: these fail, it goes on
                    for item in batch:
                        if not item.done.is_set():
                            item.error = RuntimeError(f"the batch scheduler failed this forward: {exc!r}")
                            item.done.set()
                    if not isinstance(exc, Exception):
                        raise
                    log.exception("the batch scheduler failed a forward of %d requests", len(batch))
                finally:
                    batch = []  # not held while the scheduler waits: the requests' states may go
        except Exception:
            log.exception("the batch scheduler stopped on an error; its requests fail from now on")
        finally:  # stopped, or the thread itself fails: nobody waits for ever, and new forwards are refused
            with self._cond:
                self._stopped = True
                for item in self._pending:
                    item.error = RuntimeError("the batch scheduler has stopped")
                    item.done.set()
                self._pending = []

    def _run(self, batch: list[_Pending]) -> None:
        rows = sum(int(p.call.tokens.shape[0]) for p in batch)
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                outputs = self.target.forward_many([p.call for p in batch])
        except Exception as exc:  # one request's bad input must not fail the others: run each alone
            if len(batch) == 1:
                batch[0].error = exc
                batch[0].done.set()
                return
            log.info("a forward over %d requests failed (%s); running each alone", len(batch), exc)
            for item in batch:
                self._run([item])
            return
        self.forwards += 1
        self.requests += len(batch)
        if self.on_batch is not None:
            try:
                self.on_batch(BatchRecord(len(batch), rows))
            except Exception:  # metrics must not fail the requests
                log.exception("the batch scheduler's on_batch callback failed")
        self._free_since = time.perf_counter()
        seconds = self._free_since - began
        for item, out in zip(batch, outputs, strict=True):
            session = item.session
            session.last_rows = int(item.call.tokens.shape[0])
            session.forward_rows, session.forward_seconds = (rows, seconds) if len(batch) > 1 else (0, 0.0)
            item.output = out
            item.done.set()


class BatchSession(TargetModel):
    """One request's target: forwards go through the scheduler, everything else (the KV state,
    commits, the cache views drafters read) is the target's own."""

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.scheduler = scheduler
        self.inner = scheduler.target
        self.info = self.inner.info
        self.model = self.inner.model
        self.in_step = False
        self.step_ended = -math.inf  # when it last left a step
        self.last_rows = 0  # rows of its last forward
        self.last_tokens = 0.0  # tokens its last step committed
        self.forward_rows = 0  # rows of the last forward it shared with other requests (0: alone)
        self.forward_seconds = 0.0  # and how long that forward took

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Marks a decode step in progress: the scheduler waits (briefly) for its forward."""
        self.scheduler._set_in_step(self, True)
        try:
            yield
        finally:
            self.scheduler._set_in_step(self, False)

    def observe(self, tokens: int) -> None:
        """Tokens the request's last step committed (its share of the batch's output)."""
        self.last_tokens = float(tokens)

    def load(self) -> BatchLoad:
        return self.scheduler.load_for(self)

    def close(self) -> None:
        self.scheduler._leave(self)

    def start(self) -> SequenceState:
        return self.inner.start()

    def forward(
        self,
        state: SequenceState,
        tokens: torch.Tensor,
        tree: TreeBuffers | None,
        needs: ArtifactNeeds,
        last_logits_only: bool = False,
    ) -> ForwardOutput:
        return self.scheduler.submit(self, ForwardCall(state, tokens, tree, needs, last_logits_only))

    def forward_many(self, calls: Sequence[ForwardCall]) -> list[ForwardOutput]:
        return [self.scheduler.submit(self, call) for call in calls]

    def commit(self, state: SequenceState, rows: Sequence[int]) -> None:
        self.inner.commit(state, rows)

    def branching_rows_limit(self, state: SequenceState) -> int | None:
        return self.inner.branching_rows_limit(state)

    def kv(self, state: SequenceState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.kv(state, layer)

    def kv_buffers(self, state: SequenceState, layer: int) -> KVBuffers | None:
        return self.inner.kv_buffers(state, layer)

    @property
    def prefix_reuse(self) -> bool:
        return self.inner.prefix_reuse

    def export_kv(self, state: SequenceState, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.export_kv(state, start, stop)

    def import_kv(self, state: SequenceState, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.inner.import_kv(state, keys, values)

    @property
    def taps(self) -> frozenset[Tap]:
        return self.inner.taps

    @property
    def supports_queries(self) -> bool:
        return self.inner.supports_queries

    @property
    def kernel_variant(self) -> str:
        return self.inner.kernel_variant

    def weight_bytes(self) -> int | None:
        return self.inner.weight_bytes()

    def kernel_info(self) -> dict[str, Any]:
        return self.inner.kernel_info()

    def kv_cache_usage(self) -> tuple[int, int] | None:
        return self.inner.kv_cache_usage()
