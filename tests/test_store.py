"""Datastore versions on disk: atomic builds, shards, checksums, refusal of bad versions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import datastore_svc.store as store
from datastore_svc.corpus import CorpusError
from datastore_svc.retrieval import RetrievalConfig
from datastore_svc.store import DatastoreError, DatastoreVersion, build, tokenizer_identity


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from llm_worker.model.loading import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def write_corpus(path: Path) -> Path:
    import inspect
    import json as json_module
    import textwrap

    records: list[dict[str, Any]] = []
    for mod in (json_module, textwrap, inspect, np):
        records.append({"text": inspect.getdoc(mod) or ""})
    records.append({"prompt": "What is JSON?", "response": "JSON is a lightweight data interchange format."})
    records.append(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    )
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


def test_build_writes_a_complete_version_atomically(tokenizer: Any, corpus: Path, tmp_path: Path) -> None:
    report = build(corpus, tokenizer, tmp_path / "v1", shards=3, model_name="m", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.BUILD_LOCK, "v1"]  # no temporary left
    manifest = json.loads((tmp_path / "v1" / "manifest.json").read_text())
    assert manifest["version"] == "v1" and manifest["documents"] == 6 and len(manifest["shards"]) == 3
    assert manifest["tokenizer"] == tokenizer_identity(tokenizer)
    assert sum(s["documents"] for s in manifest["shards"]) == 6
    assert report.tokens == manifest["tokens"] and report.bytes_per_token > 6
    with pytest.raises(DatastoreError, match="immutable"):
        build(corpus, tokenizer, tmp_path / "v1", progress=False)


def test_sharded_retrieval_equals_one_shard(tokenizer: Any, corpus: Path, tmp_path: Path) -> None:
    build(corpus, tokenizer, tmp_path / "one", shards=1, progress=False)
    build(corpus, tokenizer, tmp_path / "three", shards=3, progress=False)
    one, three = DatastoreVersion(tmp_path / "one"), DatastoreVersion(tmp_path / "three")
    assert one.tokens == three.tokens
    cfg = RetrievalConfig(max_occurrences=26_000, max_nodes=10_000, max_candidates=10_000)  # N x L bound
    ids = tokenizer(
        "The module provides functions to encode JSON data and to dedent text", add_special_tokens=False
    )
    context = np.array(ids["input_ids"])
    for end in range(2, len(context)):
        a, b = one.retrieve(context[:end], cfg), three.retrieve(context[:end], cfg)
        assert a.occurrences <= cfg.max_occurrences  # every occurrence read: no sampling to differ
        assert a.match_length == b.match_length
        assert sorted((c.tokens, c.counts) for c in a.candidates) == sorted(
            (c.tokens, c.counts) for c in b.candidates
        )


def test_a_crashed_build_leaves_nothing(
    tokenizer: Any, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(tokens: np.ndarray, separator: int) -> object:
        raise MemoryError("simulated crash")

    monkeypatch.setattr(store, "build_suffix_index", boom)
    with pytest.raises(MemoryError):
        build(corpus, tokenizer, tmp_path / "v", shards=2, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [store.BUILD_LOCK]


def tiny_docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 6, size=40).astype(np.int32) for _ in range(10)]


def test_a_version_is_on_disk_before_its_name_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file and directory of a version is fsync'd before the rename that publishes it,
    and the directory holding it after: a crash after the build never leaves empty files."""
    import os

    from helpers.datastores import tiny_identity

    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def record_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_rename(src: Any, dst: Any) -> None:
        events.append(("rename", str(src)))
        rename(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "rename", record_rename)
    out = tmp_path / "v1"
    store.write_version(tiny_docs(1), out, 96, tiny_identity(96), shards=2)
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) == 1
    tmp = events[renames[0]][1]
    synced_before = {path for kind, path in events[: renames[0]] if kind == "fsync"}
    written = {str(Path(tmp) / p.relative_to(out)) for p in out.rglob("*")} | {tmp}
    assert written <= synced_before, sorted(written - synced_before)
    assert ("fsync", str(tmp_path)) in events[renames[0] :]


def test_a_killed_builds_temporary_directory_is_removed_by_the_next_build(tmp_path: Path) -> None:
    from helpers.datastores import tiny_identity

    leftover = tmp_path / ".v1.tmp-4242-0badcafe"  # what a build killed mid-way leaves
    (leftover / "shard-0000").mkdir(parents=True)
    (leftover / "shard-0000" / "tokens.npy").write_bytes(b"half")
    store.write_version(tiny_docs(2), tmp_path / "v2", 96, tiny_identity(96))
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.BUILD_LOCK, "v2"]


def test_a_version_whose_files_lead_outside_it_is_refused(tmp_path: Path) -> None:
    """Files that are symlinks out of the version directory (here to another version's
    identical files, so sizes and checksums match) are not loaded: the error names the file."""
    from helpers.datastores import tiny_identity

    root = tmp_path / "versions"
    store.write_version(tiny_docs(3), tmp_path / "elsewhere", 96, tiny_identity(96))
    store.write_version(tiny_docs(3), root / "v1", 96, tiny_identity(96))
    DatastoreVersion(root / "v1")  # whole, it loads
    tokens = root / "v1" / "shard-0000" / "tokens.npy"
    tokens.unlink()
    tokens.symlink_to(tmp_path / "elsewhere" / "shard-0000" / "tokens.npy")
    with pytest.raises(DatastoreError, match=r"tokens\.npy leads outside its version directory"):
        DatastoreVersion(root / "v1")
    tokens.unlink()
    tokens.symlink_to(root / "v1" / "shard-0000" / "docs.npy")  # inside the version: only checksums apply
    with pytest.raises(DatastoreError, match=r"bytes|checksum"):
        DatastoreVersion(root / "v1")
    store.write_version(tiny_docs(3), root / "v2", 96, tiny_identity(96))
    manifest = root / "v2" / "manifest.json"
    manifest.unlink()
    manifest.symlink_to(tmp_path / "elsewhere" / "manifest.json")
    with pytest.raises(DatastoreError, match=r"manifest\.json leads outside"):
        DatastoreVersion(root / "v2")
    store.write_version(tiny_docs(3), root / "v3", 96, tiny_identity(96))
    shutil_dir = root / "v3" / "shard-0000"
    import shutil

    shutil.rmtree(shutil_dir)
    shutil_dir.symlink_to(tmp_path / "elsewhere" / "shard-0000")  # a whole shard directory
    with pytest.raises(DatastoreError, match="leads outside"):
        DatastoreVersion(root / "v3")


def test_bad_corpus_lines_name_file_and_line(tokenizer: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2"):
        build(bad, tokenizer, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


@pytest.fixture()
def version(tokenizer: Any, corpus: Path, tmp_path: Path) -> Path:
    return build(corpus, tokenizer, tmp_path / "v", shards=2, progress=False).path


def test_corrupt_arrays_are_refused(version: Path) -> None:
    sa = version / "shard-0001" / "sa.npy"
    data = bytearray(sa.read_bytes())
    data[-5] ^= 0xFF
    sa.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match="checksum mismatch"):
        DatastoreVersion(version)
    DatastoreVersion(version, shards=[0])  # the other shard is fine


def test_truncated_missing_and_partial_versions_are_refused(version: Path) -> None:
    tokens = version / "shard-0000" / "tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-8])
    with pytest.raises(DatastoreError, match="truncated"):
        DatastoreVersion(version)
    tokens.unlink()
    with pytest.raises(DatastoreError, match="missing"):
        DatastoreVersion(version)
    (version / "manifest.json").unlink()
    with pytest.raises(DatastoreError, match=r"no manifest\.json"):
        DatastoreVersion(version)


def test_corrupt_or_foreign_manifests_are_refused(version: Path) -> None:
    manifest = version / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])
    with pytest.raises(DatastoreError, match="corrupt"):
        DatastoreVersion(version)
    data = json.loads(good)
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(DatastoreError, match="format version 99"):
        DatastoreVersion(version)


def test_another_tokenizer_is_refused(version: Path) -> None:
    with pytest.raises(DatastoreError, match="another tokenizer"):
        DatastoreVersion(version, tokenizer_fingerprint="0123456789abcdef")


def test_a_small_version_is_searched_from_huge_page_copies(
    tokenizer: Any, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel offers transparent huge pages, the shards' arrays are copied whole
    (read-only) and every retrieval answers as from the memory map."""
    build(corpus, tokenizer, tmp_path / "v1", shards=2, progress=False)
    copy = store.resident_copy(np.arange(10, dtype=">u2"))
    assert copy.tolist() == list(range(10)) and copy.dtype == np.dtype(">u2") and not copy.flags.writeable
    monkeypatch.setattr(store, "huge_pages_offered", lambda: True)
    resident = DatastoreVersion(tmp_path / "v1")
    monkeypatch.setattr(store, "RESIDENT_MAX_BYTES", 0)
    mapped = DatastoreVersion(tmp_path / "v1")
    assert resident.resident and not mapped.resident
    for a, b in zip(resident.shards, mapped.shards, strict=True):
        assert np.array_equal(a.suffixes.sa, b.suffixes.sa) and np.array_equal(a.tokens, b.tokens)
        assert not isinstance(a.suffixes.sa.base, np.memmap) and not a.suffixes.sa.flags.writeable
    ids = np.array(
        tokenizer("The module provides functions to encode JSON data", add_special_tokens=False)["input_ids"]
    )
    for end in range(1, len(ids) + 1):
        assert resident.retrieve(ids[:end], RetrievalConfig()) == mapped.retrieve(
            ids[:end], RetrievalConfig()
        )
