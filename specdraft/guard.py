"""The interceptor in front of every servicer: who may call, what a malformed request gets, and
what an unexpected exception becomes.

- **Access.** Each service needs a role: ``client`` (the data plane: Generation, Datastore) or
  ``admin`` (DatastoreAdmin). Services without a role (health, reflection) stay open.
  ``client``: open when the server has no tokens; otherwise any accepted token (admin tokens
  too). ``admin``: an admin token, or a mutual-TLS client certificate whose name is on the allow
  list; never open. No credentials or a wrong token: UNAUTHENTICATED; a valid token of
  another role: PERMISSION_DENIED. Every refusal is counted (``refusals_counter``:
  ``specdraft_auth_refusals_total{role, status}``) and logged, at most one line every
  ``REFUSAL_LOG_SECONDS`` (the method, the peer and the reason; never a token).
- **Malformed requests** (bytes that do not parse, invalid UTF-8 in a string field):
  INVALID_ARGUMENT, before the servicer sees anything.
- **Unexpected exceptions**: INTERNAL with an opaque error id; the detail goes to the server log
  only (never UNKNOWN, never a path or an errno text).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import grpc
from prometheus_client import CollectorRegistry, Counter

from specdraft.common import ThrottledWarning
from specdraft.security import ServerSecurity, token_matches

log = logging.getLogger(__name__)

Role = Literal["client", "admin"]
Observer = Callable[[str, str], None]
"""Called with (method, status code name) for every call the guard itself ends."""
REFUSAL_LOG_SECONDS = 10.0
"""At most one log line of refused calls this often; the next line counts those held back."""


def refusals_counter(registry: CollectorRegistry) -> Counter:
    """``specdraft_auth_refusals_total{role, status}`` in ``registry``: calls the guard refused
    for their credentials, by the role the service needs (``client``, ``admin``) and the status
    (``UNAUTHENTICATED``, ``PERMISSION_DENIED``)."""
    return Counter(
        "specdraft_auth_refusals",
        "Calls refused for their credentials, by the role the service needs and the status",
        ["role", "status"],
        registry=registry,
    )


def _method_parts(full: str) -> tuple[str, str]:
    """``"/specdraft.v1.Datastore/Retrieve"`` → ``("specdraft.v1.Datastore", "Retrieve")``."""
    _, service, method = [*full.split("/"), "", ""][:3]
    return service, method


def bearer(context: grpc.aio.ServicerContext) -> str | None:
    """The call's bearer token: None without an ``authorization`` header, "" for another scheme."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _certificate_names(context: grpc.aio.ServicerContext) -> set[str]:
    auth = context.auth_context() or {}
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(v.decode("utf-8", "replace") for v in auth.get(key, ()))
    return names


class Guard(grpc.aio.ServerInterceptor):
    """Access, request parsing and opaque internal errors for the services in ``roles``."""

    def __init__(
        self,
        security: ServerSecurity,
        roles: Mapping[str, Role],
        observe: Observer | None = None,
        refusals: Counter | None = None,
    ) -> None:
        """``refusals``: the server's ``refusals_counter`` (None = counted nowhere)."""
        self.security = security
        self.roles = dict(roles)
        self.observe = observe
        self.refusals = refusals
        self.refusal_log = ThrottledWarning(log, REFUSAL_LOG_SECONDS)

    # -- access -------------------------------------------------------------------------------

    def refusal(self, role: Role, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        """Why the caller may not call a service of ``role`` (None: it may)."""
        sec = self.security
        token = bearer(context)
        if role == "client":
            if not sec.tokens or (token and token_matches(token, sec.tokens + sec.admin_tokens)):
                return None
        else:
            if token and sec.admin_tokens and token_matches(token, sec.admin_tokens):
                return None
            names = _certificate_names(context) if sec.ca else set()
            if sec.admin_names and names & set(sec.admin_names):
                return None
            if not sec.admin_tokens and not sec.admin_names:
                return grpc.StatusCode.PERMISSION_DENIED, (
                    "no admin identity is configured on this server (--admin-token-file or --admin-cert-name)"
                )
            if (token and token_matches(token, sec.tokens)) or (names and not token):
                return grpc.StatusCode.PERMISSION_DENIED, "this call needs the admin identity"
        if token is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "this call needs a bearer token (authorization: Bearer ...)",
            )
        return grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid here"

    # -- the interceptor ------------------------------------------------------------------------

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:  # unknown method: gRPC's own answer
            return handler
        service, method = _method_parts(details.method)  # type: ignore[attr-defined]
        role = self.roles.get(service)
        if handler.request_streaming:
            if role is None:  # reflection: open, gRPC's own
                return handler
            return self._refused_streaming(handler, method)  # not guarded here: closed, never open
        decode = handler.request_deserializer
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, decode, role, method),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, decode, role, method),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )

    def _refused_streaming(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A request-streaming method of a guarded service: the guard checks unary requests
        only, so such a method (none exists today) is refused rather than left without a check."""
        text = "request-streaming calls are not served by a guarded service"

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
            await self._end(context, method, grpc.StatusCode.UNIMPLEMENTED, text)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                refuse, request_deserializer=None, response_serializer=handler.response_serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            refuse, request_deserializer=None, response_serializer=handler.response_serializer
        )

    async def _end(
        self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, text: str
    ) -> None:
        if self.observe is not None:
            self.observe(method, code.name)
        await context.abort(code, text)

    async def _admit(
        self, raw: bytes, decode: Any, role: Role | None, method: str, context: grpc.aio.ServicerContext
    ) -> Any:
        """The parsed request of a caller who may make it (the call ends otherwise)."""
        if role is not None:
            refused = self.refusal(role, context)
            if refused is not None:
                code, reason = refused
                if self.refusals is not None:
                    self.refusals.labels(role, code.name).inc()
                self.refusal_log.warn("refused %s from %s: %s %s", method, context.peer(), code.name, reason)
                await self._end(context, method, code, reason)
        if decode is None:
            return raw
        try:
            return decode(raw)
        except Exception as exc:
            reason = "invalid UTF-8 in a string field" if "UTF-8" in str(exc) else "the bytes do not parse"
            await self._end(context, method, grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {reason}")

    async def _internal(self, context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s in %s", error_id, method, exc_info=exc)
        await self._end(
            context, method, grpc.StatusCode.INTERNAL, f"internal error (id {error_id} in the server log)"
        )

    def _unary(self, behavior: Any, decode: Any, role: Role | None, method: str) -> Any:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            request = await self._admit(raw, decode, role, method, context)
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._internal(context, method, exc)

        return call

    def _streaming(self, behavior: Any, decode: Any, role: Role | None, method: str) -> Any:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await self._admit(raw, decode, role, method, context)
            try:
                async for item in behavior(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._internal(context, method, exc)

        return call
