"""Transport security every gRPC server and client shares: TLS and mutual TLS from PEM files,
bearer tokens, and the rule that decides when plaintext is allowed.

Servers
    ``ServerSecurity`` holds the PEM files (``--tls-cert --tls-key``; ``--tls-ca`` also asks every
    client for a certificate signed by that CA: mutual TLS) and the bearer tokens it accepts.
    ``listen`` binds a gRPC port with them, ``health_only_server`` a plaintext port of health
    alone (for probes that speak no TLS), ``serve_metrics`` the Prometheus endpoint (HTTPS with
    the server's certificate when it has one). Every one of them passes ``check_exposure``:
    plaintext is allowed on loopback; on any other address it needs ``insecure=True``
    (``--insecure``) and logs a warning — with or without tokens, since a token sent in
    plaintext is anyone's who can read the link.
Clients
    ``ClientSecurity`` holds the CA that signs the servers' certificates, the client's own
    certificate and key (mutual TLS) and the token it sends (``authorization: Bearer TOKEN``).
    ``channel`` / ``aio_channel`` open channels with them, and refuse to send a token over
    plaintext to a non-loopback address unless ``insecure=True`` (a warning then).
Tokens
    From a file (one token per line; blank lines and ``#`` comments skipped) or an environment
    variable. A server compares every token it knows in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
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


MAX_TENANT_CHARS = 128


def tenant_namespace(requested: str, token: str | None) -> str:
    """The namespace of online drafting a request lands in: the request's ``tenant`` field,
    inside its bearer token's own namespace (a digest of the token, never the token), so a
    client can name only namespaces of the credential it holds. Without a token (an open
    server), the field alone. ``ValueError`` for a field over ``MAX_TENANT_CHARS`` characters
    or one that is not printable ASCII.

    Example: ``tenant_namespace("team-a", None)`` is ``"team-a"``;
    ``tenant_namespace("team-a", "s3cret")`` is ``"<16 hex digits>/team-a"``.
    """
    if len(requested) > MAX_TENANT_CHARS:
        raise ValueError(f"tenant has at most {MAX_TENANT_CHARS} characters, not {len(requested)}")
    if not all(" " <= ch <= "~" for ch in requested):
        raise ValueError("tenant must be printable ASCII")
    if not token:
        return requested
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{digest}/{requested}"


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


def target_hosts(address: str) -> list[str]:
    """The hosts a gRPC target names: ``"10.0.0.5:50051"`` → ``["10.0.0.5"]``, ``"[::1]:50051"``
    → ``["::1"]``, ``"dns:///w.example:443"`` → ``["w.example"]``, ``"ipv4:127.0.0.1:1,10.0.0.5:2"``
    → both hosts; a Unix socket (``"unix:/run/s.sock"``) is ``["localhost"]``."""
    if address.startswith(("unix:", "unix-abstract:")):
        return ["localhost"]
    if "://" in address:  # dns://[authority]/host:port
        address = address.split("://", 1)[1].split("/", 1)[-1]
    elif address.startswith(("ipv4:", "ipv6:", "dns:")):
        address = address.split(":", 1)[1]
    hosts = []
    for item in address.split(","):
        if item.startswith("["):
            hosts.append(item[1:].partition("]")[0])
        elif item.count(":") == 1:
            hosts.append(item.rpartition(":")[0])
        else:  # a bare name, or an IPv6 address without a port
            hosts.append(item)
    return hosts


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
    """Allow plaintext (with or without tokens) on a non-loopback address (logged as a warning)."""

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


def check_exposure(host: str, security: ServerSecurity, listener: str = "gRPC") -> str | None:
    """What serving ``listener`` (a name for messages: "gRPC", "metrics", "health") on ``host``
    exposes: None when nothing (loopback, or the server has TLS), else the warning to log, which
    only ``security.insecure`` allows (SecurityError otherwise).

    Examples: ``("127.0.0.1", ServerSecurity())`` → None; ``("0.0.0.0", ServerSecurity(cert=...,
    key=...))`` → None; ``("0.0.0.0", ServerSecurity(tokens=(t,)))`` → SecurityError (the token
    would travel in cleartext); the same with ``insecure=True`` → "serving gRPC in plaintext on
    0.0.0.0 with bearer tokens in cleartext (--insecure)". A health-only port is plaintext
    whatever the server's TLS (it carries no token and tells only SERVING / NOT_SERVING), so on
    a TLS server it passes; the metrics endpoint is served over TLS when the server has it.
    """
    if is_loopback(host) or security.tls:
        return None
    what = "with bearer tokens in cleartext" if security.tokens else "without authentication"
    if not security.insecure:
        raise SecurityError(
            f"refusing to serve {listener} in plaintext on {host} {what}: give --tls-cert/--tls-key "
            "(and --tls-ca for mutual TLS), or --insecure to accept the risk"
        )
    return f"serving {listener} in plaintext on {host} {what} (--insecure)"


def listen(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity) -> int:
    """Add ``host:port`` to ``server`` with ``security``; the bound port. Refuses plaintext on a
    non-loopback address unless ``security.insecure`` (``check_exposure``)."""
    warning = check_exposure(host, security)
    if warning:
        log.warning("%s, port %d", warning, port)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, security.credentials())
        if security.tls
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return int(bound)


def health_only_server(
    host: str, port: int, health: Any, security: ServerSecurity
) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of ``health`` (a ``grpc.health.v1`` servicer) alone, for probes that
    cannot speak TLS (Kubernetes' gRPC probes): it tells nothing but SERVING / NOT_SERVING.
    Under ``check_exposure`` like every listener: public beside a TLS server, otherwise only
    on loopback or with ``--insecure``."""
    from grpc_health.v1 import health_pb2_grpc

    warning = check_exposure(host, security, "health")
    if warning:
        log.warning("%s, port %d", warning, port)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, int(bound)


def serve_metrics(registry: Any, host: str, port: int, security: ServerSecurity) -> int:
    """Serve ``registry`` (a ``prometheus_client.CollectorRegistry``) on ``host:port``
    ``/metrics`` from a thread; the bound port (0 picks a free one). HTTPS with the server's
    certificate when it has one (no client certificate asked: the scraper is not a gRPC client);
    plaintext otherwise, under ``check_exposure`` like the gRPC ports."""
    from prometheus_client import start_http_server

    warning = check_exposure(host, security, "metrics")
    if warning:
        log.warning("%s, port %d", warning, port)
    server, _ = start_http_server(
        port, addr=host, registry=registry, certfile=security.cert, keyfile=security.key
    )
    return int(server.server_port)


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
    insecure: bool = False
    """Send the token over plaintext to a non-loopback address (logged as a warning)."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityError("--tls-cert and --tls-key go together")

    def check_plaintext(self, address: str) -> None:
        """Refuse (SecurityError) to send the token in plaintext to ``address`` unless its host
        is loopback (``target_hosts``) or ``insecure``; a warning then. Nothing to check
        without a token or with TLS."""
        if not self.token or self.uses_tls or all(is_loopback(h) for h in target_hosts(address)):
            return
        if not self.insecure:
            raise SecurityError(
                f"refusing to send a bearer token in plaintext to {address[:200]}: give --tls or "
                "--tls-ca, or --insecure to accept the risk"
            )
        log.warning("sending a bearer token in plaintext to %s (--insecure)", address[:200])

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
        self.check_plaintext(address)
        opts = self._options(options)
        if self.uses_tls:
            channel = grpc.secure_channel(address, self._credentials(), options=opts)
        else:
            channel = grpc.insecure_channel(address, options=opts)
        if self.token:
            channel = grpc.intercept_channel(channel, _SyncToken(self.metadata()))
        return channel

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        self.check_plaintext(address)
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
