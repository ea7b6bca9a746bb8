"""``specdraft bench --concurrency 1,2,4,8``: modes under load, through the worker's scheduler.

For each concurrency c and engine mode, c closed-loop users (threads) share one batched engine
(``Engine(batching=...)``, the scheduler the worker serves with) and send the suite's first-turn
prompts, each user its next prompt as soon as its last answer is complete, until every prompt was
answered once. Reported per mode and c: aggregate tokens/s (every new token over the wall time),
latency and time-to-first-token percentiles, the mean requests per forward, draft tokens verified
per request step, and whether every output equals ``ar``'s alone (greedy).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from client.bench.runners import bench_tenant
from llm_worker.batching import BatchingConfig
from llm_worker.engine import Engine, GenerationRequest, StepOutput
from llm_worker.results import GenerationResult
from specdraft.common import percentile

NO_PREFIX_CACHE = " (no prefix cache)"
"""The suffix of a mode's label in a concurrency run without the prefix cache."""


def run_concurrency(
    engine: Engine,
    prompts: Sequence[list[int]],
    references: Sequence[list[int]] | None,
    mode: str,
    concurrency: int,
    max_new_tokens: int,
    batching: BatchingConfig | None = None,
    prefix_cache: bool = True,
) -> dict[str, Any]:
    """One mode at one concurrency: c users through a fresh scheduler over ``engine``'s target
    (its cost curve and drafting resources), with a prefix cache as ``engine``'s config sizes it
    holding the first prompt before the timing starts (``prefix_cache`` False: none).
    ``references``: ``ar``'s outputs for ``prompts``."""
    config = engine.config if prefix_cache else replace(engine.config, prefix_cache_bytes=0)
    batched = Engine(
        engine.target,
        config,
        curve=engine.cost_curve,
        resources=engine.resources,
        batching=batching or BatchingConfig(),
    )
    assert batched.scheduler is not None
    lock = threading.Lock()
    queue = list(range(len(prompts)))
    latencies: list[float] = []
    ttfts: list[float] = []
    outputs: dict[int, list[int]] = {}
    steps = drafted = tokens = cached = 0
    errors: list[BaseException] = []

    def user() -> None:
        nonlocal steps, drafted, tokens, cached
        while True:
            with lock:
                if not queue or errors:
                    return
                index = queue.pop(0)
            began = time.perf_counter()
            first = None
            result = None
            try:
                tenant = bench_tenant(mode)
                req = GenerationRequest(tuple(prompts[index]), max_new_tokens, mode, tenant=tenant)
                for item in batched.stream(req):
                    if first is None and isinstance(item, StepOutput):
                        first = time.perf_counter() - began
                    if isinstance(item, GenerationResult):
                        result = item
            except BaseException as exc:  # reported after the run, not swallowed
                with lock:
                    errors.append(exc)
                return
            assert result is not None
            with lock:
                latencies.append(time.perf_counter() - began)
                ttfts.append(first or 0.0)
                outputs[index] = list(result.token_ids)
                steps += result.stats.target_forwards
                drafted += result.stats.drafted_tokens
                tokens += len(result.token_ids)
                cached += result.stats.cached_prompt_tokens

    if batched.prefix_cache is not None and prompts:
        # steady state: the prefix cache holds one earlier request's prompt (a shared system
        # prompt is cached once the service has run), not the empty cache of a fresh worker;
        # through ``ar`` under the mode's tenant, so no online drafter learns from it
        warm = GenerationRequest(tuple(prompts[0]), 1, "ar", tenant=bench_tenant(mode))
        batched.generate(warm)
    scheduler = batched.scheduler
    forwards0, requests0 = scheduler.forwards, scheduler.requests
    began = time.perf_counter()
    users = [threading.Thread(target=user, name=f"user-{i}") for i in range(concurrency)]
    for t in users:
        t.start()
    for t in users:
        t.join()
    seconds = time.perf_counter() - began
    batched.close()
    if errors:
        raise errors[0]
    forwards = scheduler.forwards - forwards0
    identical = None
    if references is not None:
        identical = sum(outputs[i] == list(references[i]) for i in outputs)
    return {
        "aggregate_tokens_per_second": round(tokens / seconds, 3) if seconds else 0.0,
        "latency_p50_seconds": round(percentile(latencies, 0.5), 3),
        "latency_p95_seconds": round(percentile(latencies, 0.95), 3),
        "ttft_p50_seconds": round(percentile(ttfts, 0.5), 3),
        "ttft_p95_seconds": round(percentile(ttfts, 0.95), 3),
        "mean_batch_size": round((scheduler.requests - requests0) / forwards, 3) if forwards else 0.0,
        "draft_tokens_per_request_step": round(drafted / steps, 3) if steps else 0.0,
        "identical_to_ar": identical == len(outputs) if identical is not None else None,
        "identical_outputs": identical,
        "outputs": len(outputs),
        "new_tokens": tokens,
        "prompt_tokens": sum(len(prompts[i]) for i in outputs),
        "cached_prompt_tokens": cached,  # of those, supplied by the prefix cache
        "seconds": round(seconds, 3),
        "mean_latency_seconds": round(statistics.fmean(latencies), 3) if latencies else 0.0,
    }


def run_concurrency_levels(
    engine: Engine,
    prompts: Sequence[list[int]],
    references: Sequence[list[int]] | None,
    modes: Sequence[str],
    levels: Sequence[int],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    without_prefix_cache: bool = False,
) -> dict[str, dict[str, dict[str, Any]]]:
    """mode -> str(c) -> ``run_concurrency``'s figures. Levels run in the order given, modes
    interleaved within each level (noise falls on all modes alike). ``without_prefix_cache``:
    every mode also without the prefix cache, reported as ``MODE` + ``NO_PREFIX_CACHE``."""
    runs = [(m, m, True) for m in modes]
    if without_prefix_cache:
        runs += [(m + NO_PREFIX_CACHE, m, False) for m in modes]
    out: dict[str, dict[str, dict[str, Any]]] = {label: {} for label, _, _ in runs}
    for c in levels:
        for label, mode, cached in runs:
            figures = run_concurrency(
                engine, prompts, references, mode, c, max_new_tokens, prefix_cache=cached
            )
            out[label][str(c)] = figures
            if progress is not None:
                progress(
                    f"concurrency {c} {label}: {figures['aggregate_tokens_per_second']} tokens/s, "
                    f"batch {figures['mean_batch_size']}"
                )
    return out
