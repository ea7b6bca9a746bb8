"""The OpenAI-compatible HTTP front end (``specdraft serve http``) on a real uvicorn server on
loopback, called with the official ``openai`` client and plain ``httpx``: answers equal to
``ar``'s and to the gRPC worker's in every mode the tiny model runs, streaming, statuses in
OpenAI's error shape, limits, cancellation, tokens, TLS, a pool of gRPC workers, the CLI and the
README's examples."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from client.grpc_client import GenerationClient, RequestOptions, build_request
from client.http_api.backends import Event, InProcessBackend, Limits, WorkerPool
from helpers.docblocks import ROOT, blocks
from helpers.http_server import HttpThread
from helpers.servers import ServerThread, free_port, tiny_worker, wait_until
from helpers.tls import make_certificates
from llm_worker.registry import InProcessRegistry
from llm_worker.server import ServerConfig
from llm_worker.worker import Worker, WorkRequest
from specdraft.security import ServerSecurity, tenant_namespace

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The name the in-process servers here serve (the README's examples name it)."""
TOKEN = "http-test-token-0123456789abcdef"
PROMPT = "hello world hello world hello world"
CHAT = [{"role": "user", "content": "Repeat: one two three, one two three."}]


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Worker:
    return tiny_worker(tiny_dir, "w-http")


@pytest.fixture(scope="module")
def http(worker: Worker) -> Iterator[HttpThread]:
    server = HttpThread(InProcessBackend(worker, Limits(max_concurrent=4), name=MODEL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def grpc_worker(worker: Worker) -> Iterator[ServerThread]:
    server = ServerThread(worker, ServerConfig(port=0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pool(grpc_worker: ServerThread) -> Iterator[HttpThread]:
    server = HttpThread(WorkerPool([grpc_worker.address]))
    yield server
    server.stop()


def client(server: HttpThread, key: str = "unused", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60, **kw)


def served(server: HttpThread) -> str:
    return client(server).models.list().data[0].id


def complete(server: HttpThread, mode: str, stream: bool = False) -> tuple[str, int, str]:
    """(text, completion tokens, the mode that ran) of ``PROMPT``, greedy, 24 tokens."""
    extra = {"mode": mode}
    c = client(server)
    if not stream:
        r = c.completions.create(
            model=served(server), prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra
        )
        assert r.usage is not None
        return r.choices[0].text, r.usage.completion_tokens, r.specdraft["mode"]  # type: ignore[attr-defined]
    chunks = list(
        c.completions.create(
            model=served(server),
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count(None) == len(chunks) - 2
    last = chunks[-2]
    return (
        "".join(c.choices[0].text for c in chunks[:-1]),
        chunks[-1].usage.completion_tokens,
        last.specdraft["mode"],
    )  # type: ignore[attr-defined]


def chat(server: HttpThread, mode: str, stream: bool = False) -> str:
    c = client(server)
    if not stream:
        r = c.chat.completions.create(
            model=served(server), messages=CHAT, max_tokens=24, temperature=0, extra_body={"mode": mode}
        )  # type: ignore[arg-type]
        assert r.choices[0].message.role == "assistant"
        return r.choices[0].message.content or ""
    chunks = list(
        c.chat.completions.create(
            model=served(server),
            messages=CHAT,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"mode": mode},
        )  # type: ignore[arg-type]
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    return "".join(c.choices[0].delta.content or "" for c in chunks)


# -- every mode equals ar, whole and streamed, in process and through a gRPC worker ----------------


def test_every_mode_answers_as_ar_through_http_and_grpc(
    worker: Worker, http: HttpThread, pool: HttpThread, grpc_worker: ServerThread
) -> None:
    modes = worker.available_modes()
    assert {"ar", "pld", "suffix"} <= set(modes), modes
    reference = complete(http, "ar")
    chat_reference = chat(http, "ar")
    assert reference[1] == 24 and reference[0] and chat_reference
    with GenerationClient([grpc_worker.address]) as grpc_client:
        for mode in modes:
            options = RequestOptions(mode=mode, max_new_tokens=24)
            over_grpc = grpc_client.generate(build_request(text=PROMPT, options=options))
            assert (over_grpc.text, len(over_grpc.token_ids), over_grpc.mode) == (*reference[:2], mode)
            assert complete(http, mode) == (*reference[:2], mode), mode
            assert complete(pool, mode) == (*reference[:2], mode), mode
            assert chat(http, mode) == chat_reference, mode
            assert chat(pool, mode) == chat_reference, mode
    for server in (http, pool):
        assert complete(server, "pld", stream=True) == (*reference[:2], "pld")
        assert chat(server, "pld", stream=True) == chat_reference


def test_the_answers_have_openais_fields_and_the_speculation_stats(http: HttpThread) -> None:
    r = httpx.post(
        f"{http.url}/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, "mode": "pld"}
    ).json()
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion" and r["model"] == MODEL
    assert abs(r["created"] - time.time()) < 60
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["index"] == 0
    assert r["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 16
    stats = r["specdraft"]
    assert stats["mode"] == "pld" and stats["new_tokens"] == 16 and stats["tau"] >= 1.0
    assert {"drafted_tokens", "accepted_tokens", "acceptance_rate", "target_forwards"} <= set(stats)
    c = client(http).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion"
    plain = httpx.post(
        f"{http.url}/completions", json={"prompt": PROMPT, "mode": "pld", "speculation_off": True}
    )
    assert plain.json()["specdraft"]["mode"] == "ar"
    answers = [
        httpx.post(
            f"{http.url}/chat/completions",
            json={
                "messages": [{"role": role, "content": "Be brief."}, *CHAT],
                "max_tokens": 6,
                "temperature": 0,
            },
        ).json()["choices"][0]["message"]["content"]
        for role in ("system", "developer")
    ]
    assert answers[0] == answers[1]  # OpenAI's "developer" is the template's "system"
    models = client(http).models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "specdraft")]
    assert httpx.get(f"{http.base}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{http.base}/metrics").text
    assert 'specdraft_requests_total{method="Completions",mode="pld",status="OK"}' in metrics
    assert 'specdraft_generation_tokens_total{mode="pld"}' in metrics


def test_sampling_with_a_seed_is_reproducible(http: HttpThread) -> None:
    def sample() -> str:
        r = client(http).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0.9,
            top_p=0.95,
            seed=7,
            extra_body={"top_k": 40},
        )
        return r.choices[0].text

    assert sample() == sample()


# -- refusals ------------------------------------------------------------------------------------

BAD = {
    "unknown field": (
        "completions",
        {"prompt": "hi", "foo": 1},
        "Unrecognized request argument supplied: foo",
        "foo",
    ),
    "wrong type": (
        "completions",
        {"prompt": "hi", "temperature": "hot"},
        "temperature: Input should be",
        "temperature",
    ),
    "unknown mode": ("completions", {"prompt": "hi", "mode": "nope"}, "unknown mode 'nope'", None),
    "mode option": ("completions", {"prompt": "hi", "mode": "pld:x=1"}, "takes options", None),
    "stop": ("completions", {"prompt": "hi", "stop": [""]}, "a stop string is empty", None),
    "logprobs": ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", None),
    "penalty": ("completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", None),
    "seed": ("completions", {"prompt": "hi", "seed": -1}, "seed: must be in [0, 2**64)", "seed"),
    "draft_budget": (
        "completions",
        {"prompt": "hi", "draft_budget": -1},
        "draft_budget and max_new_tokens",
        None,
    ),
    "n": ("completions", {"prompt": "hi", "n": 2}, "only n=1", "n"),
    "echo": ("completions", {"prompt": "hi", "echo": True}, "echo: not supported", "echo"),
    "batch": ("completions", {"prompt": ["a", "b"]}, "one prompt per request (got 2)", "prompt"),
    "too long": ("completions", {"prompt": "hi", "max_tokens": 5000}, "exceeds the model", None),
    "max_tokens": (
        "completions",
        {"prompt": "hi", "max_tokens": 0},
        "max_tokens: must be >= 1",
        "max_tokens",
    ),
    "temperature": ("completions", {"prompt": "hi", "temperature": -1}, "temperature", None),
    "empty": ("completions", {"prompt": ""}, "the prompt is empty", None),
    "token ids": ("completions", {"prompt": [1, 10**6]}, "outside the vocabulary", None),
    "tenant": ("completions", {"prompt": "hi", "tenant": "\x01"}, "tenant must be printable ASCII", "tenant"),
    "role": (
        "chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        "chat role 'robot'",
        None,
    ),
    "tools": (
        "chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        "tools and function",
        "tools",
    ),
    "top_logprobs": (
        "chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        "top_logprobs: needs logprobs: true",
        "top_logprobs",
    ),
    "image": (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "only text parts are supported, not 'image_url'",
        "messages[0].content[0]",
    ),
    "no messages": (
        "chat/completions",
        {"messages": []},
        "messages: List should have at least 1 item",
        "messages",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_400_in_openais_shape_and_the_server_keeps_serving(http: HttpThread, case: str) -> None:
    path, body, message, param = BAD[case]
    r = httpx.post(f"{http.url}/{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert message in error["message"], error["message"]
    assert error["param"] == param
    assert complete(http, "ar")[1] == 24


def test_the_openai_client_sees_the_statuses(http: HttpThread) -> None:
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client(http).completions.create(model=MODEL, prompt="hi", n=2)
    with pytest.raises(openai.NotFoundError) as err:
        client(http).completions.create(model="gpt-4", prompt="hi")
    assert err.value.code == "model_not_found" and "gpt-4" in err.value.message
    bad_json = httpx.post(f"{http.url}/completions", content=b"{not json", timeout=10)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["message"] == "the body is not valid JSON"
    huge = httpx.post(f"{http.url}/completions", content=b" " * (5 * 1024 * 1024), timeout=30)
    assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]
    assert httpx.get(f"{http.base}/v2/nothing").json()["error"]["type"] == "invalid_request_error"


# -- limits and cancellation ---------------------------------------------------------------------

LONG = {"model": MODEL, "prompt": "hi", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def test_the_limit_is_429_and_a_client_gone_mid_stream_frees_its_slot(worker: Worker) -> None:
    backend = InProcessBackend(worker, Limits(max_concurrent=1), name=MODEL)
    server = HttpThread(backend)
    try:
        with httpx.stream(
            "POST", f"{server.url}/completions", json={**LONG, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a closed line iterator closes the connection
            first = next(lines)
            assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
            busy = httpx.post(f"{server.url}/completions", json={**LONG, "max_tokens": 2}, timeout=60)
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["type"] == "rate_limit_error"
            assert "limit of 1 concurrent" in busy.json()["error"]["message"]
        # the stream is closed long before its 900 tokens: the generation stops and frees the slot
        wait_until(lambda: backend.active == 0, 20, what="the abandoned stream's slot is freed")
        with pytest.raises(httpx.ReadTimeout):  # a whole answer abandoned while it decodes
            httpx.post(f"{server.url}/completions", json=LONG, timeout=1.0)
        wait_until(lambda: backend.active == 0, 20, what="the abandoned request's slot is freed")
        ok = httpx.post(f"{server.url}/completions", json={**LONG, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(f"{server.base}/metrics").text
        assert 'method="Completions",mode="ar",status="CANCELLED"} 2.0' in metrics
        assert 'status="RESOURCE_EXHAUSTED"} 1.0' in metrics
        assert "specdraft_num_requests_running 0.0" in metrics
    finally:
        server.stop()


def test_a_client_gone_mid_stream_stops_the_grpc_workers_generation(
    pool: HttpThread, grpc_worker: ServerThread
) -> None:
    def cancelled() -> float:
        labels = {"mode": "ar", "method": "GenerateStream", "status": "CANCELLED"}
        return grpc_worker.server.metrics.registry.get_sample_value("specdraft_requests_total", labels) or 0.0

    before = cancelled()
    body = {**LONG, "model": served(pool), "stream": True}
    with httpx.stream("POST", f"{pool.url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until(lambda: grpc_worker.server.servicer.active == 0, 20, what="the worker's generation ends")
    wait_until(lambda: cancelled() == before + 1, 10, what="the worker counts the call cancelled")


def test_a_generation_past_its_time_limit_is_504_or_an_error_event(worker: Worker) -> None:
    server = HttpThread(InProcessBackend(worker, Limits(max_generation_seconds=0.0), name=MODEL))
    try:
        r = httpx.post(f"{server.url}/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        with httpx.stream(
            "POST", f"{server.url}/completions", json={**LONG, "max_tokens": 8, "stream": True}
        ) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert (
            "ran past this server's limit" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
        )
    finally:
        server.stop()


# -- tokens and TLS ------------------------------------------------------------------------------


class Recording:
    """A backend that records the requests it is given and passes them on."""

    def __init__(self, inner: InProcessBackend) -> None:
        self.inner = inner
        self.works: list[WorkRequest] = []

    async def model_name(self) -> str:
        return await self.inner.model_name()

    def stream(self, work: WorkRequest) -> AsyncGenerator[Event, None]:
        self.works.append(work)
        return self.inner.stream(work)

    async def healthy(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self.inner.close()


def test_bearer_tokens_are_checked_and_name_the_tenant(worker: Worker) -> None:
    backend = Recording(InProcessBackend(worker, name=MODEL))
    server = HttpThread(backend, ServerSecurity(tokens=(TOKEN,)))
    try:
        with pytest.raises(openai.AuthenticationError):
            client(server, key="wrong-token-0123456789abcdef").models.list()
        missing = httpx.post(f"{server.url}/completions", json={"prompt": "hi"})
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["type"] == "authentication_error"
        assert "needs a bearer token" in missing.json()["error"]["message"]
        assert backend.works == []  # refused before anything else
        r = client(server, key=TOKEN).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"mode": "suffix", "tenant": "team-a"}
        )
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert backend.works[-1].tenant == tenant_namespace("team-a", TOKEN) != "team-a"
        assert httpx.get(f"{server.base}/health").status_code == 200  # open, as gRPC health
        refusals = 'specdraft_auth_refusals_total{role="client",status="UNAUTHENTICATED"} 2.0'
        assert refusals in httpx.get(f"{server.base}/metrics").text
    finally:
        server.stop()


def test_https_and_mutual_tls(worker: Worker, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    trusting = ssl.create_default_context(cafile=certs.ca)
    tls = ServerSecurity(cert=certs.server.cert, key=certs.server.key)
    server = HttpThread(InProcessBackend(worker, name=MODEL), tls)
    try:
        assert server.url.startswith("https://")
        c = client(server, http_client=httpx.Client(verify=trusting))
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3  # type: ignore[union-attr]
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"{server.base}/health")
    finally:
        server.stop()
    mutual = ServerSecurity(cert=certs.server.cert, key=certs.server.key, ca=certs.ca)
    server = HttpThread(InProcessBackend(worker, name=MODEL), mutual)
    try:
        with pytest.raises(httpx.TransportError):  # no client certificate
            httpx.get(f"{server.base}/health", verify=trusting)
        with_cert = ssl.create_default_context(cafile=certs.ca)
        client_pem = certs.clients["worker.specdraft"]
        with_cert.load_cert_chain(client_pem.cert, client_pem.key)
        assert httpx.get(f"{server.base}/health", verify=with_cert).status_code == 200
    finally:
        server.stop()


# -- in front of gRPC workers --------------------------------------------------------------------


def test_a_pool_from_the_registry_goes_round_robin(worker: Worker, tiny_dir: Path) -> None:
    registry = InProcessRegistry(ttl=30)
    other = tiny_worker(tiny_dir, "w-http-2")
    grpc_servers = [ServerThread(w, ServerConfig(port=0), registry=registry) for w in (worker, other)]
    server = HttpThread(WorkerPool(registry=registry, name=MODEL))
    try:
        reference = complete(server, "ar")
        for _ in range(3):
            assert complete(server, "pld")[:2] == reference[:2]
        labels = {"mode": "pld", "method": "GenerateStream", "status": "OK"}
        counts = [
            s.server.metrics.registry.get_sample_value("specdraft_requests_total", labels)
            for s in grpc_servers
        ]
        assert counts == [2.0, 1.0] or counts == [1.0, 2.0], counts
        assert httpx.get(f"{server.base}/health").status_code == 200
    finally:
        server.stop()
        for s in grpc_servers:
            s.stop()


def test_a_pool_without_a_live_worker_is_503(tmp_path: Path) -> None:
    server = HttpThread(WorkerPool([f"127.0.0.1:{free_port()}"], name=MODEL))
    try:
        r = httpx.post(f"{server.url}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{server.base}/health").status_code == 503
        too_big = httpx.post(
            f"{server.url}/completions", json={"prompt": "hi", "max_tokens": 2**40}, timeout=60
        )
        assert too_big.status_code == 400 and "out of range" in too_big.json()["error"]["message"]
    finally:
        server.stop()
    empty = HttpThread(WorkerPool(registry=InProcessRegistry(), name=MODEL))
    try:
        r = httpx.post(f"{empty.url}/completions", json={"prompt": "hi", "mode": "pld"}, timeout=60)
        assert r.status_code == 503 and "no live worker serves mode 'pld'" in r.json()["error"]["message"]
    finally:
        empty.stop()


# -- the command line and the README ---------------------------------------------------------------


def test_specdraft_serve_http_serves_until_sigterm(tiny_dir: Path) -> None:
    argv = [sys.executable, "-m", "client.cli", "serve", "http", "--model", str(tiny_dir), "--port", "0"]
    argv += ["--no-warm", "--served-model-name", "tiny", "--max-concurrent", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stderr is not None
        line = ""
        while "listening on" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited before listening"
        url = line.split("listening on ")[1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.completion_tokens == 5
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text  # the engine's own series too
        assert 'method="ChatCompletions",mode="ar",status="OK"} 1.0' in metrics
        assert (
            "specdraft_drafts_dropped_untrusted" in metrics and "specdraft_iteration_tokens_total" in metrics
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_http_refuses_options_that_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    from client.cli import main

    assert main(["serve", "http", "--health-port", "0"]) == 2
    assert "--health-port is for the gRPC servers" in capsys.readouterr().err
    assert (
        main(["serve", "http", "--workers", "127.0.0.1:1", "--registry", "redis://client@127.0.0.1:1/0"]) == 2
    )
    assert "not both" in capsys.readouterr().err
    assert main(["serve", "http", "--host", "0.0.0.0"]) == 2
    assert "refusing to serve HTTP in plaintext on 0.0.0.0" in capsys.readouterr().err


def _readme_example(language: str, needle: str) -> str:
    found = [b.code for b in blocks(ROOT / "README.md") if b.language == language and needle in b.code]
    assert len(found) == 1, f"README.md: one {language} block with {needle!r}"
    return found[0]


def test_the_readme_http_examples_run(http: HttpThread) -> None:
    """The README's ``curl`` and ``openai`` examples, as written, against a server of the tiny
    model serving under the default model's name (on this test's port instead of 8000)."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    here = f"127.0.0.1:{http.port}"
    curl = _readme_example("sh", "curl").replace("127.0.0.1:8000", here)
    done = subprocess.run(["bash", "-e", "-c", curl], capture_output=True, text=True, timeout=60, check=True)
    answer = json.loads(done.stdout)
    assert answer["choices"][0]["message"]["content"] and answer["specdraft"]["mode"] == "pld"
    python = _readme_example("python", "from openai import OpenAI").replace("127.0.0.1:8000", here)
    done = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "| tau" in done.stdout


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_answers_as_ar_over_http(real_model: tuple[Any, Any]) -> None:
    from helpers.models import engine_for

    target, tokenizer = real_model
    server = HttpThread(InProcessBackend(Worker(engine_for(target), tokenizer), name=MODEL))
    try:
        c = client(server)
        messages = [
            {
                "role": "user",
                "content": "Repeat this line twice: the quick brown fox jumps over the lazy dog.",
            }
        ]
        answers = {
            mode: c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=32, temperature=0, extra_body={"mode": mode}
            )  # type: ignore[arg-type]
            for mode in ("ar", "pld", "suffix")
        }
        texts = {mode: a.choices[0].message.content for mode, a in answers.items()}
        assert texts["ar"] and len(set(texts.values())) == 1, texts
        assert answers["pld"].specdraft["tau"] > 1.0  # type: ignore[attr-defined]
    finally:
        server.stop()


def test_stop_logprobs_and_penalties_through_the_openai_client(http: HttpThread) -> None:
    """A stop string cut out of ``ar``'s own answer ends every mode's answer where ``ar``'s
    ends, whole and streamed (no chunk shows it), with ``ar``'s logprobs; usage counts the
    prompt tokens the prefix cache supplied."""
    c = client(http)
    base = {"model": served(http), "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    penalised = {"ignore_eos": True, "repetition_penalty": 1.1}
    text = c.completions.create(**base, extra_body=penalised).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    answers = {}
    for mode in ("ar", "pld", "suffix"):
        extra = {"mode": mode, **penalised}
        r = c.completions.create(**base, stop=[stop], logprobs=2, extra_body=extra)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and stop not in choice.text
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) >= 1
        answers[mode] = (choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)
        streamed = "".join(
            chunk.choices[0].text
            for chunk in c.completions.create(**base, stop=[stop], stream=True, extra_body=extra)
            if chunk.choices
        )
        assert streamed == choice.text
    assert answers["pld"] == answers["ar"] and answers["suffix"] == answers["ar"]
    chat = c.chat.completions.create(
        model=served(http), messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(entry.top_logprobs) == 3 for entry in content)
    again = c.chat.completions.create(model=served(http), messages=CHAT, max_tokens=2, temperature=0)
    details = again.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.cached_tokens is not None
