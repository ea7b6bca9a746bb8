"""The worker's gRPC server on a real loopback port: results, statuses, limits, shutdown."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client.cli import main
from client.grpc_client import GenerationClient, RequestOptions, build_request, response_to_json
from helpers.servers import ServerThread, free_port, scrape, tiny_worker, wait_until
from llm_worker.config import SamplingParams
from llm_worker.engine import GenerationRequest, StepOutput
from llm_worker.server import ServerConfig
from llm_worker.worker import Worker
from specdraft.stubs import generation_pb2, generation_pb2_grpc


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Worker:
    return tiny_worker(tiny_dir, "w-test")


def start(worker: Worker, **cfg: Any) -> ServerThread:
    return ServerThread(worker, ServerConfig(port=0, **cfg))


@pytest.fixture(scope="module")
def server(worker: Worker) -> Iterator[ServerThread]:
    srv = start(worker, max_concurrent=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def drop_timings(payload: dict[str, Any]) -> dict[str, Any]:
    out = dict(payload)
    out["stats"] = {k: v for k, v in payload["stats"].items() if "second" not in k}
    return out


@pytest.mark.parametrize("mode", ["ar", "pld", "pld+h"])
def test_unary_and_stream_equal_the_in_process_result(
    worker: Worker, server: ServerThread, mode: str
) -> None:
    text = "hello world hello world hello"
    opts = RequestOptions(mode=mode, max_new_tokens=40)
    local = worker.engine.generate(
        GenerationRequest(tuple(worker.encode(worker_request(text))), 40, mode, SamplingParams())
    )
    with GenerationClient([server.address]) as client:
        unary = client.generate(build_request(text=text, options=opts))
        chunks = list(client.generate_stream(build_request(text=text, options=opts)))
    assert list(unary.token_ids) == local.token_ids
    assert unary.mode == mode and unary.worker_id == "w-test"
    assert unary.stats.new_tokens == len(local.token_ids)
    streamed = [t for c in chunks if not c.HasField("final") for t in c.token_ids]
    assert streamed == local.token_ids
    assert chunks[-1].HasField("final") and list(chunks[-1].final.token_ids) == local.token_ids
    assert "".join(c.text for c in chunks) == unary.text


def worker_request(text: str) -> Any:
    from llm_worker.worker import WorkRequest

    return WorkRequest(text=text)


def test_sampling_with_a_seed_is_reproducible_over_grpc(server: ServerThread) -> None:
    opts = RequestOptions(mode="pld", max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    with GenerationClient([server.address]) as client:
        a = client.generate(build_request(chat=[("user", "hi")], options=opts))
        b = client.generate(build_request(chat=[("user", "hi")], options=opts))
    assert list(a.token_ids) == list(b.token_ids)


BAD_REQUESTS = {
    "empty text": (build_request(text=""), "the prompt is empty"),
    "no prompt": (generation_pb2.GenerateRequest(max_new_tokens=4), "exactly one prompt"),
    "unknown mode": (build_request(text="hi", options=RequestOptions(mode="nope")), "unknown mode 'nope'"),
    "bad option": (build_request(text="hi", options=RequestOptions(mode="pld:x=1")), "takes options"),
    # speculation off decodes plainly, but a mode it names must still be one (not silently ignored)
    "unknown mode, speculation off": (
        build_request(text="hi", options=RequestOptions(mode="nosuchmode:n=1", speculation_off=True)),
        "unknown mode 'nosuchmode'",
    ),
    "bad option, speculation off": (
        build_request(text="hi", options=RequestOptions(mode="pld:max_n=x", speculation_off=True)),
        "max_n='x' is not an integer",
    ),
    "token out of range": (build_request(token_ids=[1, 10**6]), "outside the vocabulary"),
    "too long": (build_request(text="hi", options=RequestOptions(max_new_tokens=5000)), "exceeds the model"),
    "top_p": (build_request(text="hi", options=RequestOptions(temperature=1.0, top_p=1.5)), "top_p"),
    "temperature": (build_request(text="hi", options=RequestOptions(temperature=-1.0)), "temperature"),
    "temperature inf": (build_request(text="hi", options=RequestOptions(temperature=float("inf"))), "finite"),
    "temperature nan": (build_request(text="hi", options=RequestOptions(temperature=float("nan"))), "finite"),
    "chat role": (build_request(chat=[("robot", "hi")]), "chat role"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    stub: generation_pb2_grpc.GenerationStub, case: str
) -> None:
    request, message = BAD_REQUESTS[case]
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert message in err.value.details(), err.value.details()
    ok = stub.Generate(
        build_request(text="still there?", options=RequestOptions(max_new_tokens=3)), timeout=30
    )
    assert len(ok.token_ids) >= 1


HUGE = 200_000
HUGE_INPUTS = {
    "mode": build_request(text="hi", options=RequestOptions(mode="x" * HUGE)),
    "option key": build_request(text="hi", options=RequestOptions(mode=f"pld:{'k' * HUGE}=1")),
    "option value": build_request(text="hi", options=RequestOptions(mode=f"pld:max_n={'9' * HUGE}")),
    "chat role": build_request(chat=[("r" * HUGE, "hi")]),
}


@pytest.mark.parametrize("case", list(HUGE_INPUTS))
def test_huge_input_is_invalid_argument_with_a_short_message(
    stub: generation_pb2_grpc.GenerationStub, case: str
) -> None:
    """A 200 000-character mode (or option, or chat role) is malformed input: INVALID_ARGUMENT,
    and the error text quotes only its start (echoed whole, it made the status trailer too large
    for the client, which saw RESOURCE_EXHAUSTED)."""
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(HUGE_INPUTS[case], timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.value.code())
        assert len(err.value.details()) < 300, err.value.details()[:300]
        assert "characters" in err.value.details()  # how long it was is said


def test_oversized_message_is_resource_exhausted(worker: Worker) -> None:
    srv = start(worker, max_message_bytes=64 * 1024)
    try:
        with GenerationClient([srv.address]) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(build_request(text="x" * 200_000))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(
                client.generate(build_request(text="ok", options=RequestOptions(max_new_tokens=2))).token_ids
            )
    finally:
        srv.stop()


def test_health_and_reflection(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specdraft.v1.Generation"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"specdraft.v1.Generation", "grpc.health.v1.Health"} <= names


def test_list_modes_and_model_info(server: ServerThread) -> None:
    with GenerationClient([server.address]) as client:
        modes = {m.name: m for m in client.list_modes().modes}
        info = client.model_info()
    assert {"ar", "pld", "pld+h", "pld+a"} <= set(modes)
    assert modes["pld"].available and not modes["pld+a"].available  # no head calibration for a random model
    assert "calibrate-heads" in modes["pld+a"].unavailable_reason
    assert info.worker_id == "w-test" and info.vocab_size > 0 and info.max_context == 1024


LONG = build_request(text="count", options=RequestOptions(max_new_tokens=900, ignore_eos=True))


def test_back_pressure_refuses_at_once_beyond_the_limit(worker: Worker) -> None:
    srv = start(worker, max_concurrent=1)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stream = stub.GenerateStream(LONG, timeout=60)
            next(stream)  # the first call is running
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(build_request(text="hi"), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # At once: refused while the first call still runs, not queued behind it.
            assert srv.server.servicer.active == 1
            assert not next(stream).HasField("final")
            stream.cancel()
    finally:
        srv.stop()


def test_deadline_and_cancellation_stop_decoding(worker: Worker, server: ServerThread) -> None:
    """The server stops decoding a call whose deadline passed or that was cancelled: it counts
    each under its own status, never as finished (OK), and lets go of both."""
    metrics = server.server.metrics.registry

    def count(method: str, status: str) -> float:
        labels = {"mode": "ar", "method": method, "status": status}
        return metrics.get_sample_value("specdraft_requests_total", labels) or 0.0

    def stopped(method: str) -> float:
        return count(method, "DEADLINE_EXCEEDED") + count(method, "CANCELLED")

    before = {m: (count(m, "OK"), stopped(m)) for m in ("Generate", "GenerateStream")}
    with grpc.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(LONG, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stream = stub.GenerateStream(LONG, timeout=60)
        next(stream)
        stream.cancel()
    for method, (ok, stopped_before) in before.items():
        wait_until(
            lambda m=method, n=stopped_before: stopped(m) > n, what=f"the server stops the {method} call"
        )
        assert count(method, "OK") == ok, f"the {method} call decoded to the end"
    wait_until(lambda: server.server.servicer.active == 0, what="the server lets go of both calls")


class _BlockingSteps:
    """An engine stream whose second step blocks until released; records how it was closed."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.closed: list[str] = []  # "closed", or the error close() raised
        self._inner = self._steps()

    def _steps(self) -> Iterator[StepOutput]:
        yield StepOutput([1])
        self.entered.set()
        self.release.wait(30)
        yield StepOutput([2])
        yield StepOutput([3])

    def __iter__(self) -> _BlockingSteps:
        return self

    def __next__(self) -> StepOutput:
        return next(self._inner)

    def close(self) -> None:
        try:
            self._inner.close()
        except Exception as exc:
            self.closed.append(repr(exc))
            raise
        self.closed.append("closed")


def test_a_call_cancelled_mid_step_closes_its_stream_once_the_step_returns(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that goes away while a step runs on the pool: the step cannot be interrupted, so
    the call stays active until it returns, and then its stream is closed (which frees its KV
    cache and leaves the batch) — not left for the garbage collector."""
    steps = _BlockingSteps()
    requests: list[GenerationRequest] = []
    monkeypatch.setattr(worker, "stream", lambda gen: requests.append(gen) or steps)
    srv = start(worker, max_concurrent=2)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stream = generation_pb2_grpc.GenerationStub(channel).GenerateStream(LONG, timeout=60)
            next(stream)
            assert steps.entered.wait(10)
            stream.cancel()
            time.sleep(0.3)
            assert srv.server.servicer.active == 1 and steps.closed == []  # the step still runs
            assert requests[0].cancel is not None and requests[0].cancel.is_set()  # a prefill would stop
            steps.release.set()
            wait_until(lambda: steps.closed != [], what="the stream is closed")
            assert steps.closed == ["closed"]
            wait_until(lambda: srv.server.servicer.active == 0, what="the server lets go of the call")
    finally:
        steps.release.set()
        srv.stop()


def test_a_cancelled_request_stops_its_prefill_at_the_next_chunk(worker: Worker) -> None:
    """The prefill of a long prompt is one step of many forwards: once the request's ``cancel``
    is set (the server sets it when the call ends), no further chunk runs."""
    from dataclasses import replace

    from llm_worker.engine import Engine, GenerationCancelled

    base = worker.engine
    engine = Engine(base.target, replace(base.config, prefill_chunk=4), curve=base.cost_curve)
    cancel = threading.Event()
    forwards = []
    forward = base.target.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        forwards.append(1)
        if len(forwards) == 2:
            cancel.set()  # the client goes away during the second chunk
        return forward(*args, **kwargs)

    prompt = tuple(range(1, 65))  # 16 chunks of 4
    try:
        base.target.forward = counted  # type: ignore[method-assign]
        steps = engine.stream(GenerationRequest(prompt, 8, "ar", cancel=cancel))
        with pytest.raises(GenerationCancelled, match="after 8 of 64"):
            next(steps)
    finally:
        base.target.forward = forward  # type: ignore[method-assign]
    assert len(forwards) == 2


def test_graceful_stop_finishes_calls_in_flight_and_refuses_new_ones(worker: Worker) -> None:
    srv = start(worker, max_concurrent=4)
    request = build_request(text="drain", options=RequestOptions(max_new_tokens=300, ignore_eos=True))
    with grpc.insecure_channel(srv.address) as channel, ThreadPoolExecutor(3) as pool:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [pool.submit(stub.Generate, request, timeout=60) for _ in range(3)]
        wait_until(lambda: srv.server.servicer.active == 3, what="the three calls are in flight")
        stopper = pool.submit(srv.stop, 30.0)
        results = [c.result() for c in calls]
        stopper.result()
    assert all(len(r.token_ids) == 300 for r in results)
    with grpc.insecure_channel(srv.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            generation_pb2_grpc.GenerationStub(channel).Generate(build_request(text="late"), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_fails_over_to_a_live_worker(server: ServerThread) -> None:
    dead = "127.0.0.1:1"  # nothing listens there
    with GenerationClient([dead, server.address], timeout=30) as client:
        resp = client.generate(build_request(text="hi", options=RequestOptions(max_new_tokens=3)))
        chunks = list(
            client.generate_stream(build_request(text="hi", options=RequestOptions(max_new_tokens=3)))
        )
    assert resp.worker_id == "w-test" and chunks[-1].HasField("final")


class _CancelsEverything(generation_pb2_grpc.GenerationServicer):
    """A worker that shut down while the calls waited for a handler: gRPC's core answers them
    CANCELLED, not UNAVAILABLE (grpc/grpc#41785)."""

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")


def test_client_fails_over_from_a_worker_that_cancelled_the_call_while_stopping(server: ServerThread) -> None:
    stopping = grpc.server(ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(_CancelsEverything(), stopping)
    port = stopping.add_insecure_port("127.0.0.1:0")
    stopping.start()
    try:
        with GenerationClient([f"127.0.0.1:{port}", server.address], timeout=30) as client:
            request = build_request(text="hi", options=RequestOptions(max_new_tokens=3))
            resp = client.generate(request)
            chunks = list(client.generate_stream(request))
    finally:
        stopping.stop(0)
    assert resp.worker_id == "w-test" and chunks[-1].HasField("final")


def test_cli_generate_with_server_prints_the_in_process_json(
    tiny_dir: Path, server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--mode", "pld", "--max-new-tokens", "20", "--json", "--chat", "hello hello"]
    assert main([*argv, "--model", str(tiny_dir)]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main([*argv, "--server", server.address]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert drop_timings(remote) == drop_timings(local)
    assert set(remote) == set(local)
    assert main(["generate", "--mode", "nope", "--server", server.address, "hi"]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_response_json_has_the_documented_keys(server: ServerThread) -> None:
    with GenerationClient([server.address]) as client:
        resp = client.generate(build_request(text="hi", options=RequestOptions(max_new_tokens=4)))
    payload = response_to_json(resp)
    assert {"text", "token_ids", "mode", "finish_reason", "prompt_tokens", "stats", "provenance"} == set(
        payload
    )


def test_sigterm_drains_a_real_worker_process_with_no_failed_calls(tiny_dir: Path) -> None:
    """... and says so on stderr: its start-up summary, then a line as it drains and one with the
    counts once it has stopped."""
    import signal
    import subprocess
    import sys

    metrics_port = free_port()
    cmd = [sys.executable, "-m", "client.cli", "serve", "worker", "--model", str(tiny_dir), "--port", "0"]
    cmd += ["--metrics-port", str(metrics_port)]
    proc = subprocess.Popen([*cmd, "--no-warm", "--grace-seconds", "30"], stderr=subprocess.PIPE, text=True)
    try:
        address = ""
        assert proc.stderr is not None
        startup = []
        for line in proc.stderr:
            startup.append(line)
            if "listening on" in line:
                address = line.rsplit(" ", 1)[-1].strip()
                break
        assert address, "the worker did not start"
        request = build_request(text="drain", options=RequestOptions(max_new_tokens=300, ignore_eos=True))
        with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(3) as pool:
            stub = generation_pb2_grpc.GenerationStub(channel)
            calls = [pool.submit(stub.Generate, request, timeout=60) for _ in range(3)]
            in_flight = "specdraft_num_requests_running 3.0"
            wait_until(lambda: in_flight in scrape(metrics_port), what="the three calls are in flight")
            proc.send_signal(signal.SIGTERM)
            results = [c.result() for c in calls]  # raises if any call failed
        assert [len(r.token_ids) for r in results] == [300, 300, 300]
        assert proc.wait(60) == 0
        summary = "".join(startup)
        assert "serving on 127.0.0.1:" in summary and "no token check" in summary, summary
        assert "modes: ar, " in summary and "datastore: none" in summary, summary
        rest = proc.stderr.read()
        assert "draining: 3 generations running" in rest, rest
        assert "stopped: 3 generations served, 900 tokens" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_grpc_reports_overhead_per_call_and_per_token(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench-grpc", "--server", server.address, "--calls", "3", "--max-new-tokens", "4"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calls"] == 3 and report["new_tokens"] == 4
    for key in ("unary_overhead_ms", "stream_overhead_ms_per_token"):
        assert set(report[key]) == {"median", "p99", "mean"}
        assert report[key]["median"] <= report[key]["p99"]


def test_bench_grpc_starts_a_worker_that_admits_its_highest_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``--server`` the worker it starts admits as many generations as the highest
    concurrency asks for (the default of 4 would refuse the fifth user of ``--concurrency 8``)."""
    from client import stack
    from client.bench import grpc_concurrency

    started: list[tuple[str, ...]] = []

    def up(cfg: stack.StackConfig, state: Path) -> None:
        started.append(cfg.worker_args)
        raise RuntimeError("not started")

    monkeypatch.setattr(stack, "up", up)
    with pytest.raises(RuntimeError, match="not started"):
        grpc_concurrency.run_grpc_concurrency_new_worker(["--dtype", "bfloat16"], ["hi"], ["ar"], [1, 8], 4)
    assert started == [("--dtype", "bfloat16", "--max-concurrent", "8")]


def test_a_batching_worker_shares_forwards_and_answers_as_alone(
    worker: Worker, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The worker as ``serve worker`` runs it (continuous batching): concurrent streamed and unary
    calls of several modes equal the unbatched in-process results, the forwards were shared, and
    /metrics reports requests per forward and draft tokens per step; ``bench-grpc --concurrency``
    against it reports the documented figures."""
    from llm_worker.batching import BatchingConfig
    from llm_worker.engine import Engine

    engine = Engine(
        worker.engine.target, worker.engine.config, curve=worker.engine.cost_curve, batching=BatchingConfig()
    )
    batched = Worker(engine, worker.tokenizer, worker_id="w-batch")
    port = free_port()
    srv = start(batched, max_concurrent=6, metrics_port=port)
    texts = [f"hello world {i} hello world {i} hello" for i in range(6)]
    modes = ["ar", "pld", "pld+h"] * 2
    try:

        def call(i: int) -> list[int]:
            opts = RequestOptions(mode=modes[i], max_new_tokens=32)
            with GenerationClient([srv.address]) as client:
                if i % 2:
                    return list(client.generate(build_request(text=texts[i], options=opts)).token_ids)
                chunks = list(client.generate_stream(build_request(text=texts[i], options=opts)))
                return list(chunks[-1].final.token_ids)

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(call, range(6)))
        for i, ids in enumerate(got):
            req = GenerationRequest(
                tuple(worker.encode(worker_request(texts[i]))), 32, "ar", SamplingParams()
            )
            assert ids == worker.engine.generate(req).token_ids, i
        assert engine.scheduler is not None and engine.scheduler.mean_batch_size > 1.0
        text = scrape(port)
        assert "specdraft_batch_requests_count" in text and "specdraft_draft_tokens_per_step_count" in text

        # bench-grpc --concurrency against it: the documented figures, as a client sees them
        argv = ["bench-grpc", "--server", srv.address, "--metrics", f"http://127.0.0.1:{port}/metrics"]
        questions = tmp_path / "questions.jsonl"
        questions.write_text(
            "".join(
                json.dumps({"question_id": i, "category": "copy", "turns": [texts[i]]}) + "\n"
                for i in range(4)
            )
        )
        argv += ["--concurrency", "1,3", "--modes", "ar,pld", "--questions", str(questions)]
        argv += ["--limit", "3", "--max-new-tokens", "6"]
        assert main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["questions"] == 3 and report["max_new_tokens"] == 6
        for mode in ("ar", "pld"):
            by_level = report["modes"][mode]["concurrency"]
            assert set(by_level) == {"1", "3"}
            for figures in by_level.values():
                assert set(GRPC_FIGURES) <= set(figures), mode
                assert figures["identical_to_ar"] is True and figures["new_tokens"] == 18
                assert figures["latency_p50_seconds"] <= figures["latency_p95_seconds"]
            assert by_level["3"]["mean_batch_size"] >= 1.0
    finally:
        srv.stop()
        engine.close()


GRPC_FIGURES = (
    "aggregate_tokens_per_second",
    "latency_p50_seconds",
    "latency_p95_seconds",
    "ttft_p50_seconds",
    "ttft_p95_seconds",
    "mean_batch_size",
    "draft_tokens_per_request_step",
    "identical_to_ar",
)


VLLM_ALIGNED = (
    "specdraft_prompt_tokens_total",
    "specdraft_generation_tokens_total",
    "specdraft_request_queue_time_seconds_bucket",
    "specdraft_time_to_first_token_seconds_bucket",
    "specdraft_e2e_request_latency_seconds_bucket",
    "specdraft_request_success_total",
    "specdraft_spec_decode_num_draft_tokens_total",
    "specdraft_spec_decode_num_accepted_tokens_total",
    "specdraft_num_requests_running",
    "specdraft_num_requests_waiting",
    "specdraft_kv_cache_usage_perc",
    "specdraft_model_info{",
)


def test_metrics_aligned_with_vllm_move_with_requests_and_have_no_created_twins(worker: Worker) -> None:
    """Prompt tokens, queue time, time to first token, KV-cache usage and the model's description
    under vLLM's names; a request moves them; no series has a ``_created`` twin."""
    srv = start(worker, metrics_port=0)
    registry = srv.server.metrics.registry

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    try:
        assert worker.engine.target.kv_cache_usage() is not None  # the tiny model's fast target pools
        options = RequestOptions(mode="pld", max_new_tokens=40, ignore_eos=True)
        with GenerationClient([srv.address]) as client:
            request = build_request(text="one two three one two three", options=options)
            stream = client.generate_stream(request)
            next(stream)  # the first step ran: the request holds a slot of the KV pool
            assert value("specdraft_kv_cache_usage_perc") > 0
            assert value("specdraft_num_requests_running") == 1
            final = next(c for c in stream if c.HasField("final")).final
        wait_until(
            lambda: value("specdraft_request_success_total", mode="pld", finished_reason="length") == 1,
            what="the request is counted",
        )
        # The latency histogram is observed when the RPC handler exits, which may come after the
        # client has read the final message.
        wait_until(
            lambda: (
                value("specdraft_e2e_request_latency_seconds_count", mode="pld", method="GenerateStream") == 1
            ),
            what="the request's latency is observed",
        )
        assert value("specdraft_prompt_tokens_total", mode="pld") == final.prompt_tokens > 0
        assert value("specdraft_generation_tokens_total", mode="pld") == 40
        assert value("specdraft_request_queue_time_seconds_count", mode="pld") == 1
        assert value("specdraft_time_to_first_token_seconds_count", mode="pld") == 1
        assert value("specdraft_spec_decode_num_draft_tokens_total", mode="pld") == final.stats.drafted_tokens
        assert value("specdraft_num_requests_waiting") == 0
        port = srv.server.metrics_port
        assert port is not None
        body = scrape(port)
    finally:
        srv.stop()
    missing = [name for name in VLLM_ALIGNED if name not in body]
    assert not missing, missing
    assert "_created" not in body
    info = worker.model_info
    model_line = next(line for line in body.splitlines() if line.startswith("specdraft_model_info{"))
    for label in (f'model="{info.name}"', f'dtype="{info.dtype}"', f'device="{info.device}"', "kernels="):
        assert label in model_line, model_line


def test_a_busy_worker_logs_a_throughput_line_every_interval(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="llm_worker.server"):
        srv = start(worker, log_interval_seconds=0.2)
        try:
            assert f"worker {worker.worker_id} serving on 127.0.0.1:{srv.server.port}" in caplog.text
            with GenerationClient([srv.address]) as client:
                options = RequestOptions(max_new_tokens=6, ignore_eos=True)
                client.generate(build_request(text="hello", options=options))

            def throughput() -> str:
                lines = [r.getMessage() for r in caplog.records if "1 request finished" in r.getMessage()]
                return lines[0] if lines else ""

            line = wait_until(throughput, 10, what="a throughput line")
        finally:
            srv.stop()
    assert line.startswith("1 request finished in 0 s, 6 tokens (") and "τ " in line, line
    assert line.endswith("0 running, 0 waiting"), line
