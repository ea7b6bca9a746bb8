"""The HTTP front end (``client.http_api``) served by uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from client.http_api.app import create_app
from client.http_api.backends import Backend
from client.http_api.server import HttpConfig, bind, uvicorn_server
from helpers.servers import wait_until
from llm_worker.metrics import WorkerMetrics
from specdraft.security import ServerSecurity


class HttpThread:
    """``create_app(backend, ...)`` served on 127.0.0.1:<free port> until ``stop``; ``url`` is
    its ``/v1`` base URL (``https`` with ``security.cert``)."""

    def __init__(self, backend: Backend, security: ServerSecurity | None = None, **app: Any) -> None:
        self.security = security or ServerSecurity()
        self.metrics = app.pop("metrics", None) or WorkerMetrics()
        self.app = create_app(backend, self.security, self.metrics, **app)
        self.backend = backend
        cfg = HttpConfig(port=0, security=self.security, grace_seconds=1)
        sock = bind(cfg)
        self.port = int(sock.getsockname()[1])
        self.server = uvicorn_server(self.app, cfg)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True
        )
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), 30, what="uvicorn starts")
        assert self.server.started, "uvicorn did not start"
        scheme = "https" if self.security.tls else "http"
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
