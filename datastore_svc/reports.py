"""What ``specdraft datastore build`` and ``datastore info`` print about a version (JSON)."""

from __future__ import annotations

from typing import Any

from datastore_svc.manifest import Manifest
from datastore_svc.store import ARRAYS, DENSE_FILES, DatastoreVersion

SPARSE_FILES = tuple(f"{name}.npy" for name in ARRAYS)


def file_bytes(manifest: Manifest, names: tuple[str, ...]) -> int:
    """Bytes of the files called ``names`` over every shard of a manifest."""
    return sum(f["bytes"] for s in manifest["shards"] for n, f in s["files"].items() if n in names)


def build_report(version: DatastoreVersion, seconds: float) -> dict[str, Any]:
    """A version just built in ``seconds``: its size, speed and bytes per token (and per dense key)."""
    m = version.manifest
    tokens = int(m.get("tokens", 0))
    sparse_bytes = file_bytes(m, SPARSE_FILES)
    report: dict[str, Any] = {
        "path": str(version.path),
        "version": version.version,
        "documents": m.get("documents"),
        "tokens": m.get("tokens"),
        "shards": version.num_shards,
        "seconds": round(seconds, 3),
        "build_seconds": m["build"].get("seconds"),
        "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
        "bytes": sparse_bytes,
        "bytes_per_token": round(sparse_bytes / max(tokens, 1), 2),
    }
    if "dense" in m:
        dense = m["dense"]
        dense_bytes = file_bytes(m, DENSE_FILES)
        report["dense"] = {
            "keys": dense["keys"],
            "dims": dense["dims"],
            "index": dense["index"],
            "seconds": dense["seconds"],
            "chunks": dense["chunks"],
            "bytes": dense_bytes,
            "bytes_per_key": round(dense_bytes / max(dense["keys"], 1), 2),
        }
    return report


def info_report(version: DatastoreVersion, verified: bool) -> dict[str, Any]:
    """A version's manifest summary (the dense statistics left out)."""
    m = version.manifest
    report: dict[str, Any] = {
        "path": str(version.path),
        "version": version.version,
        "shards": version.num_shards,
        "documents": m.get("documents"),
        "tokens": m.get("tokens"),
        "tokenizer": m.get("tokenizer"),
        "model": m.get("model"),
        "verified": verified,
        "load_seconds": round(version.load_seconds, 3),
        "build": m.get("build"),
    }
    if "dense" in m:
        report["dense"] = {k: v for k, v in m["dense"].items() if k != "stats"}
    return report
