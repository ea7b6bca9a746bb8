"""Prometheus metrics of a worker, separate from the servicer and from logging.

Exposed on ``/metrics`` by ``specdraft.security.serve_metrics`` (HTTPS on a TLS
server). Names follow Prometheus conventions:
``_total`` counters, ``_seconds`` histograms, labels kept low-cardinality (the mode's registered
name, not its option string). Where vLLM exports the same quantity, the name is vLLM's with
``specdraft_`` for ``vllm:`` (``vllm:prompt_tokens_total`` → ``specdraft_prompt_tokens_total``),
so a vLLM dashboard carries over by its prefix; docs/serving.md has the mapping. No series has a
``_created`` twin (``new_registry``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client import disable_created_metrics as _disable_created_metrics

from llm_worker.batching import BatchRecord
from llm_worker.config import DEFAULT_MODE
from llm_worker.drafters import DRAFTERS, parse_mode
from llm_worker.model.target import TargetInfo
from llm_worker.stats import GenerationStats
from specdraft.guard import refusals_counter

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def new_registry() -> CollectorRegistry:
    """A registry for a server's metrics, with prometheus_client's ``_created`` series turned
    off: every counter and histogram would otherwise export a second series holding its creation
    time (``specdraft_prompt_tokens_created``), which no dashboard reads. The switch is
    prometheus_client's own and process-wide (as ``PROMETHEUS_DISABLE_CREATED_SERIES=true``)."""
    _disable_created_metrics()
    return CollectorRegistry()


def mode_label(mode: str) -> str:
    """The registered mode name; anything else is "unknown" (labels must not take user strings)."""
    try:
        name = parse_mode(mode)[0] or DEFAULT_MODE
    except ValueError:
        return "unknown"
    return name if name in DRAFTERS.names() else "unknown"


def kernels_label(kernel_info: Mapping[str, Any]) -> str:
    """The forward's kernels in one label value: the distinct GEMM kernels, then ``+fused`` when
    the fused CPU kernels run (``TargetModel.kernel_info``); ``torch`` when the target reports none.

    Example: ``{"gemm_kernels": {"qkv": "quant:1", "o": "quant:1", "down": "bf16"},
    "fused_kernels": True}`` → ``"bf16,quant:1+fused"``.
    """
    gemms = sorted(set((kernel_info.get("gemm_kernels") or {}).values()))
    label = ",".join(gemms) or "torch"
    return label + ("+fused" if kernel_info.get("fused_kernels") else "")


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry = field(default_factory=new_registry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "specdraft_requests",
            "Generation requests by mode, method and final status",
            ["mode", "method", "status"],
            registry=r,
        )
        self.success = Counter(
            "specdraft_request_success",
            "Generations that finished, by why: stop (end of sequence) or length",
            ["mode", "finished_reason"],
            registry=r,
        )
        self.latency = Histogram(
            "specdraft_e2e_request_latency_seconds",
            "Wall time of a generation request, from its arrival to its last message",
            ["mode", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "specdraft_request_queue_time_seconds",
            "From a request's arrival to the start of its first engine step (admission, tokenizing, "
            "building the mode's drafter)",
            ["mode"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "specdraft_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specdraft_prompt_tokens", "Prompt tokens of admitted requests", ["mode"], registry=r
        )
        self.tokens = Counter("specdraft_generation_tokens", "Generated tokens", ["mode"], registry=r)
        self.forwards = Counter("specdraft_target_forwards", "Target model forwards", ["mode"], registry=r)
        self.drafted = Counter(
            "specdraft_spec_decode_num_draft_tokens",
            "Draft tokens sent to verification",
            ["mode"],
            registry=r,
        )
        self.accepted = Counter(
            "specdraft_spec_decode_num_accepted_tokens",
            "Draft tokens the target accepted",
            ["mode"],
            registry=r,
        )
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
        self.in_flight = Gauge(
            "specdraft_num_requests_running", "Generations admitted and not yet finished", registry=r
        )
        self.waiting = Gauge(
            "specdraft_num_requests_waiting",
            "Admitted generations whose first engine step has not started (tokenizing, building the drafter)",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "specdraft_kv_cache_usage_perc",
            "Fraction of the KV pool's request slots in use (1 = full; 0 when the target has no pool)",
            registry=r,
        )
        self.model_info = Info(
            "specdraft_model", "The model this worker serves and how its forward computes", registry=r
        )
        self.batch_requests = Histogram(
            "specdraft_batch_requests",
            "Requests sharing one target forward (continuous batching)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.batch_rows = Histogram(
            "specdraft_iteration_tokens_total",
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
        # The prefix cache counts in ``server.PrefixCacheCollector``, read at scrape time, as vLLM's
        # prefix_cache_queries / _hits: specdraft_prefix_cache_{queries,hits}_total (prompt tokens).
        self.auth_refusals = refusals_counter(r)

    def describe_model(self, info: TargetInfo, kernel_info: Mapping[str, Any]) -> None:
        """``specdraft_model_info``: model name, dtype, device, backend and kernels as labels."""
        self.model_info.info(
            {
                "model": info.name,
                "dtype": info.dtype,
                "device": info.device,
                "backend": info.backend,
                "kernels": kernels_label(kernel_info),
            }
        )

    def watch_kv_cache(self, usage: Callable[[], tuple[int, int] | None]) -> None:
        """Read ``specdraft_kv_cache_usage_perc`` from ``usage`` (slots used, slots in all;
        ``TargetModel.kv_cache_usage``) at every scrape."""

        def fraction() -> float:
            used = usage()
            return used[0] / used[1] if used and used[1] else 0.0

        self.kv_cache_usage.set_function(fraction)

    def observe_request(self, mode: str, method: str, status: str, seconds: float) -> None:
        label = mode_label(mode)
        self.requests.labels(label, method, status).inc()
        self.latency.labels(label, method).observe(seconds)

    def observe_admitted(self, mode: str, prompt_tokens: int, queued_seconds: float) -> None:
        """A request starts its first engine step: its prompt's size and its time in the queue."""
        self.observe_prompt(mode, prompt_tokens)
        self.queue_time.labels(mode_label(mode)).observe(queued_seconds)

    def observe_prompt(self, mode: str, prompt_tokens: int) -> None:
        """A request's prompt size, where its time in the queue is not known (the HTTP front end
        sees a generation's events, not when its first engine step began)."""
        self.prompt_tokens.labels(mode_label(mode)).inc(prompt_tokens)

    def observe_first_token(self, mode: str, seconds: float) -> None:
        self.first_token.labels(mode_label(mode)).observe(seconds)

    def observe_result(self, mode: str, stats: GenerationStats, finish_reason: str = "") -> None:
        label = mode_label(mode)
        if finish_reason:
            self.success.labels(label, finish_reason).inc()
        self.tokens.labels(label).inc(stats.new_tokens)
        self.forwards.labels(label).inc(stats.target_forwards)
        self.drafted.labels(label).inc(stats.drafted_tokens)
        self.accepted.labels(label).inc(stats.accepted_tokens)
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
