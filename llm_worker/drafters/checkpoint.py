"""Learned drafters on disk: ``NAME.safetensors`` (weights, fp16, and the draft vocabulary) beside
``NAME.json`` (what the network is, which target it was trained for, how it was made).

The JSON carries the target's ``weights_id`` (the same for a float32 and a bfloat16 load of one
checkpoint): a drafter trained for another model is refused with ``CheckpointMismatchError``. The
JSON names its weights file and holds its checksum, and ``save_checkpoint`` writes the pair as one
unit: at every moment, a kill included, the JSON names a complete weights file that matches it
(the old checkpoint or the new one, never a mix).

Shipped checkpoints live in the package (``llm_worker/data/drafters/WEIGHTS_ID/``); a worker may
name its own directory (``--drafters-dir``).

A worker loads each checkpoint once (``SharedNetworks``): every mode spelling that reads it
(``glide:window=1000``, ``glide:window=1001``, ``glide+cape``) drafts with the same network.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from safetensors.torch import load_file, save_file

from specdraft.common import atomic_path, atomic_write_text, fsync_path, sha256_file, temp_sibling

FORMAT = 1
D2T_KEY = "draft_to_target"  # [V] int64: draft id → target id


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be read (missing, corrupt, another format)."""


class CheckpointMismatchError(CheckpointError):
    """A drafter checkpoint trained for another target model."""


@dataclass(frozen=True)
class DrafterCheckpoint:
    kind: str  # "glide"
    config: dict[str, Any]  # the network's config (``GlideConfig.to_json``)
    d2t: torch.Tensor  # [V] int64 target id of each draft id
    weights: dict[str, torch.Tensor]  # the network's state dict
    target: dict[str, Any]  # {"weights_id", "name", "vocab_size"}
    command: str = ""  # the exact command that produced it
    meta: dict[str, Any] = field(default_factory=dict)  # training and vocabulary statistics


def _beside(stem: Path, suffix: str) -> Path:
    """``stem`` + ``suffix`` (``runs/glide-1.5b`` → ``runs/glide-1.5b.json``, not ``glide-1.json``)."""
    return stem.with_name(stem.name + suffix)


def json_path_of(path: str | Path) -> Path:
    """A checkpoint's JSON: ``path`` itself if it names one, else ``path`` + ``.json``."""
    path = Path(path)
    return path if path.suffix == ".json" else _beside(path, ".json")


def save_checkpoint(ckpt: DrafterCheckpoint, stem: str | Path) -> Path:
    """Write ``stem.safetensors`` and ``stem.json`` as one unit; returns the JSON's path.

    The steps, each an atomic rename, after each of which the JSON names a complete weights
    file with its checksum: (1) the new weights as ``.stem.SHA16.safetensors`` (the old pair
    untouched); (2) the JSON, naming that file: the new checkpoint is in place; (3) the same
    weights linked over ``stem.safetensors``; (4) the JSON, naming ``stem.safetensors``; then
    staged files are removed, this one's and those of saves that were killed.
    """
    stem = Path(stem)
    weights_path, json_path = _beside(stem, ".safetensors"), _beside(stem, ".json")
    stem.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in ckpt.weights.items()}
    tensors[D2T_KEY] = ckpt.d2t.to(torch.int64).contiguous()
    with atomic_path(_beside(stem, ".staging")) as tmp:
        save_file(tensors, str(tmp))
        digest = sha256_file(tmp)
    staged = stem.with_name(f".{stem.name}.{digest[:16]}.safetensors")
    os.replace(_beside(stem, ".staging"), staged)  # (1)
    record = {
        "format": FORMAT,
        "kind": ckpt.kind,
        "config": ckpt.config,
        "target": ckpt.target,
        "command": ckpt.command,
        "meta": ckpt.meta,
        "weights": {"file": staged.name, "sha256": digest},
    }
    atomic_write_text(json_path, json.dumps(record, indent=2, sort_keys=True) + "\n")  # (2)
    link = temp_sibling(weights_path)
    os.link(staged, link)
    os.replace(link, weights_path)  # (3)
    fsync_path(weights_path.parent)
    record["weights"] = {"file": weights_path.name, "sha256": digest}
    atomic_write_text(json_path, json.dumps(record, indent=2, sort_keys=True) + "\n")  # (4)
    for leftover in [
        *stem.parent.glob(f".{stem.name}.{'[0-9a-f]' * 16}.safetensors"),
        *stem.parent.glob(f".{stem.name}.safetensors.tmp-*"),
        _beside(stem, ".staging"),
    ]:
        leftover.unlink(missing_ok=True)
    return json_path


def load_checkpoint(
    path: str | Path, weights_id: str | None = None, kind: str | None = None
) -> DrafterCheckpoint:
    """Read ``path`` (the JSON, or its stem); refuse one made for another target (``weights_id``)
    or of another kind."""
    json_path = json_path_of(path)
    try:
        record = json.loads(json_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"no drafter checkpoint at {json_path}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{json_path}: not a drafter checkpoint ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{json_path}: not a format-{FORMAT} drafter checkpoint")
    if kind is not None and record.get("kind") != kind:
        raise CheckpointError(f"{json_path}: a {record.get('kind')!r} checkpoint, not {kind!r}")
    target = record.get("target") or {}
    weights = record.get("weights")
    if (
        not isinstance(target, dict)
        or not isinstance(record.get("config"), dict)
        or not isinstance(record.get("meta", {}), dict)
        or not isinstance(weights, dict)
        or not isinstance(weights.get("file"), str)
        or not isinstance(weights.get("sha256"), str)
    ):
        raise CheckpointError(f"{json_path}: a malformed drafter checkpoint (target, config, meta, weights)")
    if weights_id is not None and target.get("weights_id") != weights_id:
        raise CheckpointMismatchError(
            f"{json_path} was trained for target {target.get('name', '?')!r} (weights "
            f"{target.get('weights_id', '?')}), not this model (weights {weights_id}); train one with "
            f"`specdraft train {kind or record.get('kind', 'glide')} --model DIR`"
        )
    weights_path = json_path.with_name(Path(weights["file"]).name)  # beside the JSON, never elsewhere
    if not weights_path.is_file() or sha256_file(weights_path) != weights["sha256"]:
        raise CheckpointError(f"{weights_path}: missing or does not match its checksum in {json_path.name}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{weights_path}: unreadable ({exc})") from None
    d2t = tensors.pop(D2T_KEY, None)
    if d2t is None:
        raise CheckpointError(f"{weights_path}: no draft vocabulary ({D2T_KEY})")
    if d2t.dim() != 1 or not d2t.numel() or d2t.dtype != torch.int64 or int(d2t.min()) < 0:
        raise CheckpointError(f"{weights_path}: the draft vocabulary is not a list of token ids")
    vocab_size = target.get("vocab_size")
    if isinstance(vocab_size, int) and int(d2t.max()) >= vocab_size:
        raise CheckpointError(f"{weights_path}: draft vocabulary ids beyond the target's {vocab_size}")
    return DrafterCheckpoint(
        kind=str(record["kind"]),
        config=dict(record["config"]),
        d2t=d2t,
        weights={k: v.float() for k, v in tensors.items()},
        target=dict(target),
        command=str(record.get("command", "")),
        meta=dict(record.get("meta", {})),
    )


def record_meta(path: str | Path, key: str, value: Any) -> Path:
    """Set ``meta[key]`` in a checkpoint's JSON (e.g. its CAPE table, measured after training),
    atomically; the weights are not touched, so their checksum still holds."""
    json_path = json_path_of(path)
    load_checkpoint(json_path)  # refuse to annotate what is not a readable checkpoint
    record = json.loads(json_path.read_text(encoding="utf-8"))
    record.setdefault("meta", {})[key] = value
    atomic_write_text(json_path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return json_path


def shipped_dir(weights_id: str) -> Path:
    """Where the package keeps the checkpoints trained for a target."""
    return Path(str(resources.files("llm_worker") / "data" / "drafters" / weights_id))


def find_checkpoint(name: str, weights_id: str, directory: Path | None = None) -> Path | None:
    """``NAME.json`` in ``directory`` (a worker's ``--drafters-dir``), else the shipped one for
    ``weights_id``; None if neither exists."""
    for base in ([directory] if directory is not None else []) + [shipped_dir(weights_id)]:
        candidate = base / f"{name}.json"
        if candidate.is_file():
            return candidate
    return None


NetT = TypeVar("NetT")


def locate_drafter(name: str, kind: str, weights_id: str, directory: Path | None) -> Path:
    """The JSON of checkpoint ``name`` for the target ``weights_id`` (``directory`` first, then
    the shipped one); ``CheckpointError`` saying how to make one if there is none."""
    path = find_checkpoint(name, weights_id, directory)
    if path is None:
        where = f"{directory} or " if directory is not None else ""
        raise CheckpointError(
            f"no {name} drafter for this model in {where}the package; train one with `specdraft train {kind}`"
        )
    return path


def load_drafter(
    path: Path, kind: str, weights_id: str, build: Callable[[DrafterCheckpoint], NetT]
) -> tuple[NetT, DrafterCheckpoint]:
    """The checkpoint at ``path`` and the network ``build`` makes of it; ``CheckpointError`` with
    a message worth printing if it is another target's (``weights_id``) or another kind's, or its
    config and weights do not make the network."""
    ckpt = load_checkpoint(path, weights_id, kind=kind)
    try:
        return build(ckpt), ckpt
    except (ValueError, TypeError, RuntimeError) as exc:  # a config or weights that do not make the network
        raise CheckpointError(f"{path}: not a usable {kind.upper()} checkpoint ({exc})") from None


class SharedNetworks:
    """Drafter networks loaded from checkpoints, one per checkpoint file and target, whatever a
    mode's options: ``glide:window=1000`` and ``glide:window=1001`` draft with one network (and
    one fused copy of it), not two. A network is kept while some drafter holds it (weak
    references); a checkpoint replaced on disk (another file at its path) is loaded afresh."""

    def __init__(self) -> None:
        self._loaded: weakref.WeakValueDictionary[tuple[object, ...], Any] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # held while loading: two first uses load once

    def get(self, target: object, path: Path, load: Callable[[], NetT]) -> NetT:
        """What ``load`` makes of the checkpoint at ``path`` for ``target``, made on first use.
        It must hold ``target``, so that no other target takes its ``id`` while it is kept."""
        try:
            stat = path.stat()
        except OSError:
            raise CheckpointError(f"{path}: unreadable") from None
        key = (id(target), str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            found = self._loaded.get(key)
            if found is None:
                found = load()
                self._loaded[key] = found
                _release_free_heap()
            return cast(NetT, found)

    def __len__(self) -> int:
        """How many networks are loaded now."""
        return len(self._loaded)


def _release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing where the
    C library has none). A network's load frees temporaries several times its own size (the
    checkpoint's tensors, the fused copy's rounding and packing), which glibc would otherwise keep
    in the worker's resident memory."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
