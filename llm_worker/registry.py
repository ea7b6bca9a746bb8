"""The worker registry: which workers serve which modes, with a TTL and heartbeats.

Each worker's server (``llm_worker.server``) writes one record, ``{namespace}:workers:{worker_id}``
→ JSON (``WorkerRecord``: address, model, modes, load and capacity), with a TTL, refreshes it
every ``ttl / 3`` seconds with its current load, and deletes it when it drains. A worker that
dies stops refreshing and disappears when its TTL runs out. Discovery (``discover``) scans the
records and keeps the workers that serve the mode asked for (options after ``:`` ignored), least
loaded first (load / capacity).

Redis is a cache, never a dependency of serving: without a URL (or with ``memory://``) the
registry lives in the process with the same TTL semantics; a Redis that goes down costs
discovery, not generation (a failed heartbeat is logged and tried again at the next one).
It sits in ``llm_worker`` because workers publish through it; clients (``specdraft generate
--registry``) import it from the layer above. Of ours it imports only ``specdraft.redisconn``
(``redis://`` or ``rediss://`` URLs checked, the password from ``$SPECDRAFT_REDIS_PASSWORD``
where the URL names none, URLs redacted in logs).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from specdraft.redisconn import check_url, connect, redacted

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "specdraft"
DEFAULT_TTL = 10.0


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
        data = json.loads(text)
        data["modes"] = tuple(data["modes"])
        return WorkerRecord(**data)


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
        for raw in self.client.mget(keys):
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                records.append(WorkerRecord.from_json(raw))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("ignoring a malformed worker record: %s", exc)
        return by_load([r for r in records if serves(r, mode)])


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
