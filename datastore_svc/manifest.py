"""The types of a datastore version's ``manifest.json``, and its check by type.

The manifest is JSON on disk and a plain dict in memory (the same dict is written, so the file
is what the build always wrote); these ``TypedDict``s name its fields. A build fills every field;
a version being opened is checked by ``check_manifest`` (``store.read_manifest``), which
guarantees the fields these types mark required. The others were never required of a manifest
and are read with defaults (``.get``).

Example (a sparse version of two shards)::

    {"format": "specdraft-datastore", "format_version": 2, "version": "v1",
     "created": "2026-11-26T12:00:00Z",
     "tokenizer": {"name": "…", "vocab_size": 49152, "fingerprint": "…"},
     "model": "…", "separator": 49152, "documents": 6, "tokens": 1234,
     "shards": [{"index": 0, "tokens": 617, "documents": 3,
                 "files": {"tokens.npy": {"bytes": 1362, "sha256": "…"}, …}}, …],
     "build": {"corpus": "…", "corpus_sha256": "…", "sa_library": "…", "seconds": {…}}}

A dense version adds ``"dense"`` (``DenseEntry``), and its shards list ``dense.faiss`` and
``positions.npy`` among their files.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict, TypeGuard


class TokenizerIdentity(TypedDict, total=False):
    """Which tokenizer the token ids are of (``store.tokenizer_identity``): a worker checks the
    fingerprint (of the vocabulary and special tokens) against its own."""

    name: str
    vocab_size: int
    fingerprint: str


class FileEntry(TypedDict):
    """A file of a shard: its size and SHA-256, checked when the version is opened."""

    bytes: int
    sha256: str


class ShardEntry(TypedDict):
    index: int
    tokens: int
    """Length of the shard's token array (documents and their separators)."""
    documents: NotRequired[int]
    files: NotRequired[dict[str, FileEntry]]
    """File name (``tokens.npy``, ``dense.faiss``, ...) → its entry."""


class BuildInfo(TypedDict, total=False):
    """How the version was made (for reports; nothing reads it back)."""

    corpus: str
    corpus_sha256: str
    sa_library: str
    """The suffix-array library and its version."""
    seconds: dict[str, float]
    """Stage → seconds (suffix_array, write)."""
    derived_from: str
    """The version whose token arrays a derived version shares (``store.derive_version``)."""


class DenseStatsEntry(TypedDict, total=False):
    """The z-score / PCA statistics of a dense version (``dense.DenseStats.to_manifest``)."""

    hidden_size: int
    dims: int
    npz_base64: str
    sha256: str


class DenseEntry(TypedDict, total=False):
    """A dense version's index: whose hidden states its keys are, how they were reduced and
    indexed, and how long it took (``dense_build.dense_step``)."""

    model: str
    model_fingerprint: str
    """The target's weights fingerprint: a worker uses the index only with the same weights."""
    dims: int
    index: str
    """The FAISS index kind(s), comma-separated when shards differ."""
    keys: int
    params: dict[str, int]
    """``dense.IndexParams`` as a dict."""
    window: int
    overlap: int
    sample: int
    max_tokens: int
    """Keys were made for documents evenly spread up to about this many tokens (0: all)."""
    seconds: dict[str, float]
    chunks: dict[str, int]
    """Hidden-state chunks ``cached`` (read back) and ``computed``."""
    stats: DenseStatsEntry


class Manifest(TypedDict):
    format: str
    format_version: int
    version: str
    """The version's name (its directory's name)."""
    created: NotRequired[str]
    tokenizer: TokenizerIdentity
    model: NotRequired[str]
    """The model directory the corpus was tokenized for ("" = not given)."""
    separator: int
    """The token between documents: above every token id (the tokenizer's size)."""
    documents: NotRequired[int]
    tokens: NotRequired[int]
    shards: list[ShardEntry]
    build: NotRequired[BuildInfo]
    dense: NotRequired[DenseEntry]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(manifest: dict[str, object]) -> str:
    """What is wrong with the manifest's fields, by type ("" = nothing): a malformed manifest is
    refused before any of it is used. Checks the fields ``Manifest`` marks required (``format``
    and ``format_version`` are the caller's: ``store.read_manifest``) and those of the shards,
    their files and the dense entry."""
    for key in ("version", "tokenizer", "separator", "shards"):
        if key not in manifest:
            return f"lacks {key!r}"
    version, separator, shards = manifest["version"], manifest["separator"], manifest["shards"]
    if not isinstance(version, str) or not version:
        return "field 'version' must be a non-empty string"
    if not isinstance(manifest["tokenizer"], dict):
        return "field 'tokenizer' must be an object"
    if not _is_int(separator) or separator < 1:
        return "field 'separator' must be a positive integer"
    if not isinstance(shards, list) or not shards:
        return "field 'shards' must be a non-empty list"
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict) or not _is_int(entry.get("index")) or not _is_int(entry.get("tokens")):
            return f"field 'shards[{i}]' must be an object with integer 'index' and 'tokens'"
        files = entry.get("files", {})
        if not isinstance(files, dict) or not all(
            isinstance(f, dict) and _is_int(f.get("bytes")) and isinstance(f.get("sha256"), str)
            for f in files.values()
        ):
            return f"field 'shards[{i}].files' must map names to {{bytes, sha256}}"
    dense = manifest.get("dense")
    if "dense" in manifest and (not isinstance(dense, dict) or not isinstance(dense.get("stats", {}), dict)):
        return "field 'dense' must be an object with an object 'stats'"
    return ""
