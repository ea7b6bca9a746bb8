"""Load test for LLM workers over gRPC (locust's gRPC pattern: gevent-patched grpc, request events).

Each simulated user streams generations (``GenerateStream``) and, less often, makes unary calls
(``Generate``) with prompts from the built-in input-guided suite. Locust's statistics get one
entry per call kind:

- ``grpc GenerateStream``      latency of the whole stream; response length = tokens generated
- ``grpc GenerateStream TTFT`` time to the first streamed token
- ``grpc Generate``            latency of a unary call

and at the end, per user-visible generation metric, a summary of tokens/s, TTFT and τ is printed
and written as JSON beside the CSV report (``<csv prefix>_generation.json``).

Where the workers are: ``--host HOST:PORT[,HOST:PORT...]``, else ``$SPECDRAFT_WORKERS``, else the
local stack's state file (``specdraft up``). Examples::

    specdraft up
    locust -f deploy/locustfile.py --headless -u 4 -r 1 -t 60s --csv bench-out/loadtest \\
        --html bench-out/loadtest.html --mode pld --max-new-tokens 64

A user keeps a channel to every worker and starts at a random one; a call refused with
UNAVAILABLE, RESOURCE_EXHAUSTED or CANCELLED (a worker shutting down) before its first token
fails over to the next worker (``client.grpc_client.FAILOVER_CODES``). A call that fails on every
worker, or with any other status, is a locust failure (the status name is the error).
``--record-outputs FILE`` appends each finished generation (prompt index and text, mode, worker,
token ids) as a JSON line, for ``specdraft chaos`` to compare with ``ar``. (The text is recorded
because the suite quotes standard-library documentation, which gevent's monkey-patching changes
here: the prompts differ from another process's.)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, events, task
from locust.env import Environment

# gRPC's C core must cooperate with gevent (locust monkey-patches the standard library first).
grpc_gevent.init_gevent()

from client.grpc_client import CHANNEL_OPTIONS, FAILOVER_CODES, RequestOptions, build_request  # noqa: E402
from client.stack import default_state_dir, read_state  # noqa: E402
from specdraft.common import atomic_write_text, percentile  # noqa: E402
from specdraft.security import TOKEN_ENV, ClientSecurity, read_tokens  # noqa: E402
from specdraft.stubs import generation_pb2_grpc  # noqa: E402

_generations: list[dict[str, float]] = []


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--mode", default="pld", help="drafting mode of every request")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-chars", type=int, default=2000, help="cut prompts to this many characters")
    parser.add_argument("--state-dir", default="", help="local stack to target when --host is not given")
    parser.add_argument("--record-outputs", default="", help="append each generation's tokens here (JSONL)")
    # grpc- prefix: locust's own --tls-cert / --tls-key are for its web UI
    parser.add_argument(
        "--grpc-tls-ca", default="", help="PEM CA of the workers' certificates (turns TLS on)"
    )
    parser.add_argument("--grpc-tls-cert", default="", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--grpc-tls-key", default="", help="PEM key of the client certificate")
    parser.add_argument(
        "--grpc-token-file", default="", help="bearer token to send (default: $SPECDRAFT_TOKEN)"
    )
    parser.add_argument(
        "--grpc-insecure",
        action="store_true",
        default=False,
        help="send the token in plaintext to a non-loopback address",
    )


def worker_addresses(host: str | None, state_dir: str = "") -> list[str]:
    """Where the load goes: ``--host``, ``$SPECDRAFT_WORKERS``, or the local stack."""
    spec = host or os.environ.get("SPECDRAFT_WORKERS", "")
    if spec:
        return [a.strip().removeprefix("grpc://") for a in spec.split(",") if a.strip()]
    state = read_state(Path(state_dir) if state_dir else default_state_dir())
    if state is None or not state.worker_addresses():
        raise SystemExit("no workers: pass --host HOST:PORT, set SPECDRAFT_WORKERS or run `specdraft up`")
    return state.worker_addresses()


def _prompts(limit: int) -> list[str]:
    from client.bench.suite import builtin_suite

    return [q.turns[0][:limit] for q in builtin_suite()]


class GenerationUser(User):
    """One client: its own channel to one of the workers, chosen at random."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        addresses = worker_addresses(self.host, getattr(opts, "state_dir", ""))
        start = random.randrange(len(addresses))
        addresses = addresses[start:] + addresses[:start]
        self.channels = [_security(opts).channel(a, CHANNEL_OPTIONS) for a in addresses]
        self.stubs = [generation_pb2_grpc.GenerationStub(c) for c in self.channels]
        self.prompts = _prompts(getattr(opts, "prompt_chars", 2000))
        self.record = getattr(opts, "record_outputs", "")
        self.options = RequestOptions(
            mode=getattr(opts, "mode", "pld"),
            max_new_tokens=getattr(opts, "max_new_tokens", 64),
            temperature=getattr(opts, "temperature", 0.0),
        )

    def on_stop(self) -> None:
        for channel in self.channels:
            channel.close()

    def _request(self) -> tuple[int, Any]:
        index = random.randrange(len(self.prompts))
        return index, build_request(chat=[("user", self.prompts[index])], options=self.options)

    def _recorded(self, index: int, reply: Any) -> None:
        if self.record:
            row = {
                "prompt": index,
                "text": self.prompts[index],
                "mode": self.options.mode,
                "worker": reply.worker_id,
            }
            line = json.dumps({**row, "token_ids": list(reply.token_ids)})
            with open(self.record, "a", encoding="utf-8") as out:
                out.write(line + "\n")

    def _fire(self, name: str, started: float, length: int, exc: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - started) * 1000.0,
            response_length=length,
            exception=exc,
            context={},
        )

    @task(3)
    def stream(self) -> None:
        started = time.perf_counter()
        index, request = self._request()
        tokens, first, final = 0, None, None
        for i, stub in enumerate(self.stubs):
            try:
                for chunk in stub.GenerateStream(request, timeout=300):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                        self._fire("GenerateStream TTFT", started, 0, None)
                    tokens += len(chunk.token_ids)
                    if chunk.HasField("final"):
                        final = chunk.final
                break
            except grpc.RpcError as exc:
                if first is None and exc.code() in FAILOVER_CODES and i + 1 < len(self.stubs):
                    continue  # nothing streamed yet: the next worker
                self._fire("GenerateStream", started, tokens, _failure(exc))
                return
        self._fire("GenerateStream", started, tokens, None)
        _record(tokens, started, (first or time.perf_counter()) - started, final)
        if final is not None:
            self._recorded(index, final)

    @task(1)
    def unary(self) -> None:
        started = time.perf_counter()
        index, request = self._request()
        for i, stub in enumerate(self.stubs):
            try:
                resp = stub.Generate(request, timeout=300)
                break
            except grpc.RpcError as exc:
                if exc.code() in FAILOVER_CODES and i + 1 < len(self.stubs):
                    continue
                self._fire("Generate", started, 0, _failure(exc))
                return
        self._fire("Generate", started, len(resp.token_ids), None)
        _record(len(resp.token_ids), started, None, resp)
        self._recorded(index, resp)


def _security(opts: Any) -> ClientSecurity:
    """TLS, client certificate and token from the command line (``specdraft.security``)."""
    tokens = read_tokens(getattr(opts, "grpc_token_file", "") or None, TOKEN_ENV)
    return ClientSecurity(
        ca=getattr(opts, "grpc_tls_ca", "") or None,
        cert=getattr(opts, "grpc_tls_cert", "") or None,
        key=getattr(opts, "grpc_tls_key", "") or None,
        token=tokens[0] if tokens else None,
        insecure=bool(getattr(opts, "grpc_insecure", False)),
    )


def _failure(exc: grpc.RpcError) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    return RuntimeError(f"{code.name if code else 'ERROR'}: {detail}")


def _record(tokens: int, started: float, ttft: float | None, final: Any) -> None:
    """One finished generation; ``started``: its ``time.perf_counter()`` when the call began."""
    finished = time.perf_counter()
    seconds = finished - started
    row = {
        "tokens": float(tokens),
        "seconds": seconds,
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "started": started,
        "finished": finished,
    }
    if ttft is not None:
        row["ttft"] = ttft
    if final is not None and final.HasField("stats"):
        row["tau"] = final.stats.tau
    _generations.append(row)


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Per-generation tokens/s, TTFT and τ over the run (medians and p95), and the aggregate:
    every finished generation's tokens over the wall time from the first one's start to the last
    one's end (``bench --concurrency``'s figure, as the load test's users saw it)."""

    def pct(values: list[float], q: float) -> float:
        return percentile(values, q) if values else float("nan")

    tokens = sum(r["tokens"] for r in rows)
    out: dict[str, Any] = {"generations": len(rows), "tokens": int(tokens)}
    timed = [r for r in rows if "started" in r]
    wall = max(r["finished"] for r in timed) - min(r["started"] for r in timed) if timed else 0.0
    out["aggregate_tokens_per_second"] = tokens / wall if wall > 0 else float("nan")
    for key in ("tokens_per_second", "ttft", "tau"):
        values = [r[key] for r in rows if key in r]
        out[key] = {
            "mean": statistics.fmean(values) if values else float("nan"),
            "p50": pct(values, 0.5),
            "p95": pct(values, 0.95),
        }
    return out


@events.quitting.add_listener
def _report(environment: Environment, **_kw: Any) -> None:
    summary = summarize(_generations)
    text = json.dumps(summary, indent=2)
    print(f"generation summary: {text}")
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        path = Path(f"{prefix}_generation.json")
        atomic_write_text(path, text + "\n")
