"""One shard's versions: the current one, the ones loaded beside it, atomic swaps, draining.

``retrieve`` answers from the requested version (or the current one) and reports which version
answered. ``load`` opens another version of the same shard (checksums verified, tokenizer checked)
next to the current one without disturbing it; ``swap`` makes a loaded version current in one
assignment. The previous version stays loaded for ``drain_seconds`` so that requests pinned to
it (a generation keeps the version of its first retrieval) finish on it; then it is released.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from datastore_svc.dense import DenseConfig
from datastore_svc.protocols import DenseAnswer, DenseDescription, SparseAnswer
from datastore_svc.retrieval import RetrievalConfig
from datastore_svc.store import DatastoreError, DatastoreVersion
from specdraft.common import shorten


class VersionNotLoaded(LookupError):
    """A request named a version this shard does not hold (never loaded, or released)."""


class BadVersionName(ValueError):
    """A version name that is not one directory name under the versions root."""


class VersionMissing(LookupError):
    """No directory of that name under the versions root."""


class UnexpectedVersion(RuntimeError):
    """A compare-and-swap found another current version than the caller expected."""


def check_version_name(name: str) -> None:
    """``BadVersionName`` unless ``name`` can name a version: one directory name (no ``/``,
    ``..`` or absolute path, at most 255 printable characters). ``"v2"`` passes, ``"../v2"`` and
    a 200 000-character name do not."""
    bad = (
        not name
        or len(name) > 255
        or name in (".", "..")
        or any(c in name for c in "/\\\0")
        or not name.isprintable()
    )
    if bad:
        raise BadVersionName(
            f"a version is one directory name under the shard's versions root (no '/', '..' or absolute "
            f"paths), not {shorten(name)!r}"
        )


def version_dir(root: Path, name: str) -> Path:
    """The directory of version ``name`` under ``root``. A name is one path component
    (``check_version_name``), and a symlink may not lead out of the root. Errors say nothing
    about the file system: ``BadVersionName`` for the form, ``VersionMissing`` when no such
    version exists under the root."""
    check_version_name(name)
    real_root = root.resolve()
    target = (root / name).resolve()
    if not target.is_relative_to(real_root) or target == real_root:
        raise BadVersionName(f"version {name!r} leads outside the shard's versions root")
    if not target.is_dir():
        raise VersionMissing(f"there is no version {name!r} under the shard's versions root")
    return target


class ShardState:
    def __init__(
        self,
        version: DatastoreVersion,
        index: int,
        drain_seconds: float = 60.0,
        faiss_gpu: int | None = None,
        versions_root: Path | None = None,
    ) -> None:
        self.index = index
        self.versions_root = versions_root or version.path.resolve().parent
        """Where ``load`` looks versions up by name (default: the directory of the first one)."""
        self.drain_seconds = drain_seconds
        self.faiss_gpu = faiss_gpu  # GPU for the dense indexes of versions loaded later too
        self._lock = threading.Lock()
        self.current = version
        self._loaded: dict[str, DatastoreVersion] = {version.version: version}
        self._release_at: dict[str, float] = {}

    @staticmethod
    def open(
        path: str | Path,
        index: int,
        verify: bool = True,
        drain_seconds: float = 60.0,
        faiss_gpu: int | None = None,
        versions_root: str | Path | None = None,
    ) -> ShardState:
        version = DatastoreVersion(path, shards=[index], verify=verify, faiss_gpu=faiss_gpu)
        root = Path(versions_root) if versions_root else None
        return ShardState(version, index, drain_seconds, faiss_gpu, root)

    def loaded_versions(self) -> list[str]:
        with self._lock:
            self._release_drained()
            return sorted(self._loaded)

    def _release_drained(self) -> None:
        now = time.monotonic()
        for name, when in list(self._release_at.items()):
            if now >= when and name != self.current.version:
                self._loaded.pop(name, None)
                del self._release_at[name]

    def version(self, name: str = "") -> DatastoreVersion:
        """The loaded version ``name`` ("": the current one); ``BadVersionName`` for a name that
        cannot be one, ``VersionNotLoaded`` for one this shard does not hold."""
        if name:
            check_version_name(name)
        with self._lock:
            self._release_drained()
            if not name:
                return self.current
            found = self._loaded.get(name)
        if found is None:
            raise VersionNotLoaded(f"shard {self.index} does not hold version {name!r}")
        return found

    def retrieve(self, context: np.ndarray, cfg: RetrievalConfig, version: str = "") -> SparseAnswer:
        store = self.version(version)
        return SparseAnswer(store.retrieve(context, cfg), store.version)

    def current_version(self) -> str:
        return self.current.version

    def dense_stats(self, version: str) -> DenseDescription:
        store = self.version(version)
        return DenseDescription(store.dense_stats, store.dense_model)

    def retrieve_dense(
        self, query: np.ndarray, next_token: int, cfg: DenseConfig, version: str = ""
    ) -> DenseAnswer:
        store = self.version(version)
        return DenseAnswer(store.retrieve_dense(query, next_token, cfg), store.version)

    def load(self, name: str) -> str:
        """Open version ``name`` (a directory under the versions root, ``version_dir``) of this
        shard beside the current one; its name. Errors leave all as is."""
        target = version_dir(self.versions_root, name)
        fingerprint = self.current.manifest["tokenizer"].get("fingerprint")
        new = DatastoreVersion(
            target, shards=[self.index], tokenizer_fingerprint=fingerprint, faiss_gpu=self.faiss_gpu
        )
        if new.num_shards != self.current.num_shards:
            raise DatastoreError(
                f"{target} has {new.num_shards} shards, the serving version {self.current.num_shards}"
            )
        with self._lock:
            existing = self._loaded.get(new.version)
            if existing is not None and existing.path != new.path:
                raise DatastoreError(f"another version named {new.version!r} is loaded from {existing.path}")
            self._loaded[new.version] = new
            self._release_at.pop(new.version, None)
        return new.version

    def swap(self, name: str, expected_previous: str = "") -> tuple[str, str]:
        """Make the loaded version ``name`` current: (previous, current). With
        ``expected_previous``, only if that is the current version (compare-and-swap).
        ``BadVersionName`` if either cannot name a version."""
        for given in (name, expected_previous) if expected_previous else (name,):
            check_version_name(given)
        with self._lock:
            new = self._loaded.get(name)
            if new is None:
                raise VersionNotLoaded(f"version {name!r} is not loaded on shard {self.index}: load it first")
            previous = self.current
            if expected_previous and previous.version != expected_previous:
                raise UnexpectedVersion(
                    f"shard {self.index} serves {previous.version!r}, not the expected {expected_previous!r}"
                )
            self.current = new
            self._release_at.pop(name, None)
            if previous.version != name:
                self._release_at[previous.version] = time.monotonic() + self.drain_seconds
        return previous.version, name
