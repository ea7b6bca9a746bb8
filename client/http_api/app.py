"""The OpenAI-compatible HTTP API (Starlette, served by uvicorn) over a ``Backend``.

=================================  ================================================================
``POST /v1/completions``           a prompt (text or token ids) → text; ``stream: true`` → SSE
``POST /v1/chat/completions``      chat messages through the model's template → an assistant message
``GET /v1/models``                 the served model
``GET /health``                    200 when the backend can generate, else 503
``GET /metrics``                   Prometheus text: the worker's metrics (``WorkerMetrics``)
=================================  ================================================================

Every answer other than 200 is OpenAI's error object (``ApiError``). A request is checked in
this order: the bearer token (401 with ``WWW-Authenticate: Bearer``, counted in
``specdraft_auth_refusals_total``), the body's size (413 past ``max_body_bytes``, counted while
it is read), its JSON and fields (400), the model (404), the parameters (400,
``schema.to_work_request``), then the backend's admission (429, 503). A stream starts only once
the first decode step has succeeded, so a refusal is always a status, never half a stream; a
failure after that ends the stream with ``data: {"error": ...}`` and ``data: [DONE]``.

The engine runs on the backend's threads; a client that goes away (mid-stream, or while waiting
for a whole answer) stops its generation at the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from client.http_api.backends import Backend, Delta, Event, Final
from client.http_api.schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    speculation,
    to_work_request,
    usage,
)
from llm_worker.metrics import WorkerMetrics
from specdraft.common import ThrottledWarning, shorten
from specdraft.security import ServerSecurity, tenant_namespace, token_matches

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
"""A request body past this is refused (413) as it is read: the gRPC worker's message limit."""

GRPC_STATUS = {
    400: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
"""HTTP statuses under the names the worker's metrics count them by (``specdraft_requests_total``)."""


_TYPE_TAG = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\])$")


def validation_error(exc: ValidationError) -> ApiError:
    """A body that does not parse as 400, naming the first field at fault.

    Example: ``{"prompt": "hi", "temperature": "hot"}`` → ``"temperature: Input should be a valid
    number, unable to parse string as a number"`` with ``param="temperature"``;
    ``{"prompt": "hi", "foo": 1}`` → ``"Unrecognized request argument supplied: foo"``.
    """
    first = exc.errors()[0]
    # a union's member (``str``, ``list[int]``) in the location says nothing to a client
    parts = [str(p) for p in first["loc"] if not _TYPE_TAG.match(str(p))]
    where = shorten(".".join(parts)) or "body"
    param = parts[0] if parts else None
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {where}", param=param)
    if first["type"] == "json_invalid":
        return ApiError(400, "the body is not valid JSON")
    return ApiError(400, f"{where}: {first['msg']}", param=param)


class Api:
    """The routes and the rules between them and the backend (a thin shell: the mapping is
    ``schema``, the generation is the backend's)."""

    def __init__(
        self,
        backend: Backend,
        security: ServerSecurity,
        metrics: WorkerMetrics,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.backend = backend
        self.security = security
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.started = now()
        self.refusal_log = ThrottledWarning(log, 10.0)

    # -- the checks before generating ------------------------------------------------------------

    def authorize(self, request: Request) -> str | None:
        """The caller's bearer token (None when the server checks none); 401 when it needs one
        and the call has none or a wrong one."""
        header = request.headers.get("authorization")
        token = None
        if header is not None:
            scheme, _, rest = header.partition(" ")
            token = rest.strip() if scheme.lower() == "bearer" else ""
        sec = self.security
        if not sec.tokens:
            return token or None
        if token and token_matches(token, sec.tokens + sec.admin_tokens):
            return token
        if token is None:
            reason = "this call needs a bearer token (Authorization: Bearer ...)"
        else:
            reason = "the bearer token is not valid here"
        self.metrics.auth_refusals.labels("client", "UNAUTHENTICATED").inc()
        peer = request.client.host if request.client else "?"
        self.refusal_log.warn("refused %s from %s: %s", request.url.path, peer, reason)
        raise ApiError(401, reason, code="invalid_api_key")

    async def body(self, request: Request, kind: type[BaseModel]) -> Any:
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(
                    413, f"the body is larger than this server's limit of {self.max_body_bytes} bytes"
                )
            chunks.append(chunk)
        try:
            return kind.model_validate_json(b"".join(chunks))
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def check_model(self, model: str | None) -> str:
        name = await self.backend.model_name()
        if model is not None and model != name:
            raise ApiError(
                404,
                f"The model {shorten(model)!r} does not exist (this server serves {name!r})",
                param="model",
                code="model_not_found",
            )
        return name

    # -- generation ------------------------------------------------------------------------------

    async def observed(
        self, events: AsyncGenerator[Event, None], mode: str, method: str
    ) -> AsyncGenerator[Event, None]:
        """``events`` as the worker's metrics count them: in flight, time to the first token,
        the result's statistics, and the request's status and time at the end (CANCELLED when
        the client went away before the result)."""
        began, status, first, done = time.perf_counter(), "OK", True, False
        self.metrics.in_flight.inc()
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Delta) and event.token_ids and first:
                        first = False
                        self.metrics.observe_first_token(mode, time.perf_counter() - began)
                    elif isinstance(event, Final):
                        done = True
                        self.metrics.observe_prompt(mode, event.prompt_tokens)
                        self.metrics.observe_result(mode, event.result.stats, event.result.finish_reason)
                    yield event
        except ApiError as exc:
            status = GRPC_STATUS.get(exc.status, "INTERNAL")
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = status if done else "CANCELLED"
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.observe_request(mode, method, status, time.perf_counter() - began)

    async def generate(self, request: Request, kind: type[CompletionBody] | type[ChatBody]) -> Response:
        token = self.authorize(request)
        body = await self.body(request, kind)
        model = await self.check_model(body.model)
        work = to_work_request(body)
        try:
            work = replace(work, tenant=tenant_namespace(work.tenant, token))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tenant") from None
        chat = kind is ChatBody
        events = self.observed(
            self.backend.stream(work), work.mode, "ChatCompletions" if chat else "Completions"
        )
        answer = Answer(new_id("chatcmpl" if chat else "cmpl"), model, chat)
        try:
            first = await anext(events)  # admission, validation, prefill: refusals are statuses
        except StopAsyncIteration:
            raise ApiError(500, "the generation ended without a result") from None
        except BaseException:
            await events.aclose()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                answer.sse(first, events, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        final = None
        async with contextlib.aclosing(events):
            event: Event | None = first
            while event is not None:
                final = event if isinstance(event, Final) else final
                if await request.is_disconnected():
                    raise ApiError(499, "the client went away")  # nobody reads it; the generation stops
                event = await anext(events, None)
        if final is None:
            raise ApiError(500, "the generation ended without a result")
        return JSONResponse(answer.whole(final))

    # -- the other routes ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, CompletionBody)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, ChatBody)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        name = await self.backend.model_name()
        card = {"id": name, "object": "model", "created": self.started, "owned_by": "specdraft"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        ok = await self.backend.healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def metrics_text(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class Answer:
    """One answer's id, model and shape (a completion, or a chat completion), whole or as SSE
    chunks as OpenAI sends them."""

    def __init__(self, answer_id: str, model: str, chat: bool) -> None:
        self.id = answer_id
        self.model = model
        self.chat = chat
        self.created = now()

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, final: Final) -> dict[str, Any]:
        content: dict[str, Any] = (
            {"message": {"role": "assistant", "content": final.text}} if self.chat else {"text": final.text}
        )
        choice = {
            "index": 0,
            **content,
            "logprobs": self.logprobs(final),
            "finish_reason": final.result.finish_reason,
            "stop_reason": final.result.stop_reason,
        }
        return {
            **self._envelope(chunk=False),
            "choices": [choice],
            "usage": final_usage(final),
            "specdraft": speculation(final.result),
        }

    def logprobs(self, final: Final) -> dict[str, Any] | None:
        pick = chat_logprobs if self.chat else completion_logprobs
        return pick(final.result, final.token_text)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        """A streamed piece: ``text`` (None: none, as the last chunk), the finish reason on the last."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        return {
            **self._envelope(chunk=True),
            "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}],
        }

    async def sse(
        self, first: Event, events: AsyncGenerator[Event, None], include_usage: bool
    ) -> AsyncIterator[str]:
        """``data: {...}`` per decode step, the finish reason and ``specdraft`` statistics on the
        last chunk, the usage after it (``stream_options.include_usage``), then ``data: [DONE]``."""

        def data(payload: dict[str, Any]) -> str:
            if include_usage and "usage" not in payload:
                payload["usage"] = None  # as OpenAI: null on every chunk but the usage chunk
            return f"data: {json.dumps(payload)}\n\n"

        async def with_first() -> AsyncGenerator[Event, None]:
            yield first
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event

        if self.chat:  # OpenAI's first chat chunk names the role
            yield data(self.chunk("", role=True))
        try:
            async with contextlib.aclosing(with_first()) as stream:
                async for event in stream:
                    if isinstance(event, Delta):
                        if event.text:
                            yield data(self.chunk(event.text))
                        continue
                    last = self.chunk(None, event.result.finish_reason)
                    # logprobs come whole with the last chunk (the steps' chunks carry none)
                    last["choices"][0]["logprobs"] = self.logprobs(event)
                    last["choices"][0]["stop_reason"] = event.result.stop_reason
                    last["specdraft"] = speculation(event.result)
                    yield data(last)
                    if include_usage:
                        tokens = final_usage(event)
                        yield data({**self._envelope(chunk=True), "choices": [], "usage": tokens})
        except ApiError as exc:
            yield data(exc.body())
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("stream failed (error id %s)", error_id)
            yield data(ApiError(500, f"internal error (id {error_id})").body())
        yield "data: [DONE]\n\n"


def final_usage(final: Final) -> dict[str, Any]:
    stats = final.result.stats
    return usage(final.prompt_tokens, len(final.result.token_ids), stats.cached_prompt_tokens)


def _error_response(exc: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def create_app(
    backend: Backend,
    security: ServerSecurity | None = None,
    metrics: WorkerMetrics | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Starlette:
    """The ASGI application of ``backend``; ``security.tokens`` are the bearer tokens accepted
    (none: no check); ``metrics``: the registry ``/metrics`` serves and requests are counted in."""
    api = Api(backend, security or ServerSecurity(), metrics or WorkerMetrics(), max_body_bytes)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error_response(ApiError(exc.status_code, str(exc.detail)))

    async def internal(request: Request, exc: Exception) -> Response:
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s on %s", error_id, request.url.path, exc_info=exc)
        return _error_response(ApiError(500, f"internal error (id {error_id}; details in the server log)"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[..., Any]] = {
        ApiError: api_error,
        HTTPException: http_error,
        Exception: internal,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.api = api
    return app
