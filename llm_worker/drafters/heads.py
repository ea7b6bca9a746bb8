"""Induction heads: finding them (calibration) and the per-model file ``pld+a`` reads.

Calibration (PLD+ §3): decode calibration prompts; whenever a generated token x_t copies the
context — there is an earlier position s with x_s = x_t whose preceding tokens match the
tokens before t — call the s with the longest such match its *copy source*. An induction head
is one whose attention from position t-1 (the query that predicted x_t) peaks at s. Each head
scores the fraction of copy events where it does; the top heads go into a small JSON file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from specdraft.common import atomic_write_text, cache_root

FORMAT_VERSION = 1
MAX_SUFFIX = 64


def copy_source(tokens: np.ndarray, t: int, min_match: int = 1) -> int | None:
    """The copy source of ``tokens[t]``, or None.

    Candidates are s < t with tokens[s] == tokens[t]; the winner has the longest run of equal
    tokens before it (tokens[s-1-i] == tokens[t-1-i]), at least ``min_match`` long; ties go
    to the most recent s.
    Example: tokens [7, 1, 2, 9, 1, 2], t = 5 → s = 2 (preceded by 1, as t is).
    """
    best, best_len = None, min_match - 1
    candidates = np.flatnonzero(tokens[:t] == tokens[t])
    for s in candidates[::-1]:
        length = 0
        while (
            length < MAX_SUFFIX and s - 1 - length >= 0 and tokens[s - 1 - length] == tokens[t - 1 - length]
        ):
            length += 1
        if length > best_len:
            best, best_len = int(s), length
    return best


@dataclass(frozen=True)
class HeadScore:
    layer: int
    head: int
    score: float  # fraction of copy events where this head's attention peaked at the copy source


def rank_heads(hits: np.ndarray, events: int) -> list[HeadScore]:
    """hits: [layers, heads] copy events where each head's attention peaked at the source."""
    if events <= 0:
        return []
    order = np.argsort(-hits, axis=None, kind="stable")
    layers, heads = np.unravel_index(order, hits.shape)
    return [
        HeadScore(int(ly), int(hd), float(hits[ly, hd]) / events)
        for ly, hd in zip(layers, heads, strict=True)
    ]


@dataclass(frozen=True)
class HeadsFile:
    model: str
    fingerprint: str
    heads: tuple[HeadScore, ...]  # best first
    events: int
    prompts: int

    def top(self, count: int) -> tuple[tuple[int, int], ...]:
        return tuple((h.layer, h.head) for h in self.heads[:count])

    def to_json(self) -> dict[str, object]:
        return {
            "format": FORMAT_VERSION,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "calibration": {"prompts": self.prompts, "copy_events": self.events},
            "heads": [{"layer": h.layer, "head": h.head, "score": round(h.score, 5)} for h in self.heads],
        }

    @staticmethod
    def from_json(data: dict[str, object]) -> HeadsFile:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"induction-head file format {data.get('format')!r} is not {FORMAT_VERSION}")
        cal = data.get("calibration") or {}
        assert isinstance(cal, dict)
        raw_heads = data["heads"]
        assert isinstance(raw_heads, list)
        heads = tuple(HeadScore(int(h["layer"]), int(h["head"]), float(h["score"])) for h in raw_heads)
        return HeadsFile(
            str(data["model"]),
            str(data["fingerprint"]),
            heads,
            int(cal.get("copy_events", 0)),
            int(cal.get("prompts", 0)),
        )


def user_heads_dir() -> Path:
    return cache_root() / "induction_heads"


def shipped_heads_dir() -> Path:
    return Path(str(resources.files("llm_worker") / "data" / "induction_heads"))


def shipped_heads_path(fingerprint: str) -> Path:
    return shipped_heads_dir() / f"{fingerprint}.json"


def find_heads_file(*ids: str) -> Path | None:
    """A calibration for these weights: the user's cache first, then the files we ship; for each
    place the ids in order (the dtype-specific fingerprint, then the dtype-free weights id: the
    induction heads are a property of the weights, and a bfloat16 load uses float32's)."""
    for directory in (user_heads_dir(), shipped_heads_dir()):
        for key in ids:
            if key and (directory / f"{key}.json").is_file():
                return directory / f"{key}.json"
    return None


MAX_HEADS_FILE_BYTES = 4 * 1024 * 1024


def load_heads(path: Path) -> HeadsFile:
    """The heads in ``path``; ValueError for anything else (including a file over 4 MiB or not a
    regular file: ``/dev/zero`` is refused before any read)."""
    try:
        if not path.is_file() or path.stat().st_size > MAX_HEADS_FILE_BYTES:
            raise ValueError(f"not a regular file of at most {MAX_HEADS_FILE_BYTES} bytes")
        return HeadsFile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ValueError(f"{path}: not a valid induction-head file ({exc})") from exc


def save_heads(heads: HeadsFile, path: Path) -> Path:
    """Write atomically (temp file in the same directory, then rename)."""
    atomic_write_text(path, json.dumps(heads.to_json(), indent=1) + "\n")
    return path
