"""Transport security every gRPC server and client shares: TLS and mutual TLS from PEM files,
bearer tokens, and the rule that decides when plaintext is allowed.

Servers
    ``ServerSecurity`` holds the PEM files (``--tls-cert --tls-key``; ``--tls-ca`` also asks every
    client for a certificate signed by that CA: mutual TLS) and the bearer tokens it accepts.
    ``listen`` binds a port with them. Plaintext without a token check is allowed on loopback
    only; any other address needs ``insecure=True`` (``--insecure``) and logs a warning.
Clients
    ``ClientSecurity`` holds the CA that signs the servers' certificates, the client's own
    certificate and key (mutual TLS) and the token it sends (``authorization: Bearer TOKEN``).
    ``channel`` / ``aio_channel`` open channels with them.
Tokens
    From a file (one token per line; blank lines and ``#`` comments skipped) or an environment
    variable. A server compares every token it knows in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "SPECDRAFT_TOKEN"
"""The bearer token a client sends and a server accepts, when no token file is given."""
ADMIN_TOKEN_ENV = "SPECDRAFT_ADMIN_TOKEN"
"""The token of the admin identity (datastore version loads and swaps)."""
MAX_TOKEN_FILE_BYTES = 64 * 1024


class SecurityError(ValueError):
    """Security configuration that cannot work: a missing PEM file, a key without a certificate,
    plaintext on a public address without ``--insecure``."""


def read_tokens(path: str | Path | None = None, env: str | None = None) -> tuple[str, ...]:
    """The tokens in ``path`` (one per line), else the one in the environment variable ``env``;
    () when neither is given. A token is at least 16 characters of printable ASCII."""
    if path:
        file = Path(path)
        try:
            if file.stat().st_size > MAX_TOKEN_FILE_BYTES:
                raise SecurityError(f"token file {file} is larger than {MAX_TOKEN_FILE_BYTES} bytes")
            lines = file.read_text(encoding="ascii").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SecurityError(f"cannot read the token file {file}: {exc}") from None
        tokens = tuple(s for s in (line.strip() for line in lines) if s and not s.startswith("#"))
        if not tokens:
            raise SecurityError(f"token file {file} holds no token")
    elif env and os.environ.get(env):
        tokens = (os.environ[env].strip(),)
    else:
        return ()
    for token in tokens:
        if len(token) < 16 or not token.isprintable() or not token.isascii() or " " in token:
            raise SecurityError("a token must be at least 16 printable ASCII characters without spaces")
    return tokens


def token_matches(presented: str, accepted: Iterable[str]) -> bool:
    """Whether ``presented`` is one of ``accepted``, comparing with every one in constant time."""
    found = False
    for token in accepted:
        found |= hmac.compare_digest(presented.encode(), token.encode())
    return found


def _pem(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read the {what} {path}: {exc.strerror}") from None


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost`` and the like; not ``0.0.0.0`` or ``[::]``."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSecurity:
    """How a server authenticates its transport and its callers."""

    cert: str | None = None
    """PEM certificate chain of the server (TLS); with ``key``."""
    key: str | None = None
    """PEM private key of ``cert``."""
    ca: str | None = None
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS)."""
    tokens: tuple[str, ...] = ()
    """Bearer tokens accepted on the data-plane service; () = no token check."""
    admin_tokens: tuple[str, ...] = ()
    """Bearer tokens of the admin identity (the datastore's admin service)."""
    admin_names: tuple[str, ...] = ()
    """Client-certificate names (common name or subject alternative name) that are admins."""
    insecure: bool = False
    """Allow plaintext without tokens on a non-loopback address (logged as a warning)."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if self.ca and not self.cert:
            raise SecurityError("--tls-ca (mutual TLS) needs the server's own --tls-cert and --tls-key")
        if self.admin_names and not self.ca:
            raise SecurityError("admin certificate names need mutual TLS (--tls-ca)")

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = _pem(self.key, "TLS key"), _pem(self.cert, "TLS certificate")
        assert key is not None and cert is not None
        ca = _pem(self.ca, "TLS CA bundle")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def describe(self) -> str:
        parts = ["mTLS" if self.ca else "TLS" if self.tls else "plaintext"]
        if self.tokens:
            parts.append("token")
        return "+".join(parts)


def check_exposure(host: str, security: ServerSecurity) -> bool:
    """Whether serving on ``host`` with ``security`` exposes an unauthenticated plaintext port
    (allowed only with ``security.insecure``; SecurityError otherwise)."""
    if is_loopback(host) or security.tls or security.tokens:
        return False
    if not security.insecure:
        raise SecurityError(
            f"refusing to serve plaintext without a token check on {host}: give --tls-cert/--tls-key "
            "(and --tls-ca for mutual TLS) or --token-file, or --insecure to accept the risk"
        )
    return True


def listen(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity) -> int:
    """Add ``host:port`` to ``server`` with ``security``; the bound port. Refuses plaintext
    without a token check on a non-loopback address unless ``security.insecure``."""
    if check_exposure(host, security):
        log.warning("serving plaintext without authentication on %s:%d (--insecure)", host, port)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, security.credentials())
        if security.tls
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return int(bound)


def health_only_server(host: str, port: int, health: Any) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of ``health`` (a ``grpc.health.v1`` servicer) alone, for probes that
    cannot speak TLS (Kubernetes' gRPC probes): it tells nothing but SERVING / NOT_SERVING."""
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, int(bound)


def connection_options(max_connection_age_seconds: float) -> list[tuple[str, int]]:
    """Server options: keepalive pings, and connections closed (gracefully) after
    ``max_connection_age_seconds`` so that clients behind a ClusterIP Service reconnect and
    spread over pods that started since (0 = never)."""
    options = [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    if max_connection_age_seconds > 0:
        options += [
            ("grpc.max_connection_age_ms", int(max_connection_age_seconds * 1000)),
            ("grpc.max_connection_age_grace_ms", 30_000),
        ]
    return options


# -- clients --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches servers: TLS roots, its own certificate, its token."""

    ca: str | None = None
    """PEM CA bundle that signed the servers' certificates; None with ``tls`` = the system roots."""
    cert: str | None = None
    """PEM client certificate (mutual TLS); with ``key``."""
    key: str | None = None
    token: str | None = None
    """Sent as ``authorization: Bearer TOKEN`` on every call."""
    tls: bool = False
    """Use TLS (implied by ``ca`` or ``cert``)."""
    server_name: str | None = None
    """The name to check the server's certificate against, if not the address's host."""
    options: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityError("--tls-cert and --tls-key go together")

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca) or bool(self.cert)

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca, "TLS CA bundle"),
            private_key=_pem(self.key, "TLS key"),
            certificate_chain=_pem(self.cert, "TLS certificate"),
        )

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = [*self.options, *options]
        if self.server_name and self.uses_tls:
            out.append(("grpc.ssl_target_name_override", self.server_name))
        return out

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        opts = self._options(options)
        if self.uses_tls:
            channel = grpc.secure_channel(address, self._credentials(), options=opts)
        else:
            channel = grpc.insecure_channel(address, options=opts)
        if self.token:
            channel = grpc.intercept_channel(channel, _SyncToken(self.metadata()))
        return channel

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        opts = self._options(options)
        interceptors = (
            [_AioUnaryToken(self.metadata()), _AioStreamToken(self.metadata())] if self.token else None
        )
        if self.uses_tls:
            return grpc.aio.secure_channel(
                address, self._credentials(), options=opts, interceptors=interceptors
            )
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


def _with_metadata(details: Any, extra: tuple[tuple[str, str], ...]) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in extra:
        metadata.add(key, value)
    return details._replace(metadata=metadata)


class _CallDetails:
    """``grpc.ClientCallDetails`` with other metadata (the sync API's details are not a tuple)."""

    def __init__(self, details: Any, extra: tuple[tuple[str, str], ...]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = [*(details.metadata or ()), *extra]
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.extra = metadata

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_CallDetails(details, self.extra), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_CallDetails(details, self.extra), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_CallDetails(details, self.extra), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_CallDetails(details, self.extra), requests)


class _AioUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.extra = metadata

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request)


class _AioStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.extra = metadata

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request)
