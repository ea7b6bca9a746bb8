"""The target's own corpus, kept in the repository and grown in pieces.

A work directory of the training pipeline holds ``prompts.jsonl`` and ``conversations.jsonl``
(append-only: a resumed run adds lines). A *corpus directory* keeps them compressed (xz) beside
a ``manifest.json`` with each file's line count and the sha256 of its compressed and
uncompressed bytes, the dtype the answers were written in and a history of the runs that grew
it (command, machine, counts). ``unpack`` puts a corpus into a work directory so the pipeline
continues from it instead of starting again; ``pack`` writes a work directory's files back.

Both refuse what would lose data: a damaged corpus file (its checksum), or a work directory
whose files are not a continuation of the corpus (another corpus). Every file is written
atomically, so an interrupted pack or unpack leaves the old files, never half of new ones.

Text, not token ids: the answers compress to about 0.77 bytes per token as JSONL under xz
against 0.65 as uint16 ids, and text serves any tokenizer and the retrieval datastores alike.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdraft.common import atomic_path, atomic_write_text, sha256_file, temp_sibling

FILES = ("prompts.jsonl", "conversations.jsonl")
MANIFEST = "manifest.json"
DATA_DTYPE = "data-dtype"
FORMAT = 1


class CorpusError(ValueError):
    """A damaged corpus, or a work directory that does not continue it."""


def read_manifest(corpus: Path) -> dict[str, Any]:
    path = corpus / MANIFEST
    if not path.is_file():
        return {"format": FORMAT, "files": {}, "history": []}
    try:
        manifest = dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{path}: not a readable corpus manifest ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CorpusError(f"{path}: corpus format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def _digest(path: Path) -> tuple[str, int]:
    """sha256 and line count of a file's bytes."""
    h, lines = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            lines += block.count(b"\n")
    return h.hexdigest(), lines


def _is_prefix(short: Path, long: Path) -> bool:
    """Whether ``short``'s bytes begin ``long``'s."""
    if short.stat().st_size > long.stat().st_size:
        return False
    with open(short, "rb") as a, open(long, "rb") as b:
        for block in iter(lambda: a.read(1 << 22), b""):
            if b.read(len(block)) != block:
                return False
    return True


def unpack(corpus: Path, work: Path) -> dict[str, Any]:
    """Put the corpus's files into ``work`` where it holds less; checks every checksum. A work
    file that already continues the corpus (it begins with the corpus's bytes) is kept; one that
    is neither a continuation nor a beginning of it is refused. Returns ``{file: action}``."""
    manifest = read_manifest(corpus)
    if not manifest["files"]:
        raise CorpusError(f"{corpus}: no corpus here ({MANIFEST} missing or empty)")
    work.mkdir(parents=True, exist_ok=True)
    actions: dict[str, Any] = {}
    for name, entry in manifest["files"].items():
        packed = corpus / entry["file"]
        if not packed.is_file() or sha256_file(packed) != entry["xz_sha256"]:
            raise CorpusError(f"{packed}: missing or damaged (its sha256 does not match {MANIFEST})")
        target = work / name
        tmp = temp_sibling(target)
        try:
            with lzma.open(packed) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            if _digest(tmp)[0] != entry["sha256"]:
                raise CorpusError(f"{packed}: its content does not match {MANIFEST}")
            if target.is_file() and _is_prefix(tmp, target):
                actions[name] = "kept (the work directory continues the corpus)"
                continue
            if target.is_file() and not _is_prefix(target, tmp):
                raise CorpusError(
                    f"{target} is not a continuation of the corpus {corpus}: another corpus? "
                    "use another work directory"
                )
            os.replace(tmp, target)
            actions[name] = f"unpacked ({entry['lines']} lines)"
        finally:
            tmp.unlink(missing_ok=True)
    if manifest.get("data_dtype") and not (work / DATA_DTYPE).is_file():
        atomic_write_text(work / DATA_DTYPE, manifest["data_dtype"] + "\n")
    return actions


def pack(work: Path, corpus: Path, note: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compress ``work``'s corpus files into ``corpus`` (those that changed) and record the run
    in the manifest's history (``note``: the command, counts). A work file that does not begin
    with the corpus's content is refused. Returns the new manifest."""
    manifest = read_manifest(corpus)
    corpus.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        source = work / name
        if not source.is_file():
            raise CorpusError(f"{source} is missing: nothing to pack")
        digest, lines = _digest(source)
        old = manifest["files"].get(name)
        if old is not None and old["sha256"] == digest:
            continue
        if old is not None and lines < old["lines"]:
            raise CorpusError(f"{source} has fewer lines than the corpus ({lines} < {old['lines']})")
        packed = corpus / (name + ".xz")
        with atomic_path(packed) as tmp, open(source, "rb") as src, lzma.open(tmp, "wb", preset=9) as out:
            shutil.copyfileobj(src, out, 1 << 22)
        manifest["files"][name] = {
            "file": packed.name,
            "lines": lines,
            "sha256": digest,
            "xz_sha256": sha256_file(packed),
            "xz_bytes": packed.stat().st_size,
        }
    dtype_file = work / DATA_DTYPE
    if dtype_file.is_file():
        manifest["data_dtype"] = dtype_file.read_text().strip()
    manifest["history"].append(
        {
            "packed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": platform.machine(),
            "lines": {n: e["lines"] for n, e in manifest["files"].items()},
            **(note or {}),
        }
    )
    atomic_write_text(corpus / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def conversations(corpus: Path, split: str | None = None) -> Iterator[dict[str, Any]]:
    """The corpus's conversations (``{"id", "kind", "split", "messages", ...}``) straight from its
    compressed file, checked against the manifest first; ``split``: only that split's (``train``
    or ``heldout``). Example: the retrieval datastores of the target's own text are built from
    ``conversations(corpus, "train")``, so held-out prompts never find their own answers there."""
    manifest = read_manifest(corpus)
    entry = manifest["files"].get("conversations.jsonl")
    if entry is None:
        raise CorpusError(f"{corpus}: no conversations here ({MANIFEST} lists none)")
    packed = corpus / entry["file"]
    if not packed.is_file() or sha256_file(packed) != entry["xz_sha256"]:
        raise CorpusError(f"{packed}: missing or damaged (its sha256 does not match {MANIFEST})")
    with lzma.open(packed, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if split is None or record.get("split", "train") == split:
                yield record


def answer_tokens(work: Path, tokenizer: Any) -> dict[str, int]:
    """Conversations and answer tokens in ``work``'s conversations, by split."""
    out: dict[str, int] = {}
    with open(work / "conversations.jsonl") as f:
        for line in f:
            record = json.loads(line)
            split = record.get("split", "train")
            out[f"{split}_conversations"] = out.get(f"{split}_conversations", 0) + 1
            for message in record["messages"]:
                if message["role"] == "assistant":
                    n = len(tokenizer(message["content"], add_special_tokens=False)["input_ids"])
                    out[f"{split}_answer_tokens"] = out.get(f"{split}_answer_tokens", 0) + n
    return out
