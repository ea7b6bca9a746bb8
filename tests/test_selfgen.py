"""`specdraft datastore generate`: the model's own answers as a corpus, resumable after a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client.cli import main
from datastore_svc.selfgen import read_prompts


def test_generate_answers_every_turn_and_resumes(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"question_id": 81, "category": "writing", "turns": ["Say hi.", "Now say bye."]},
        {"question_id": 82, "category": "coding", "turns": ["Write x = 1."]},
        {"prompt": "Count to three."},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "corpus.jsonl"
    argv = ["datastore", "generate", "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--max-new-tokens", "6", "--mode", "pld", "--quiet"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["81", "82", "3"]
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant", "user", "assistant"]

    assert main(argv) == 0  # nothing left to do
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "prompts": 3, "skipped": 3, "written": 0}

    kept = out.read_text().splitlines()[:2]  # a crash while writing the third record
    out.write_text("\n".join(kept) + '\n{"id": "3", "messa')
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 1
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert again == records  # the same greedy answers, nothing half-written left


def test_bad_prompt_files_are_reported_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"turns": []}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        list(read_prompts(bad))
