"""Latency figures of the benchmarks, all from one percentile definition
(``specdraft.common.percentile``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from specdraft.common import percentile


def latency_ms(times_ms: Sequence[float]) -> dict[str, float]:
    """``calls`` and the p50, p99 and mean of ``times_ms`` (milliseconds, rounded to µs)."""
    return {
        "calls": len(times_ms),
        "p50_ms": round(percentile(times_ms, 0.5), 3),
        "p99_ms": round(percentile(times_ms, 0.99), 3),
        "mean_ms": round(statistics.fmean(times_ms), 3),
    }
