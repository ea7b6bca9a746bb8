"""Utilities every layer shares: atomic writes, the cache directory, file digests, percentiles."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$SPECDRAFT_CACHE``, else ``~/.cache/specdraft``."""
    env = os.environ.get("SPECDRAFT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specdraft"


def temp_sibling(path: Path) -> Path:
    """A fresh name beside ``path`` for something that is renamed over it when complete:
    ``.NAME.tmp-PID-RANDOM`` (hidden, and never one another process uses)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside ``path``; when the block ends without an error the
    file is renamed over ``path``, otherwise removed. A reader sees the old file or the new one,
    never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block: processes that
    share a cache take turns at measuring something once."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (``atomic_path``); with ``mode`` (e.g.
    ``0o600`` for secrets) the file has those permissions from its creation on."""
    with atomic_path(path) as tmp:
        if mode is None:
            tmp.write_text(text, encoding="utf-8")
            return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)


def sha256_file(path: str | Path) -> str:
    """The SHA-256 hex digest of a file's bytes, read in blocks of 4 MiB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) by linear interpolation between the closest ranks, as
    ``numpy.percentile``'s default: [1, 2, 3, 4] at 0.5 → 2.5 (the median), at 0.99 → 3.97.
    Every latency figure of the project uses this one definition."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 1:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
