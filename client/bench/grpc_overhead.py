"""What the service adds on top of decoding: gRPC overhead per unary call and per streamed token.

For each call the worker reports how long its engine decoded (``stats.seconds``); everything else
the client waited — serialisation, loopback transport, tokenising and detokenising, the servicer's
thread hops, and for a stream one message per decode step — is the overhead:

    unary overhead  = client wall time − engine seconds                 (per call)
    stream overhead = (client wall time − engine seconds) / new tokens  (per streamed token)

Calls alternate unary and streaming with the same request so both see the same machine state.
The worker runs in its own process (``specdraft up --no-redis``) unless ``--server`` is given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client.bench.timing import latency_ms
from client.grpc_client import GenerationClient, RequestOptions, build_request
from specdraft.security import ClientSecurity


@dataclass(frozen=True)
class OverheadReport:
    calls: int
    new_tokens: int
    unary_ms: dict[str, float]
    """Overhead per unary call, milliseconds: median, p99, mean."""
    stream_ms_per_token: dict[str, float]
    """Overhead per streamed token, milliseconds: median, p99, mean."""
    engine_ms_per_token: float
    """Median engine time per generated token, for scale."""

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "new_tokens": self.new_tokens,
            "unary_overhead_ms": self.unary_ms,
            "stream_overhead_ms_per_token": self.stream_ms_per_token,
            "engine_ms_per_token": self.engine_ms_per_token,
        }


def summary(values: Sequence[float]) -> dict[str, float]:
    """``timing.latency_ms`` under this report's keys (median, p99, mean)."""
    latency = latency_ms(values)
    return {"median": latency["p50_ms"], "p99": latency["p99_ms"], "mean": latency["mean_ms"]}


def measure_overhead(
    addresses: Sequence[str],
    calls: int,
    max_new_tokens: int,
    prompt: str,
    mode: str = "ar",
    warmup: int = 2,
    security: ClientSecurity | None = None,
) -> OverheadReport:
    options = RequestOptions(mode=mode, max_new_tokens=max_new_tokens, ignore_eos=True)
    request = build_request(text=prompt, options=options)
    unary, stream, engine = [], [], []
    with GenerationClient(addresses, timeout=600, security=security) as client:
        for i in range(warmup + calls):
            started = time.perf_counter()
            resp = client.generate(request)
            unary_wall = time.perf_counter() - started

            started = time.perf_counter()
            final = None
            for chunk in client.generate_stream(request):
                if chunk.HasField("final"):
                    final = chunk.final
            stream_wall = time.perf_counter() - started
            assert final is not None and final.stats.new_tokens == max_new_tokens
            if i < warmup:
                continue
            unary.append((unary_wall - resp.stats.seconds) * 1000.0)
            stream.append((stream_wall - final.stats.seconds) * 1000.0 / final.stats.new_tokens)
            engine.append(final.stats.seconds * 1000.0 / final.stats.new_tokens)
    return OverheadReport(
        calls=calls,
        new_tokens=max_new_tokens,
        unary_ms=summary(unary),
        stream_ms_per_token=summary(stream),
        engine_ms_per_token=latency_ms(engine)["p50_ms"],
    )


PROMPT = "Write a numbered list of twenty fruits, one per line."


def measure_overhead_new_worker(
    worker_args: Sequence[str], calls: int, max_new_tokens: int, prompt: str = PROMPT, mode: str = "ar"
) -> OverheadReport:
    """``measure_overhead`` against a worker process started for it (``specdraft serve worker`` with
    ``worker_args``, as the local stack starts one) and stopped afterwards."""
    import tempfile
    from pathlib import Path

    from client.stack import StackConfig, down, up

    cfg = StackConfig(
        worker_port=0, metrics_port=None, redis=False, worker_args=tuple(worker_args), grace_seconds=5
    )
    with tempfile.TemporaryDirectory(prefix="specdraft-bench-grpc-") as state:
        stack = up(cfg, Path(state))
        try:
            return measure_overhead(stack.worker_addresses(), calls, max_new_tokens, prompt, mode)
        finally:
            down(Path(state), grace_seconds=5)
