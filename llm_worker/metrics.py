"""Prometheus metrics of a worker, separate from the servicer and from logging.

Exposed on ``/metrics`` by ``specdraft.security.serve_metrics`` (HTTPS on a TLS
server). Names follow Prometheus conventions:
``_total`` counters, ``_seconds`` histograms, labels kept low-cardinality (the mode's registered
name, not its option string).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llm_worker.batching import BatchRecord
from llm_worker.config import DEFAULT_MODE
from llm_worker.drafters import DRAFTERS, parse_mode
from llm_worker.stats import GenerationStats
from specdraft.guard import refusals_counter

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def mode_label(mode: str) -> str:
    """The registered mode name; anything else is "unknown" (labels must not take user strings)."""
    try:
        name = parse_mode(mode)[0] or DEFAULT_MODE
    except ValueError:
        return "unknown"
    return name if name in DRAFTERS.names() else "unknown"


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "specdraft_requests",
            "Generation requests by mode, method and final status",
            ["mode", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "specdraft_request_seconds",
            "Wall time of a generation request",
            ["mode", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "specdraft_time_to_first_token_seconds",
            "Time to the first generated token",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("specdraft_generated_tokens", "Generated tokens", ["mode"], registry=r)
        self.forwards = Counter("specdraft_target_forwards", "Target model forwards", ["mode"], registry=r)
        self.tau = Histogram(
            "specdraft_tau",
            "Tokens per target forward, per request",
            ["mode"],
            buckets=TAU_BUCKETS,
            registry=r,
        )
        self.acceptance = Histogram(
            "specdraft_acceptance_rate",
            "Accepted / drafted tokens, per request",
            ["mode"],
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.draft_seconds = Counter("specdraft_draft_seconds", "Time spent drafting", ["mode"], registry=r)
        self.verify_seconds = Counter(
            "specdraft_verify_seconds", "Time spent in target forwards and verification", ["mode"], registry=r
        )
        self.in_flight = Gauge("specdraft_requests_in_flight", "Generations running now", registry=r)
        self.batch_requests = Histogram(
            "specdraft_batch_requests",
            "Requests sharing one target forward (continuous batching)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.batch_rows = Histogram(
            "specdraft_batch_rows",
            "Rows (new tokens: decode, drafts, prefill chunks) of one batched target forward",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.draft_budget = Histogram(
            "specdraft_draft_tokens_per_step",
            "Draft tokens the planner chose to verify per step, mean per request (shrinks under load)",
            ["mode"],
            buckets=(0, 0.5, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.auth_refusals = refusals_counter(r)

    def observe_request(self, mode: str, method: str, status: str, seconds: float) -> None:
        label = mode_label(mode)
        self.requests.labels(label, method, status).inc()
        self.latency.labels(label, method).observe(seconds)

    def observe_first_token(self, mode: str, seconds: float) -> None:
        self.first_token.labels(mode_label(mode)).observe(seconds)

    def observe_result(self, mode: str, stats: GenerationStats) -> None:
        label = mode_label(mode)
        self.tokens.labels(label).inc(stats.new_tokens)
        self.forwards.labels(label).inc(stats.target_forwards)
        self.tau.labels(label).observe(stats.tau)
        if stats.drafted_tokens:
            self.acceptance.labels(label).observe(stats.acceptance_rate)
        if stats.target_forwards:
            self.draft_budget.labels(label).observe(stats.drafted_tokens / stats.target_forwards)
        self.draft_seconds.labels(label).inc(stats.draft_seconds)
        self.verify_seconds.labels(label).inc(stats.verify_seconds)

    def observe_batch(self, record: BatchRecord) -> None:
        """One forward of the batch scheduler."""
        self.batch_requests.observe(record.requests)
        self.batch_rows.observe(record.rows)
