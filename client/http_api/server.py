"""Serving the HTTP application with uvicorn: the address, TLS and mutual TLS from the same
``ServerSecurity`` as the gRPC ports, the same exposure rule (plaintext only on loopback unless
``--insecure``), and a graceful stop (requests in flight get ``grace_seconds``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from specdraft.security import ServerSecurity, check_exposure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0 = any free port."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS (``cert``, ``key``), mutual TLS (``ca``) and the bearer tokens accepted."""
    grace_seconds: float = 30.0
    """On shutdown, requests in flight get this long to finish."""


def bind(cfg: HttpConfig) -> socket.socket:
    """A listening socket on ``cfg.host:cfg.port`` (refused as ``check_exposure`` says)."""
    warning = check_exposure(cfg.host, cfg.security, "HTTP")
    if warning:
        log.warning("%s, port %d", warning, cfg.port)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host.strip("[]"), cfg.port))
    sock.listen(128)
    return sock


def uvicorn_server(app: Any, cfg: HttpConfig) -> uvicorn.Server:
    """A uvicorn server of ``app`` with ``cfg``'s TLS; run it with ``serve(sockets=[bind(cfg)])``."""
    sec = cfg.security
    config = uvicorn.Config(
        app,
        ssl_certfile=sec.cert,
        ssl_keyfile=sec.key,
        ssl_ca_certs=sec.ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED if sec.ca else ssl.CERT_NONE,
        timeout_graceful_shutdown=int(cfg.grace_seconds),
        log_level="warning",
        access_log=False,
    )
    return uvicorn.Server(config)


def serve_http(app: Any, cfg: HttpConfig, ready: Callable[[int], None] | None = None) -> None:
    """Serve ``app`` until SIGTERM / SIGINT (uvicorn's own handlers), then drain; ``ready`` gets
    the bound port once the server accepts connections."""
    sock = bind(cfg)
    server = uvicorn_server(app, cfg)
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: let
    # that be a no-op, so that a drained server exits 0 as ``serve worker`` does
    signal.signal(signal.SIGTERM, lambda signum, frame: None)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and ready is not None:
            ready(int(sock.getsockname()[1]))
        await task

    asyncio.run(main())
