"""Captured steps: the fast forward's decode and verify steps as CUDA graphs at a few row buckets.

On a GPU a step of the default model is some 300 kernel launches and the Python that issues them,
about 8.5 ms whatever its rows (1 to 64 cost the same on an H200), while its arithmetic and memory
traffic take well under a millisecond. A CUDA graph replays a recorded step's launches in one
call. ``StepGraphs`` records the forward (``Forward.layer_loop``, the same loop as an eager step)
once per bucket of rows (1, 2, 4, …, 64) over static buffers, and replays it for every forward
that fits:

- every call's cache is a slot of the pool (its buffers are the ones recorded; a request with
  caches of its own runs eagerly), and the forward has at most the largest bucket's rows;
- the step's token ids, positions and attention layout (``ops_triton.call_layout``) are written
  into one host buffer, copied to the device in one copy, then the graph replays;
- the rows past the forward's own, up to the bucket, are padding. Each writes its key and value
  into a slot of the pool reserved for them (the padding slot, at a position of its own) and
  attends to that key alone, so it never touches a request's cache or another row's numbers.
  The Triton kernels are row-invariant (each row's numbers are the same whatever the rows
  beside it), so a real row's logits, states and cache entries are bit for bit those of the
  eager step;
- the logits of every row and every tap's value are outputs of the graph; a call's share is
  copied out of them, since the next replay writes over them;
- when the pool grows (new buffers), the graphs are recorded again.

Only the Triton operations run here (their kernels take every per-step number from device
memory; the torch and CPU operations do not). Without CUDA (the tests, under Triton's
interpreter) the same buffers, padding and outputs run eagerly instead of being replayed, which
is what the CPU tests check against the eager forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from llm_worker.model.forward import Outputs, step_tokens
from llm_worker.model.kv_pool import KVState
from llm_worker.model.ops import CallRows
from llm_worker.model.ops_triton import TritonOps, _Group, _Layout, call_layout
from llm_worker.model.target import ForwardCall, ForwardOutput

if TYPE_CHECKING:
    from llm_worker.model.forward import Forward

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""The row counts recorded: a forward of n rows replays the smallest bucket of at least n."""

_META = 7  # token ids, positions, then ``call_layout``'s five rows of meta


class _Step:
    """One bucket's static buffers and its recorded forward (or, without CUDA, the same run
    eagerly)."""

    def __init__(self, target: Forward, rows: int, padding: KVState, capture: bool) -> None:
        self.target, self.rows = target, rows
        size = _META * rows + rows * rows
        # ordinary tensors even when a first step comes under inference mode (the cost curve's
        # measurement): each later step writes into them, inside inference mode or not
        with torch.inference_mode(False):
            self.host = torch.zeros(size, dtype=torch.int32, pin_memory=capture)
            self.device = torch.zeros(size, dtype=torch.int32, device=target.device)
        self.tokens = self.device[:rows]
        self.positions = self.device[rows : 2 * rows]
        meta = self.device[2 * rows : _META * rows].view(5, rows)
        news = self.device[_META * rows :].view(rows, rows)
        rows_of, slots, cache, starts, lengths = meta
        self.layout = _Layout([_Group(padding, rows_of, slots, cache, starts, lengths, news)], rows, 0)
        self.padding = padding
        self.taps: dict[tuple[str, int], torch.Tensor] = {}
        self.logits = torch.empty(0)
        self.graph: Any = None
        self._fill_padding(0)
        if capture:
            self._capture()

    def _record(self, name: str, layer: int, value: torch.Tensor) -> None:
        self.taps[(name, layer)] = value

    def _run(self) -> None:
        """The forward over the static buffers: every row's logits and every tap's value."""
        t = self.target
        positions = self.positions.long()
        h = t.embed(self.tokens.long())
        x = t.layer_loop(h, self.layout, t.cos[positions], t.sin_signed[positions], self._record, self.rows)
        self.logits = t.ops.logits(t.lm_head, x)

    def _capture(self) -> None:
        """Record the forward: first once on a side stream (Triton compiles its kernels on a first
        call, which a capture may not do), then into the graph, in a memory pool of its own (a
        few MB: no bucket's intermediates can land on another's outputs). Thread-local capture:
        other threads' GPU work (requests drafting, committing) goes on meanwhile."""
        with torch.cuda.device(self.target.device), torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._copy()
                self._run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._run()
            self.graph = graph

    def _copy(self) -> None:
        self.device.copy_(self.host)

    def _fill_padding(self, first: int) -> None:
        """Rows ``first`` .. to the bucket: padding, each in the padding slot at its own position,
        seeing only itself."""
        rows, host = self.rows, self.host
        pad = torch.arange(first, rows, dtype=torch.int32)
        host[first:rows] = 0  # token 0
        host[rows + first : 2 * rows] = 0  # position 0
        meta = host[2 * rows : _META * rows].view(5, rows)
        meta[0, first:] = pad  # the row itself
        meta[1, first:] = self.padding.slot
        meta[2, first:] = pad  # its own cache position in the padding slot
        meta[3, first:] = 0
        meta[4, first:] = 1  # one key: its own
        news = host[_META * rows :].view(rows, rows)
        news[first:] = 0
        news[first:, 0] = pad

    def replay(
        self, calls: Sequence[ForwardCall], placed: Sequence[CallRows], total: int
    ) -> list[ForwardOutput]:
        rows, host = self.rows, self.host
        host[:total] = step_tokens(calls)
        host[rows : rows + total] = torch.cat([p.positions for p in placed])
        meta = host[2 * rows : _META * rows].view(5, rows)
        news = host[_META * rows :].view(rows, rows)
        news[:total] = 0
        for p in placed:
            meta[:, p.rows], news[p.rows, : p.n] = call_layout(p)
        self._fill_padding(total)
        self._copy()
        if self.graph is not None:
            with torch.cuda.device(self.target.device):
                self.graph.replay()
        else:
            self._run()
        return self._outputs(calls, placed)

    def _outputs(self, calls: Sequence[ForwardCall], placed: Sequence[CallRows]) -> list[ForwardOutput]:
        """Each call's logits (all its rows, or its last) and artifacts, copied out of the step's
        outputs (which the next replay overwrites)."""
        outs = Outputs(calls, [p.rows for p in placed], self.target, logit_rows=False)
        for name, layer in outs.wanted:  # the taps some call records
            outs.tap(name, layer, self.taps[(name, layer)])
        for call, p, out in zip(calls, placed, outs.outs, strict=True):
            span = slice(p.row + p.n - 1, p.row + p.n) if call.last_logits_only else p.rows
            out.logits = self.logits[span].clone()
            out.artifacts = {key: value.clone() for key, value in out.artifacts.items()}
        return outs.outs


class StepGraphs:
    """The target's captured steps, by bucket (see the module docstring). ``capture`` False:
    the buffers and padding without CUDA graphs (an eager run of the same code; the CPU tests)."""

    def __init__(self, target: Forward, capture: bool, buckets: Sequence[int] = BUCKETS) -> None:
        if not isinstance(target.ops, TritonOps):
            raise ValueError("captured steps need the Triton operations (--ops triton, on CUDA)")
        if any(k.library != "triton" for k in getattr(target, "kernels", {}).values()):
            # cuBLAS (--kernel aten:N) would multiply a bucket's rows, not the step's: other bits
            raise ValueError("captured steps need the Triton GEMMs (--kernel auto or triton:1)")
        if capture and target.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {target.device}")
        self.target, self.capture = target, capture
        self.buckets = tuple(sorted(buckets))
        self._steps: dict[int, _Step] = {}
        self._buffers: tuple[Any, ...] | None = None  # the pool buffers the steps were recorded over
        self._padding: KVState | None = None
        self.replays = 0
        self.recorded = 0
        self.failed: str | None = None
        """Why recording a step failed (then every step runs eagerly); None while none has."""

    def _padding_slot(self) -> KVState | None:
        """A pool slot held for the padding rows (None while the pool has none free)."""
        if self._padding is None:
            slot = self.target._pool.acquire()
            if slot is not None:
                self._padding = KVState(self.target._pool, slot)
        return self._padding

    def run(
        self, calls: Sequence[ForwardCall], placed: Sequence[CallRows], total: int
    ) -> list[ForwardOutput] | None:
        """The forward replayed at its bucket; None where it does not fit one (the caller runs it
        eagerly). The caller holds the target's lock and has placed the rows (``_place``)."""
        pool = self.target._pool
        bucket = bucket_of(total, self.buckets)
        if self.failed or bucket is None or any(p.state.pool is not pool for p in placed):
            return None
        padding = self._padding_slot()
        if padding is None:
            return None
        # addresses and shapes: new buffers of another shape may reuse the old addresses
        buffers = (pool.keys.data_ptr(), pool.values.data_ptr(), *pool.keys.shape, *pool.values.shape)
        if buffers != self._buffers:  # the pool grew: the recorded steps read the old buffers
            self._steps.clear()
            self._buffers = buffers
        step = self._steps.get(bucket)
        if step is None:
            try:
                step = _Step(self.target, bucket, padding, self.capture)
            except Exception as exc:  # the eager steps go on; the reason is kept and logged once
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "recording a CUDA graph of %d rows failed, steps run eagerly: %s", bucket, self.failed
                )
                return None
            self._steps[bucket] = step
            self.recorded += 1
        self.replays += 1
        return step.replay(calls, placed, total)

    def describe(self) -> dict[str, Any]:
        return {
            "cuda_graphs": self.capture,
            "buckets": list(self.buckets),
            "recorded": self.recorded,
            "replays": self.replays,
            "failed": self.failed,
        }


def bucket_of(rows: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket of at least ``rows`` rows (None: more than the largest).
    Example: ``bucket_of(5)`` → 8."""
    return next((b for b in buckets if b >= rows), None)
