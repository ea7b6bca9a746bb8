"""The chaos run's TCP proxy (client/faultproxy.py) against an echo server on loopback: bytes pass,
a delay adds its time each way, a partition holds every byte until healed and loses none."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from client.faultproxy import FaultProxy


@pytest.fixture
def echo() -> Iterator[str]:
    """An echo server on a free loopback port: its address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def _connect(proxy: FaultProxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5.0)


def _round_trip(sock: socket.socket, data: bytes) -> float:
    began = time.perf_counter()
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        got += sock.recv(65536)
    assert got == data
    return time.perf_counter() - began


def test_passes_delays_and_partitions_without_losing_bytes(echo: str) -> None:
    proxy = FaultProxy(lambda: echo)
    try:
        with _connect(proxy) as sock:
            assert _round_trip(sock, b"hello") < 0.5

            proxy.delay(0.2)
            assert 0.4 <= _round_trip(sock, b"slow") < 1.5  # 200 ms there, 200 ms back

            proxy.blackhole()
            sock.sendall(b"held")
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):  # nothing comes back while partitioned
                sock.recv(16)
            with _connect(proxy) as other:  # a new connection is accepted, and gets nothing either
                other.settimeout(0.3)
                other.sendall(b"x")
                with pytest.raises(TimeoutError):
                    other.recv(16)
            proxy.heal()
            sock.settimeout(5.0)
            assert sock.recv(16) == b"held"  # held, not lost
            assert _round_trip(sock, b"again") < 0.5
    finally:
        proxy.close()


def test_an_unreachable_upstream_refuses_the_link() -> None:
    proxy = FaultProxy(lambda: "")  # e.g. the shard is not started yet
    try:
        with _connect(proxy) as sock:
            sock.settimeout(5.0)
            assert sock.recv(16) == b""  # closed at once
    finally:
        proxy.close()
