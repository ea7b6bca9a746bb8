"""The verify cost curve t(n, L): measured on this machine, cached when measured quietly, and
checked against the forwards the engine times.

``measure_cost_curve`` times target forwards of n new tokens after L cached ones. A curve is
cached per model, backend, dtype, device, thread count and torch version (``cost_cache_path``),
but only from a measurement no other process disturbed (``specdraft.common.LoadWatch``): one
taken under load serves the run that took it and is measured again by the next. A cached curve
can still be wrong for this run (measured before the machine got busier, or quieter), so
``CurveCheck`` compares the curve's price of the forwards the engine ran alone with what they
took, and measures the curve again when the two stay apart.
"""

from __future__ import annotations

import bisect
import json
import logging
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_worker.config import CostConfig
from llm_worker.model.target import TargetModel
from llm_worker.types import ArtifactNeeds
from specdraft.common import LoadWatch, Progress, atomic_write_text, cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostCurve:
    """t(n, L): measured seconds per target forward of n new tokens after L cached tokens."""

    sizes: tuple[int, ...]  # [S] ascending
    contexts: tuple[int, ...]  # [C] ascending
    seconds: tuple[tuple[float, ...], ...]  # [C][S]

    def _at_context(self, row: tuple[float, ...], n: int) -> float:
        sizes = self.sizes
        if n <= sizes[0] or len(sizes) == 1:
            return row[0]
        i = bisect.bisect_left(sizes, n)
        if i >= len(sizes):  # beyond the largest measured size: extend the last slope
            i = len(sizes) - 1
        lo, hi = sizes[i - 1], sizes[i]
        return row[i - 1] + (row[i] - row[i - 1]) * (n - lo) / (hi - lo)

    def t(self, n: int, context: int) -> float:
        if len(self.contexts) == 1:
            return self._at_context(self.seconds[0], n)
        c = self.contexts
        i = min(max(bisect.bisect_left(c, context), 1), len(c) - 1)
        a = self._at_context(self.seconds[i - 1], n)
        b = self._at_context(self.seconds[i], n)
        value = a + (b - a) * (context - c[i - 1]) / (c[i] - c[i - 1])
        return max(value, 1e-6)

    def relative(self, n: int, context: int) -> float:
        """t(n) / t(1) at this context."""
        return self.t(n, context) / self.t(1, context)

    def to_json(self) -> dict[str, object]:
        return {
            "sizes": list(self.sizes),
            "contexts": list(self.contexts),
            "seconds": [list(r) for r in self.seconds],
        }

    @staticmethod
    def from_json(data: dict[str, list]) -> CostCurve:
        return CostCurve(
            tuple(int(s) for s in data["sizes"]),
            tuple(int(c) for c in data["contexts"]),
            tuple(tuple(float(v) for v in row) for row in data["seconds"]),
        )

    @staticmethod
    def linear(base: float, per_token: float, sizes: tuple[int, ...] = (1, 65)) -> CostCurve:
        """A synthetic curve t(n) = base + per_token * (n - 1), context-independent (for tests)."""
        return CostCurve(sizes, (0,), (tuple(base + per_token * (s - 1) for s in sizes),))


WHAT = "measuring the verify cost curve on this machine"


def measure_cost_curve(target: TargetModel, cfg: CostConfig, max_size: int) -> CostCurve:
    """Time forwards of each size at each context length; medians of ``cfg.repeats``.

    Sizes are visited in a shuffled order on every repeat so that machine noise spreads over
    all of them instead of biasing one. Progress goes to ``specdraft.common.PROGRESS``: the first
    line once the first context's prefill and warm-up round are timed (its estimate scales those
    to the rest: prefills by their length, rounds as they are), then a line every few seconds.
    """
    max_size = max(1, min(max_size, target.info.max_context // 2))
    sizes = tuple(sorted({s for s in cfg.sizes if s <= max_size} | {1, max_size}))
    limit = max(1, target.info.max_context - max(sizes) - 1)
    contexts = tuple(sorted({max(1, min(c, limit)) for c in cfg.contexts}))
    vocab = target.info.vocab_size
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    progress: Progress | None = None
    done = prefill_per_token = round_seconds = 0.0

    def total() -> float:
        return sum(prefill_per_token * c + (cfg.repeats + 1) * round_seconds for c in contexts)

    with torch.inference_mode():
        for context in contexts:
            state = target.start()
            prompt = torch.randint(0, vocab, (context,), generator=gen)
            begin = time.perf_counter()
            target.forward(state, prompt, None, ArtifactNeeds())
            target.commit(state, range(context))
            prefill_per_token = prefill_per_token or (time.perf_counter() - begin) / context
            done += prefill_per_token * context
            samples: dict[int, list[float]] = {s: [] for s in sizes}
            order = list(sizes)
            for _ in range(cfg.repeats + 1):  # the first round warms up
                rng.shuffle(order)
                for n in order:
                    tokens = torch.randint(0, vocab, (n,), generator=gen)
                    begin = time.perf_counter()
                    target.forward(state, tokens, None, ArtifactNeeds())
                    samples[n].append(time.perf_counter() - begin)
                    target.commit(state, [])
                if progress is None:
                    round_seconds = sum(s[0] for s in samples.values())
                    progress = Progress(WHAT, total())
                done += round_seconds
                progress.update(done / total())
            rows.append(tuple(statistics.median(samples[n][1:]) for n in sizes))
    if progress is not None:
        progress.done()
    return CostCurve(sizes, contexts, tuple(rows))


CURVE_FORMAT = 2
"""Part of a cached curve's name: raised when the forward's cost changes without its kernels'
build changing (2: small torch operations no longer wake OpenMP workers inside the forward)."""


def cost_cache_path(target: TargetModel) -> Path:
    i = target.info
    threads = torch.get_num_threads()
    backend = i.backend + target.kernel_variant
    key = (
        f"{i.fingerprint}-{backend}-{i.dtype}-{i.device}-t{threads}-torch{torch.__version__}-v{CURVE_FORMAT}"
    )
    return cache_root() / "cost" / (key.replace("/", "_").replace(":", "_") + ".json")


def measure_curve_and_cache(target: TargetModel, cfg: CostConfig, max_size: int) -> CostCurve:
    """``measure_cost_curve``, written to the cache (``cfg.cache``) only if no other process used
    this process's cores meanwhile (``LoadWatch``); otherwise the curve serves this run only."""
    with LoadWatch(torch.get_num_threads()) as watch:
        curve = measure_cost_curve(target, cfg, max_size)
    if cfg.cache:
        if watch.busy:
            log.warning(
                "the verify cost curve was measured under load (%s): it is used by this run but not "
                "cached; a later run measures it again",
                watch.describe(),
            )
        else:
            atomic_write_text(cost_cache_path(target), json.dumps(curve.to_json()))
    return curve


def load_or_measure_curve(target: TargetModel, cfg: CostConfig, max_size: int) -> CostCurve:
    """The cached curve if it covers ``max_size``, else a measured one (``measure_curve_and_cache``)."""
    path = cost_cache_path(target)
    if cfg.cache and path.is_file():
        try:
            curve = CostCurve.from_json(json.loads(path.read_text()))
            if curve.sizes[-1] >= max_size:
                return curve
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable cost curve %s: %s", path, exc)
    log.info("measuring the verify cost curve (once per model, dtype, device and thread count)")
    return measure_curve_and_cache(target, cfg, max_size)


class CurveCheck:
    """The cost curve in use, checked against the forwards the engine times, and measured again
    when they disagree.

    ``observe(rows, context, seconds)``: a forward of ``rows`` new tokens after ``context`` cached
    ones took ``seconds`` (the engine's forward and verify of a step whose request was alone in
    it: with other requests in the forward, or beside it, the time is theirs too). The ratio
    seconds / t(rows, context) of the last ``window`` forwards is kept; once ``window`` forwards
    have been seen since the curve was measured, a median ratio outside ``band`` (a curve
    measured under load prices a quiet forward at a tenth of what it says; one measured quiet
    prices forwards on a machine that got busy at half) makes the observing thread call
    ``measure`` (``measure_curve_and_cache``: the new curve is cached only if measured quietly),
    and the new curve replaces the old. The engine's time includes verifying, a little more than
    the forward the curve times, so a quiet ratio sits slightly above 1.

    Measuring again rather than rescaling the curve by the ratio: load changes the curve's shape,
    not only its scale (waiting for cores costs a 1-token forward ten times what it costs, a
    65-token one far less), and the engine's forwards are mostly of few rows.

    Each measurement that did not bring the ratio back into the band doubles the forwards
    before the next (up to ``max_window``), so a lasting disagreement the curve cannot fix (a
    model whose verify costs as much as its forward, a machine whose load comes and goes) costs
    a few measurements, not one a window. Observations made while a measurement runs are
    dropped. Thread-safe.
    """

    def __init__(
        self,
        curve: CostCurve,
        measure: Callable[[], CostCurve],
        window: int = 32,
        band: tuple[float, float] = (0.5, 2.0),
        max_window: int = 4096,
        deferred: bool = False,
    ) -> None:
        """``deferred``: ``observe`` only notes that a measurement is due (``due``) and the
        owner runs it with ``measure_if_due`` when no request is in flight (an engine: before
        a request starts), so that no request waits for it mid-stream and no request's timing
        or forwards mix with it."""
        self.deferred = deferred
        self.due = False
        """A disagreement was seen and a measurement is waiting (``deferred`` only)."""
        self._curve = curve
        self.measure = measure
        self.window = window
        self.band = band
        self.max_window = max_window
        self.measurements = 0
        """Curves measured by this check."""
        self._ratios: deque[float] = deque(maxlen=window)
        self._seen = 0
        self._needed = window
        self._measuring = False
        self._due_ratio = float("nan")
        """The median ratio that made a deferred measurement due."""
        self._lock = threading.Lock()

    @property
    def curve(self) -> CostCurve:
        """The curve to plan with now."""
        return self._curve

    def ratio(self) -> float | None:
        """The median of seconds / t over the last ``window`` forwards (None: none yet)."""
        with self._lock:
            return statistics.median(self._ratios) if self._ratios else None

    def observe(self, rows: int, context: int, seconds: float) -> bool:
        """One forward the engine timed alone; True if it made the check measure a new curve."""
        with self._lock:
            if self._measuring or rows < 1 or seconds <= 0:
                return False
            self._ratios.append(seconds / self._curve.t(rows, context))
            self._seen += 1
            if self._seen < self._needed:
                return False
            ratio = statistics.median(self._ratios)
            low, high = self.band
            if low <= ratio <= high:
                self._needed = self.window  # the curve agrees: a later drift is caught as fast
                return False
            if self.deferred:
                self.due = True
                self._due_ratio = ratio  # what the log reports: later forwards may agree again
                return False
            self._measuring = True
        return self._measure(ratio)

    def measure_if_due(self) -> bool:
        """Run the measurement a deferred check noted as due; True if the curve was replaced."""
        with self._lock:
            if not self.due or self._measuring:
                return False
            self.due = False
            self._measuring = True
            ratio = self._due_ratio
        return self._measure(ratio)

    def _measure(self, ratio: float) -> bool:
        log.warning(
            "the verify cost curve disagrees with this run's forwards (they took %.2f× its price, "
            "median of the last %d): measuring it again",
            ratio,
            len(self._ratios),
        )
        try:
            curve: CostCurve | None = self.measure()
        except Exception:  # a failed measurement must not fail the request that observed
            log.exception("measuring the verify cost curve again failed: keeping the old one")
            curve = None
        with self._lock:
            self._measuring = False
            self._ratios.clear()
            self._seen = 0
            self._needed = min(2 * self._needed, self.max_window)
            if curve is None:
                return False
            self._curve = curve
            self.measurements += 1
        return True
