"""Utilities every layer shares: atomic writes, the cache directory, file digests, percentiles,
bounded echoes of input in error texts, whether other processes loaded the cores during a
measurement, progress lines of long steps, and warnings that someone else can trigger at will,
logged at a bounded rate."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$SPECDRAFT_CACHE``, else ``~/.cache/specdraft``."""
    env = os.environ.get("SPECDRAFT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specdraft"


def native_dir() -> Path:
    """Where compiled native code lives, one directory per build (named by a digest of its
    sources and flags): ``$SPECDRAFT_NATIVE_DIR``, else ``cache_root()/native``."""
    env = os.environ.get("SPECDRAFT_NATIVE_DIR")
    return Path(env) if env else cache_root() / "native"


def temp_sibling(path: Path) -> Path:
    """A fresh name beside ``path`` for something that is renamed over it when complete:
    ``.NAME.tmp-PID-RANDOM`` (hidden, and never one another process uses)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a directory's data and metadata to disk (``os.fsync``); a directory's
    fsync makes the names created or renamed in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """``fsync_path`` every file and directory under ``root`` (``root`` last), so that a rename
    of ``root`` that follows publishes content already on disk: after a crash the new name holds
    the whole tree, not empty or short files."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(directory)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name beside ``path``; when the block ends without an error the
    file is flushed to disk and renamed over ``path`` (then the directory is flushed), otherwise
    removed. A reader sees the old file or the new one, never half of one, even after a crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


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


class ThrottledWarning:
    """A warning logged at most once every ``seconds``; the next one logged says how many were
    left out. For what untrusted input decides how often happens (a malformed Redis record read
    by every discovery, a poisoned cache entry read by every draft step).

    Example: ``bad = ThrottledWarning(log, 60)``; ``bad.warn("skipping %s", key)`` 100 times in a
    minute logs the first; the first a minute later ends with "(99 more since the last)".
    """

    def __init__(
        self, logger: logging.Logger, seconds: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.seconds = seconds
        self.clock = clock
        self._next = float("-inf")
        self._left_out = 0
        self._lock = threading.Lock()

    def warn(self, message: str, *args: object) -> None:
        now = self.clock()
        with self._lock:
            if now < self._next:
                self._left_out += 1
                return
            left_out, self._left_out, self._next = self._left_out, 0, now + self.seconds
        if left_out:
            message, args = f"{message} (%d more since the last)", (*args, left_out)
        self.logger.warning(message, *args)


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


ECHO_CHARS = 64
"""The most characters of a request's own text an error text quotes (``shorten``)."""
MAX_ERROR_CHARS = 1024
"""The longest error text a server sends: a status's message travels in a trailer, and gRPC
clients refuse trailers over 16 KiB (RESOURCE_EXHAUSTED instead of the real status)."""


def shorten(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` as an error text may quote it: whole up to ``limit`` characters, else its start
    and its length. ``shorten("pld")`` → ``"pld"``; ``shorten("abcdef", 3)`` →
    ``"abc… (6 characters)"``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


# ---------------------------------------------------------------------------------------------
# Whether other processes used the cores while something was measured.

FOREIGN_LOAD_LIMIT = 0.10
"""Cores' worth of CPU that other processes may take, on average over a measurement, beyond the
cores this process leaves free, before the measurement counts as taken under load
(``foreign_cores``): a tenth of one core. A quiet Linux desktop's daemons use about a hundredth;
one busy process on a core the measurement uses counts as about 1 (on a 2-core EPYC a start-up
that shared its cores so measured t(1) = 105 ms against a quiet 11 ms)."""


def foreign_cores(busy: float, own: float, wall: float, cpus: int, threads: int, tick: float) -> float:
    """Cores' worth of CPU other processes took from this process during a window, on average:
    the CPU seconds every process spent on the ``cpus`` cores it may run on (``busy``, counted by
    the kernel in ticks of ``tick`` seconds, so up to one tick per core is allowed for rounding),
    less its own (``own``), over ``wall`` seconds, less the cores its ``threads`` leave free
    (another process running there slows nothing). Never negative.

    Example: 2 cores, 2 threads, 1 s: busy 2.0 s, own 1.0 s → 1 - 0.02 (ticks) = 0.98 cores
    (another process had a core); on 16 cores with 8 threads, the same 0.98 is on spare cores → 0.
    """
    if wall <= 0:
        return 0.0
    others = max(0.0, busy - own - cpus * tick) / wall
    return max(0.0, others - max(0, cpus - threads))


def _cpu_times() -> tuple[float, float, int, float] | None:
    """(busy CPU seconds of every process on this process's cores since boot, this process's own
    CPU seconds, how many cores, seconds a tick); None where ``/proc/stat`` cannot be read."""
    import resource

    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except (OSError, AttributeError):
        return None
    rows = [r for r in lines if r[0] in allowed] or [r for r in lines if r[0] == "cpu"]
    if not rows:
        return None
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal (guest time is inside user): all but idle and iowait
    busy = sum(int(r[i]) for r in rows for i in (1, 2, 3, 6, 7, 8) if i < len(r)) * tick
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpus = len(rows) if rows[0][0] != "cpu" else os.cpu_count() or 1
    return busy, usage.ru_utime + usage.ru_stime, cpus, tick


class LoadWatch:
    """Whether other processes used this process's cores during a block (Linux; elsewhere never).

    ``with LoadWatch(threads) as watch: measure()`` then ``watch.busy``: more than
    ``FOREIGN_LOAD_LIMIT`` cores' worth of ``foreign_cores`` on average. A measurement taken so
    serves the run that took it, but is not cached for later ones. Only other processes count:
    this process's other threads (a worker's other requests) are its own CPU time, and a window
    of a few ticks (well under a second) can tell too little to flag anything.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.foreign = 0.0
        self.seconds = 0.0
        self._start: tuple[float, tuple[float, float, int, float] | None] = (0.0, None)

    def __enter__(self) -> LoadWatch:
        self._start = (time.monotonic(), _cpu_times())
        return self

    def __exit__(self, *exc: object) -> None:
        began, before = self._start
        after = _cpu_times()
        self.seconds = time.monotonic() - began
        if before is not None and after is not None:
            busy, own = after[0] - before[0], after[1] - before[1]
            self.foreign = foreign_cores(busy, own, self.seconds, after[2], self.threads, after[3])

    @property
    def busy(self) -> bool:
        return self.foreign > FOREIGN_LOAD_LIMIT

    def describe(self) -> str:
        return (
            f"other processes used {self.foreign:.2f} cores' worth of this process's CPUs "
            f"over {self.seconds:.0f} s"
        )


# ---------------------------------------------------------------------------------------------
# Progress of long first-run steps (model conversion, kernel choice, the cost curve).

PROGRESS = logging.getLogger("specdraft.progress")
"""Where ``Progress`` writes: INFO, shown even where the CLI logs only warnings (a logger's own
level decides; the CLI's stderr handler has none). Silence it with ``PROGRESS.setLevel``."""
PROGRESS.setLevel(logging.INFO)


def _duration(seconds: float) -> str:
    return f"{round(seconds)} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class Progress:
    """The lines of a long step on ``PROGRESS``: "<what> (once; about 40 s)…" when it starts
    (``note``, then the caller's estimate), then at most every ``every`` seconds
    "<what>: 40% (12 s left)", the time left extrapolated from the time so far and the fraction
    done (``update``), and a closing line if any progress line was written. ``ticking()`` writes
    the progress of one call that reports none, taking the estimate as the whole.
    """

    def __init__(
        self,
        what: str,
        estimate: float | None = None,
        note: str = "once",
        every: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.estimate, self.every, self.clock = what, estimate, every, clock
        self.began = clock()
        self._next = self.began + every
        self.lines = 0
        about = [note] if note else []
        about += [f"about {_duration(max(1.0, estimate))}"] if estimate is not None else []
        PROGRESS.info("%s%s…", what, f" ({'; '.join(about)})" if about else "")

    def update(self, fraction: float) -> None:
        """``fraction`` (0 to 1) of the work is done."""
        now = self.clock()
        if now < self._next or fraction <= 0:
            return
        self._next = now + self.every
        elapsed = now - self.began
        left = elapsed * (1 - min(fraction, 1.0)) / fraction
        self.lines += 1
        PROGRESS.info("%s: %.0f%% (%s left)", self.what, 100 * min(fraction, 1.0), _duration(left))

    def done(self) -> None:
        if self.lines:
            PROGRESS.info("%s: done in %s", self.what, _duration(self.clock() - self.began))

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Updates from a thread while the block runs, as the elapsed share of the estimate
        (at most 99 %), then ``done``."""
        import threading

        stop = threading.Event()
        estimate = self.estimate or 60.0

        def tick() -> None:
            while not stop.wait(min(1.0, self.every)):
                self.update(min(0.99, (self.clock() - self.began) / estimate))

        thread = threading.Thread(target=tick, name="specdraft-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        self.done()
