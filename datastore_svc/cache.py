"""What several processes share through Redis for dense retrieval: statistics and query results.

- ``StatsCache``: the z-score / PCA statistics of each datastore version (published by the build
  and by shard servers, read by workers; ``SET`` without expiry, they never change).
- ``QueryCache``: the normalised query embedding of a context with the drafts retrieved for it,
  keyed by the datastore version, the draft shape and a hash of the context — a repeated
  question, a retry or a shared system prompt skips the projection and the search. Entries
  expire (``ttl``); values above ``max_value_bytes`` are not stored, and the Redis server's own
  ``maxmemory`` / LRU policy bounds the total (``specdraft up`` and the Kubernetes manifests set it).

Redis is a cache, never a dependency: every call has a short timeout, and after a failure the
cache stays off for ``retry_after`` seconds (no timeout per draft step while Redis is down). A
miss, a Redis error and a disabled cache all mean "compute it here".

What is read from Redis is untrusted (anyone with a Redis user that may write these keys can put
anything there): a value that does not parse — too big, not a zip, a decompression bomb, a key
of another type, JSON of another shape — is a miss, counted (``unreadable``), logged at most once
a minute, and the entry is deleted (statistics: then overwritten with the datastore's own), so
that it costs one miss, not one per draft step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore_svc.dense import (
    DenseCandidate,
    DenseConfig,
    DenseError,
    DenseRetrieval,
    DenseSource,
    DenseStats,
)
from specdraft.common import ThrottledWarning
from specdraft.redisconn import check_url, connect, redacted

log = logging.getLogger(__name__)
NAMESPACE = "specdraft:datastore"


class RedisLink:
    """A Redis client that fails fast and backs off: ``call`` returns None when Redis is unusable."""

    def __init__(self, url: str, timeout: float = 0.05, retry_after: float = 5.0) -> None:
        self.url = redacted(url)
        self.client = connect(url, timeout)
        self.retry_after = retry_after
        self._down_until = 0.0
        self.errors = 0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def call(self, fn: Any, *args: Any) -> Any:
        if not self.available:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # any Redis failure: compute here, try Redis again later
            self.errors += 1
            if self._down_until == 0.0 or time.monotonic() >= self._down_until:
                log.warning("redis %s unusable (%s); caching off for %.0f s", self.url, exc, self.retry_after)
            self._down_until = time.monotonic() + self.retry_after
            return None

    def read(self, fn: Any, key: str) -> Any:
        """``call(fn, key)`` where a key of another type (Redis's WRONGTYPE: someone wrote a
        string where a hash belongs, or the reverse) reads as ``b""``, unreadable, instead of as
        Redis being down: the caller counts it and deletes the key."""

        def guarded() -> Any:
            import redis

            try:
                return fn(key)
            except redis.ResponseError as exc:
                if str(exc).startswith("WRONGTYPE"):
                    return b""
                raise

        return self.call(guarded)


def link_for(url: str | None) -> RedisLink | None:
    if not url:
        return None
    check_url(url, "cache")
    return RedisLink(url)


class StatsCache:
    """Dense statistics per datastore version: in process, then Redis, then ``fallback(version)``."""

    def __init__(self, link: RedisLink | None) -> None:
        self.link = link
        self._local: dict[str, DenseStats] = {}
        self._lock = threading.Lock()
        self.redis_hits = 0
        self.unreadable = 0  # values in Redis that did not parse (each deleted or replaced)
        self._unreadable_log = ThrottledWarning(log)

    @staticmethod
    def key(version: str) -> str:
        return f"{NAMESPACE}:{version}:dense-stats"

    def remember(self, version: str, stats: DenseStats) -> None:
        """Keep statistics this process already has (no Redis round trip later)."""
        with self._lock:
            self._local[version] = stats

    def publish(self, version: str, stats: DenseStats) -> bool:
        """Store the statistics in Redis (True if stored)."""
        self.remember(version, stats)
        if self.link is None:
            return False
        return bool(self.link.call(self.link.client.set, self.key(version), stats.to_bytes()))

    def get(self, version: str, fallback: Any = None) -> DenseStats | None:
        """The statistics of ``version``, or None. An unreadable value in Redis is counted,
        deleted, and replaced by ``fallback``'s statistics when it has them."""
        with self._lock:
            stats = self._local.get(version)
            if stats is not None:
                return stats
            if self.link is not None:
                data = self.link.read(self.link.client.get, self.key(version))
                if data is not None:
                    try:
                        stats = DenseStats.from_bytes(data)
                        self.redis_hits += 1
                    except DenseError as exc:
                        self.unreadable += 1
                        self._unreadable_log.warn(
                            "deleting unreadable dense statistics of %.80r in redis: %s", version, exc
                        )
                        self.link.call(self.link.client.delete, self.key(version))
            if stats is None and fallback is not None:
                stats = fallback(version)
                if stats is not None and self.link is not None:
                    self.link.call(self.link.client.set, self.key(version), stats.to_bytes())
            if stats is not None:
                self._local[version] = stats
            return stats


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    unreadable: int = 0  # entries that did not parse: misses too, and deleted
    saved_seconds: float = 0.0  # hits × the mean cost of a miss (projection + search)
    miss_seconds: float = 0.0


def context_hash(context: np.ndarray) -> str:
    return hashlib.blake2b(
        np.ascontiguousarray(context, dtype=np.int64).tobytes(), digest_size=16
    ).hexdigest()


def encode_result(query: np.ndarray, result: DenseRetrieval) -> dict[str, bytes]:
    cands = [
        [
            list(c.tokens),
            c.score,
            c.count,
            [c.source.shard, c.source.document, c.source.offset] if c.source else None,
        ]
        for c in result.candidates
    ]
    body = json.dumps({"c": cands, "s": result.searched, "m": result.matched}, separators=(",", ":"))
    return {"q": np.asarray(query, dtype=np.float32).tobytes(), "r": body.encode()}


def decode_result(fields: dict[bytes, bytes]) -> tuple[np.ndarray, DenseRetrieval]:
    """``encode_result``'s fields back; anything else (Redis is untrusted) is a ``DenseError``.

    Example: ``{b"q": b"...", b"r": b'{"c": [[[5, 6], 0.9, 1, null]], "s": 3, "m": 1}'}`` → one
    candidate [5, 6] of score 0.9; ``{b"r": b"[]"}`` → ``DenseError``.
    """
    try:
        query = np.frombuffer(fields[b"q"], dtype=np.float32)
        body = json.loads(fields[b"r"])
        cands = tuple(
            DenseCandidate(
                tuple(int(t) for t in toks), float(score), int(count), DenseSource(*src) if src else None
            )
            for toks, score, count, src in body["c"]
        )
        return query, DenseRetrieval(cands, int(body["s"]), int(body["m"]))
    except Exception as exc:  # KeyError, ValueError, TypeError, OverflowError, RecursionError, ...
        raise DenseError(f"unreadable cached query: {type(exc).__name__}") from None


class QueryCache:
    """Query embeddings and their drafts, keyed by version, draft shape and context hash."""

    def __init__(
        self, link: RedisLink | None, ttl: int = 600, max_value_bytes: int = 16_384, context_window: int = 0
    ) -> None:
        """``context_window``: hash only the last N context tokens (0 = all: a hit then returns the
        drafts a search would return; a window hits more often, with drafts found for another
        beginning — never a different output, the verifier sees to that)."""
        self.link = link
        self.ttl = ttl
        self.max_value_bytes = max_value_bytes
        self.context_window = context_window
        self.counters = CacheCounters()
        self._unreadable_log = ThrottledWarning(log)

    @property
    def enabled(self) -> bool:
        return self.link is not None and self.link.available

    def key(self, version: str, cfg: DenseConfig, context: np.ndarray) -> str:
        shape = f"k{cfg.top_k}d{cfg.max_candidates}l{cfg.max_length}w{self.context_window}"
        recent = context[-self.context_window :] if self.context_window else context
        return f"{NAMESPACE}:{version}:dense-q:{shape}:{context_hash(recent)}"

    def get(self, key: str) -> DenseRetrieval | None:
        """The cached drafts under ``key``, or None (a miss). An entry that does not parse, or is
        bigger than any this cache stores, is a miss too, counted and deleted."""
        if not self.enabled:
            return None
        assert self.link is not None
        fields = self.link.read(self.link.client.hgetall, key)  # b"": a key of another type
        if fields is None or fields == {}:  # Redis unusable, or nothing cached
            self.counters.misses += 1
            return None
        try:
            if not isinstance(fields, dict) or sum(len(v) for v in fields.values()) > self.max_value_bytes:
                raise DenseError("not a hash of this cache's size")
            _, result = decode_result(fields)
        except DenseError as exc:
            self._unreadable_log.warn("deleting an unreadable cached query %s: %s", key, exc)
            self.counters.misses += 1
            self.counters.unreadable += 1
            self.link.call(self.link.client.delete, key)
            return None
        self.counters.hits += 1
        misses = max(self.counters.misses, 1)
        self.counters.saved_seconds += self.counters.miss_seconds / misses
        return result

    def put(self, key: str, query: np.ndarray, result: DenseRetrieval, seconds: float) -> None:
        self.counters.miss_seconds += seconds
        if not self.enabled:
            return
        assert self.link is not None
        fields: dict[Any, bytes] = dict(encode_result(query, result))
        if sum(len(v) for v in fields.values()) > self.max_value_bytes:
            return
        client = self.link.client

        def store() -> Any:
            pipe = client.pipeline(transaction=False)
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.ttl)
            return pipe.execute()

        if self.link.call(store) is not None:
            self.counters.stores += 1


class CacheCollector:
    """Prometheus view of a ``QueryCache`` (register on a worker's registry)."""

    def __init__(self, cache: QueryCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        c = self.cache.counters
        yield CounterMetricFamily(
            "specdraft_dense_cache_hits", "Dense query cache hits (search skipped)", c.hits
        )
        yield CounterMetricFamily("specdraft_dense_cache_misses", "Dense query cache misses", c.misses)
        yield CounterMetricFamily(
            "specdraft_dense_cache_saved_seconds",
            "Time the dense query cache saved: hits times the mean cost of a miss",
            c.saved_seconds,
        )
        yield CounterMetricFamily(
            "specdraft_dense_cache_unreadable",
            "Dense query cache entries that did not parse (counted as misses, and deleted)",
            c.unreadable,
        )
        errors = self.cache.link.errors if self.cache.link is not None else 0
        yield CounterMetricFamily("specdraft_dense_cache_errors", "Redis errors of the dense cache", errors)
