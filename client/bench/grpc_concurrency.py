"""``specdraft bench-grpc --concurrency 1,2,4,8``: modes under load, through a worker process.

The figures of ``bench --concurrency`` (``client.bench.concurrency``), measured as a client sees
them: c closed-loop users (threads sharing one gRPC channel) stream the suite's first turns as
chat requests, each user its next prompt as soon as its last answer is complete, until every
prompt was answered once. Latency and time to first token are the client's wall times (they
include gRPC, tokenising and the worker's queue). Requests per forward come from the worker's
``specdraft_batch_requests`` histogram (scraped before and after each run, so the worker must not
serve anybody else meanwhile); outputs are compared with ``ar``'s at concurrency 1 (greedy).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from client.grpc_client import GenerationClient, RequestOptions, build_request
from specdraft.common import percentile
from specdraft.security import ClientSecurity


def batch_totals(metrics_url: str | None) -> tuple[float, float] | None:
    """(Σ requests over forwards, forwards) of a worker's ``specdraft_batch_requests``, or None."""
    if not metrics_url:
        return None
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    total = count = None
    for family in text_string_to_metric_families(text):
        if family.name != "specdraft_batch_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return (total, count) if total is not None and count is not None else None


def run_level(
    client: GenerationClient,
    prompts: Sequence[str],
    mode: str,
    users: int,
    max_new_tokens: int,
    metrics_url: str | None = None,
) -> tuple[dict[str, Any], dict[int, list[int]]]:
    """One mode at one concurrency: its figures, and each prompt's output tokens."""
    lock = threading.Lock()
    queue = list(range(len(prompts)))
    latencies: list[float] = []
    ttfts: list[float] = []
    outputs: dict[int, list[int]] = {}
    steps = drafted = 0
    errors: list[BaseException] = []
    options = RequestOptions(mode=mode, max_new_tokens=max_new_tokens, ignore_eos=True)

    def user() -> None:
        nonlocal steps, drafted
        while True:
            with lock:
                if not queue or errors:
                    return
                index = queue.pop(0)
            request = build_request(chat=[("user", prompts[index])], options=options)
            began = time.perf_counter()
            first = None
            final = None
            try:
                for chunk in client.generate_stream(request):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - began
                    if chunk.HasField("final"):
                        final = chunk.final
            except BaseException as exc:  # reported after the run, not swallowed
                with lock:
                    errors.append(exc)
                return
            assert final is not None
            with lock:
                latencies.append(time.perf_counter() - began)
                ttfts.append(first or 0.0)
                outputs[index] = list(final.token_ids)
                steps += final.stats.target_forwards
                drafted += final.stats.drafted_tokens

    before = batch_totals(metrics_url)
    began = time.perf_counter()
    threads = [threading.Thread(target=user, name=f"grpc-user-{i}") for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    if errors:
        raise errors[0]
    after = batch_totals(metrics_url)
    mean_batch = None
    if before is not None and after is not None and after[1] > before[1]:
        mean_batch = round((after[0] - before[0]) / (after[1] - before[1]), 3)
    tokens = sum(len(o) for o in outputs.values())
    return {
        "aggregate_tokens_per_second": round(tokens / seconds, 3) if seconds else 0.0,
        "latency_p50_seconds": round(percentile(latencies, 0.5), 3),
        "latency_p95_seconds": round(percentile(latencies, 0.95), 3),
        "ttft_p50_seconds": round(percentile(ttfts, 0.5), 3),
        "ttft_p95_seconds": round(percentile(ttfts, 0.95), 3),
        "mean_batch_size": mean_batch,
        "draft_tokens_per_request_step": round(drafted / steps, 3) if steps else 0.0,
        "outputs": len(outputs),
        "new_tokens": tokens,
        "seconds": round(seconds, 3),
    }, outputs


def run_grpc_concurrency(
    addresses: Sequence[str],
    prompts: Sequence[str],
    modes: Sequence[str],
    levels: Sequence[int],
    max_new_tokens: int,
    metrics_url: str | None = None,
    security: ClientSecurity | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """mode -> str(c) -> figures (``run_level``'s, plus ``identical_to_ar``). ``ar`` alone at
    concurrency 1 runs first (the references; reported as its own level if asked for), then
    each level in the order given, modes interleaved within it."""
    out: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in modes}
    with GenerationClient(addresses, timeout=3600, security=security) as client:
        reference, references = run_level(client, prompts, "ar", 1, max_new_tokens, metrics_url)
        reference["identical_to_ar"] = True
        for c in levels:
            for mode in modes:
                if mode == "ar" and c == 1:
                    figures = reference
                else:
                    figures, outputs = run_level(client, prompts, mode, c, max_new_tokens, metrics_url)
                    same = sum(outputs[i] == references[i] for i in outputs)
                    figures["identical_to_ar"] = same == len(outputs)
                    figures["identical_outputs"] = same
                out[mode][str(c)] = figures
                if progress is not None:
                    progress(
                        f"concurrency {c} {mode}: {figures['aggregate_tokens_per_second']} tokens/s, "
                        f"batch {figures['mean_batch_size']}"
                    )
    return {
        "max_new_tokens": max_new_tokens,
        "questions": len(prompts),
        "modes": {mode: {"concurrency": by_level} for mode, by_level in out.items()},
    }


def run_grpc_concurrency_new_worker(
    worker_args: Sequence[str],
    prompts: Sequence[str],
    modes: Sequence[str],
    levels: Sequence[int],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``run_grpc_concurrency`` against a worker process started for it (``specdraft serve
    worker`` with ``worker_args``, batching as served, metrics on a free port, admitting the
    highest level's users at once) and stopped after."""
    import tempfile
    from pathlib import Path

    from client.stack import StackConfig, down, up

    admit = ("--max-concurrent", str(max(levels)))
    cfg = StackConfig(
        worker_port=0, metrics_port=0, redis=False, worker_args=(*worker_args, *admit), grace_seconds=5
    )
    with tempfile.TemporaryDirectory(prefix="specdraft-bench-grpc-") as state:
        stack = up(cfg, Path(state))
        try:
            url = next((p.metrics for p in stack.workers() if p.metrics), None)
            return run_grpc_concurrency(
                stack.worker_addresses(), prompts, modes, levels, max_new_tokens, url, progress=progress
            )
        finally:
            down(Path(state), grace_seconds=5)
