"""Corpus files: JSONL of ``{"text"}``, ``{"prompt", "response"}`` or chat ``{"messages"}``.

Chat-shaped records are rendered with the tokenizer's chat template, so the datastore holds the
token sequences the model sees when it serves chat requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from specdraft.common import atomic_path
from specdraft.tokenizer import Tokenizer


class CorpusError(ValueError):
    """A corpus line that is not one of the accepted shapes; the message names file and line."""


def _messages(record: dict[str, object], where: str) -> list[dict[str, str]]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise CorpusError(f"{where}: messages must be a non-empty list")
    out = []
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise CorpusError(f"{where}: each message needs string role and content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def record_text(record: object, tokenizer: Tokenizer, where: str) -> str:
    """The document text of one corpus record."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected a JSON object")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise CorpusError(f"{where}: text must be a string")
        return record["text"]
    if "messages" in record:
        messages = _messages(record, where)
    elif "prompt" in record and "response" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise CorpusError(f"{where}: prompt and response must be strings")
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    else:
        raise CorpusError(f'{where}: expected "text", "prompt" + "response", or "messages"')
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n\n".join(m["content"] for m in messages)


def jsonl_records(path: str | Path) -> Iterator[tuple[str, object]]:
    """(``file:line``, parsed record) for every non-blank line; CorpusError names a bad line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{where}: not JSON ({exc.msg})") from None


def read_documents(path: str | Path, tokenizer: Tokenizer) -> Iterator[str]:
    """Document texts of a JSONL corpus, in file order (blank lines skipped)."""
    for where, record in jsonl_records(path):
        yield record_text(record, tokenizer, where)


def write_jsonl(path: str | Path, records: Iterable[object]) -> int:
    """Write ``records`` to ``path`` as JSONL, atomically (a killed run leaves no half file);
    returns how many."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def own_questions(conversations: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Spec-Bench questions from conversations: each distinct first user turn once, in order, with
    the conversation's id and kind. Example: two conversations answering "Hi" (a greedy and a
    sampled answer) give one question ``{"question_id": ..., "category": ..., "turns": ["Hi"]}``."""
    seen: set[str] = set()
    for c in conversations:
        first = next((m["content"] for m in c["messages"] if m["role"] == "user"), None)
        if first is None or first in seen:
            continue
        seen.add(first)
        yield {"question_id": c["id"], "category": c.get("kind", "own"), "turns": [first]}
