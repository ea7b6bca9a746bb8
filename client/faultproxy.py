"""A TCP proxy that can break its link, for the chaos run (``client/chaos.py``): clients connect
to the proxy, the proxy to the address ``upstream()`` names at that moment.

- ``heal()``: bytes pass as they come.
- ``blackhole()``: a network partition. Connections are still accepted, but no byte moves either
  way; the bytes sent meanwhile wait (as TCP's retransmissions would) and pass once healed.
- ``delay(seconds)``: a slow link; every chunk is forwarded ``seconds`` after it arrived, in each
  direction (0.2 → a request's first byte reaches the server 200 ms late, its answer 200 ms later
  still: 400 ms added to a round trip).

Threads, not asyncio: four per connection (a reader and a writer each way), and gRPC keeps one
connection per channel, so a few dozen at most.

    proxy = FaultProxy(lambda: "127.0.0.1:50061")   # listens on a free loopback port
    worker_target = proxy.address                   # "127.0.0.1:41234"
    proxy.blackhole(); ...; proxy.heal()
    proxy.close()
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable


class FaultProxy:
    def __init__(self, upstream: Callable[[], str], host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Condition()
        self._blackholed = False
        self._delay_seconds = 0.0
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"proxy {self.address}", daemon=True).start()

    # -- the faults -----------------------------------------------------------------------------

    def blackhole(self) -> None:
        with self._lock:
            self._blackholed = True

    def delay(self, seconds: float) -> None:
        with self._lock:
            self._blackholed, self._delay_seconds = False, seconds
            self._lock.notify_all()

    def heal(self) -> None:
        self.delay(0.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    # -- the plumbing ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                host, port = self.upstream().rsplit(":", 1)
                server = socket.create_connection((host, int(port)), timeout=5.0)
            except (OSError, ValueError):
                client.close()  # upstream down or unknown: the client sees the link refused
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(src, chunks), daemon=True).start()
                threading.Thread(target=self._write, args=(chunks, dst), daemon=True).start()

    def _wait_while_blackholed(self) -> None:
        with self._lock:
            while self._blackholed and not self._closed:
                self._lock.wait()

    def _read(self, src: socket.socket, chunks: queue.Queue[tuple[float, bytes]]) -> None:
        """Read chunks as they come (none while blackholed), stamped with their arrival time."""
        while True:
            self._wait_while_blackholed()
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            chunks.put((time.monotonic(), data))
            if not data:
                return

    def _write(self, chunks: queue.Queue[tuple[float, bytes]], dst: socket.socket) -> None:
        """Forward each chunk at its arrival time plus the delay (none while blackholed)."""
        while True:
            arrived, data = chunks.get()
            self._wait_while_blackholed()
            time.sleep(max(0.0, arrived + self._delay_seconds - time.monotonic()))
            self._wait_while_blackholed()
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return
