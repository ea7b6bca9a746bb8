"""An in-distribution corpus: the target model's own answers to a set of prompts.

DReSD (§5.3) finds that a datastore of the target model's own generations drafts far better than
generic text. ``generate_corpus`` answers every prompt (every turn of a multi-turn question, each
turn seeing the model's earlier answers) with a lossless speculative mode — the output is exactly
the model's greedy answer, only faster — and appends one chat record per prompt to a JSONL file,
ready for ``specdraft datastore build``.

Resumable: records carry the prompt's id; a second run skips ids already in the output and drops
a trailing partial line left by a crash. Each record is flushed and fsynced before the next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datastore_svc.corpus import jsonl_records


@dataclass(frozen=True)
class PromptRecord:
    id: str
    turns: tuple[str, ...]


def read_prompts(path: str | Path) -> Iterator[PromptRecord]:
    """Spec-Bench lines (``question_id``, ``turns``) or ``{"prompt"}`` lines (id = line number)."""
    for where, record in jsonl_records(path):
        number = where.rsplit(":", 1)[1]
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if "turns" in record:
            turns = record["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{where}: turns must be a non-empty list of strings")
            yield PromptRecord(str(record.get("question_id", number)), tuple(turns))
        elif isinstance(record.get("prompt"), str):
            yield PromptRecord(str(record.get("id", number)), (record["prompt"],))
        else:
            raise ValueError(f'{where}: expected "turns" (Spec-Bench) or "prompt"')


def done_ids(out: Path) -> set[str]:
    """Ids already answered in ``out``; a trailing partial line (a crash mid-write) is cut off."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(out, "r+b") as f:
            f.truncate(end)
    ids = set()
    for line in data[:end].splitlines():
        if line.strip():
            ids.add(str(json.loads(line)["id"]))
    return ids


def generate_corpus(
    prompts: list[PromptRecord],
    answer: Callable[[list[dict[str, str]]], str],
    out: str | Path,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Append ``{"id", "messages"}`` for every prompt not yet in ``out``; counts of what was done."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    skip = done_ids(out)
    written = 0
    with open(out, "a", encoding="utf-8") as f:
        for record in prompts:
            if record.id in skip:
                if progress is not None:
                    progress(1)
                continue
            messages: list[dict[str, str]] = []
            for turn in record.turns:
                messages.append({"role": "user", "content": turn})
                messages.append({"role": "assistant", "content": answer(messages)})
            f.write(json.dumps({"id": record.id, "messages": messages}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            written += 1
            if progress is not None:
                progress(1)
    return {"prompts": len(prompts), "skipped": len(skip & {r.id for r in prompts}), "written": written}
