"""The worker registry: which workers serve which modes, with a TTL and heartbeats.

Each worker's server (``llm_worker.server``) writes one record, ``{namespace}:workers:{worker_id}``
→ JSON (``WorkerRecord``: address, model, modes, load and capacity), with a TTL, refreshes it
every ``ttl / 3`` seconds with its current load, and deletes it when it drains. A worker that
dies stops refreshing and disappears when its TTL runs out. Discovery (``discover``) scans the
records and keeps the workers that serve the mode asked for (options after ``:`` ignored), least
loaded first (load / capacity).

Records are untrusted: whoever can write to Redis can write one. Each is checked as it is read
(``WorkerRecord.from_json``: types, lengths, ``host:port``, a load that is a whole number >= 0,
a capacity >= 1, the id its key names); one that fails is skipped, counted (``skipped``) and
logged at most once a minute, and discovery goes on with the others. Which Redis user may write
which record is ``specdraft.redisconn``'s part.

Redis is a cache, never a dependency of serving: without a URL (or with ``memory://``) the
registry lives in the process with the same TTL semantics; a Redis that goes down costs
discovery, not generation (a failed heartbeat is logged and tried again at the next one).
It sits in ``llm_worker`` because workers publish through it; clients (``specdraft generate
--registry``) import it from the layer above. Of ours it imports only ``specdraft.redisconn``
(``redis://`` or ``rediss://`` URLs checked, the password from ``$SPECDRAFT_REDIS_PASSWORD``
where the URL names none, URLs redacted in logs) and ``specdraft.common`` (the throttled warning).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from specdraft.common import ThrottledWarning
from specdraft.redisconn import check_url, connect, redacted

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "specdraft"
DEFAULT_TTL = 10.0
MAX_RECORD_BYTES = 16_384
"""A record longer than this is refused before it is parsed (a real one is a few hundred bytes)."""
MAX_TEXT = 1024  # characters of an id, a model name (it may be a path), a fingerprint, a version, a mode
MAX_MODES = 128
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,252})")


class RecordError(ValueError):
    """A worker record that does not say what a worker's record says."""


def check_address(address: str) -> None:
    """``host:port`` a client may dial: a DNS name, an IPv4 address or an IPv6 address (bracketed
    or not), and a port 1-65535. ``"10.0.0.7:50051"`` and ``"[::1]:50051"`` pass;
    ``"evil.example:0"``, ``"unix:/tmp/s"`` and ``"dns:///a:1"`` do not."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 1 <= int(port) <= 65535:
        raise RecordError(f"address {address[:80]!r}: not host:port with a port 1-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ip(host):
            raise RecordError(f"address {address[:80]!r}: not an IP address in brackets")
    elif not (_is_ip(host) or _HOSTNAME.fullmatch(host)):
        raise RecordError(f"address {address[:80]!r}: the host is neither an IP address nor a DNS name")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _text(value: Any, what: str, empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or (not empty and not value):
        raise RecordError(f"{what}: not a string of {'0' if empty else '1'}-{MAX_TEXT} characters")
    if not value.isprintable():
        raise RecordError(f"{what}: not printable")
    return value


def _whole(data: dict[str, Any], key: str, low: int, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1_000_000:
        raise RecordError(f"{key}: not a whole number {low}-1000000")
    return value


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    address: str  # host:port a client can dial
    model: str
    fingerprint: str
    modes: tuple[str, ...]
    load: int = 0  # generations running now
    capacity: int = 1  # generations it admits at once
    version: str = ""
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "modes": list(self.modes)})

    @staticmethod
    def from_json(text: str | bytes) -> WorkerRecord:
        """Parse and check a record read from the registry; ``RecordError`` says what is wrong.

        Example: ``{"worker_id": "w", "address": "10.0.0.7:50051", "model": "m", "fingerprint":
        "f", "modes": ["ar"], "load": -5, "capacity": 4}`` is refused ("load: not a whole number
        0-1000000"): a negative load would sort it before every honest worker.
        """
        if len(text) > MAX_RECORD_BYTES:
            raise RecordError(f"{len(text)} bytes: more than {MAX_RECORD_BYTES}")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise RecordError(f"not JSON: {type(exc).__name__}") from None
        if not isinstance(data, dict):
            raise RecordError("not a JSON object")
        unknown = set(data) - set(WorkerRecord.__dataclass_fields__)
        if unknown:
            raise RecordError(f"unknown fields {sorted(unknown)[:4]}")
        address = _text(data.get("address"), "address", empty=False)
        check_address(address)
        modes = data.get("modes")
        if not isinstance(modes, list) or not 1 <= len(modes) <= MAX_MODES:
            raise RecordError(f"modes: not a list of 1-{MAX_MODES} names")
        started = data.get("started_at", 0.0)
        if isinstance(started, bool) or not isinstance(started, int | float) or not math.isfinite(started):
            raise RecordError("started_at: not a finite number")
        return WorkerRecord(
            worker_id=_text(data.get("worker_id"), "worker_id", empty=False),
            address=address,
            model=_text(data.get("model"), "model"),
            fingerprint=_text(data.get("fingerprint"), "fingerprint"),
            modes=tuple(_text(m, "a mode", empty=False) for m in modes),
            load=_whole(data, "load", 0, 0),
            capacity=_whole(data, "capacity", 1, 1),
            version=_text(data.get("version", ""), "version"),
            started_at=float(started),
        )


class Registry(Protocol):
    def publish(self, record: WorkerRecord) -> None: ...
    def remove(self, worker_id: str) -> None: ...
    def workers(self, mode: str | None = None) -> list[WorkerRecord]: ...


def serves(record: WorkerRecord, mode: str | None) -> bool:
    """Does the worker serve ``mode`` (options after ':' do not matter)?"""
    return mode is None or mode.split(":", 1)[0] in record.modes


def by_load(records: list[WorkerRecord]) -> list[WorkerRecord]:
    return sorted(records, key=lambda r: (r.load / max(r.capacity, 1), r.worker_id))


class InProcessRegistry:
    """The embedded default: the same semantics (TTL included) inside one process."""

    def __init__(self, ttl: float = DEFAULT_TTL) -> None:
        self.ttl = ttl
        self._records: dict[str, tuple[float, WorkerRecord]] = {}
        self._lock = threading.Lock()

    def publish(self, record: WorkerRecord) -> None:
        with self._lock:
            self._records[record.worker_id] = (time.monotonic() + self.ttl, record)

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._records.pop(worker_id, None)

    def workers(self, mode: str | None = None) -> list[WorkerRecord]:
        now = time.monotonic()
        with self._lock:
            live = [r for expiry, r in self._records.values() if expiry > now]
        return by_load([r for r in live if serves(r, mode)])


class RedisRegistry:
    """Records in Redis: ``SET key json EX ttl`` per worker, ``SCAN`` to discover."""

    def __init__(self, url: str, namespace: str = DEFAULT_NAMESPACE, ttl: float = DEFAULT_TTL) -> None:
        self.url = redacted(url)
        self.namespace = namespace
        self.ttl = ttl
        self.client = connect(url, timeout=2.0)
        self.skipped = 0  # records read and refused (malformed, or not under their own key)
        self._skipping = ThrottledWarning(log)

    def _key(self, worker_id: str) -> str:
        return f"{self.namespace}:workers:{worker_id}"

    def publish(self, record: WorkerRecord) -> None:
        self.client.set(self._key(record.worker_id), record.to_json(), px=max(1, int(self.ttl * 1000)))

    def remove(self, worker_id: str) -> None:
        self.client.delete(self._key(worker_id))

    def workers(self, mode: str | None = None) -> list[WorkerRecord]:
        keys = list(self.client.scan_iter(match=self._key("*"), count=500))
        if not keys:
            return []
        records = []
        for key, raw in zip(keys, self.client.mget(keys), strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                record = WorkerRecord.from_json(raw)
                if _name(key) != self._key(record.worker_id):
                    raise RecordError(f"worker_id {record.worker_id!r} under another worker's key")
            except RecordError as exc:
                self.skipped += 1
                self._skipping.warn("skipping a malformed worker record %.120r: %s", key, exc)
                continue
            records.append(record)
        return by_load([r for r in records if serves(r, mode)])


def _name(key: bytes | str) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


def open_registry(url: str | None, namespace: str = DEFAULT_NAMESPACE, ttl: float = DEFAULT_TTL) -> Registry:
    """``redis://...`` or ``rediss://...`` → Redis (``specdraft.redisconn``); None or ``memory://`` →
    in-process."""
    if not url or url.startswith("memory://"):
        return InProcessRegistry(ttl)
    check_url(url, "registry")
    return RedisRegistry(url, namespace, ttl)


def discover(registry: Registry, mode: str | None) -> list[str]:
    """Addresses of live workers serving ``mode``, least loaded first."""
    return [r.address for r in registry.workers(mode)]
