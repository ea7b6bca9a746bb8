"""The kept corpus: pack and unpack round-trip; a damaged file or a work directory holding another
corpus is refused by name; a work directory that is ahead is kept, one that is behind is brought
up to date; nothing half-written is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_worker.training.corpus import CorpusError, pack, read_manifest, unpack


def _write(work: Path, prompts: int, conversations: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "prompts.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"id": f"self-{i}", "kind": "self", "text": f"question {i}"}) + "\n")
    with open(work / "conversations.jsonl", "w") as f:
        for i in range(conversations):
            f.write(
                json.dumps({"id": f"self-{i}", "messages": [{"role": "assistant", "content": "x"}]}) + "\n"
            )
    (work / "data-dtype").write_text("bfloat16\n")


def test_round_trip_and_history(tmp_path: Path) -> None:
    work, corpus, again = tmp_path / "work", tmp_path / "corpus", tmp_path / "again"
    _write(work, 5, 3)
    manifest = pack(work, corpus, {"note": "first"})
    assert manifest["files"]["conversations.jsonl"]["lines"] == 3
    assert manifest["data_dtype"] == "bfloat16"
    actions = unpack(corpus, again)
    assert all(a.startswith("unpacked") for a in actions.values())
    for name in ("prompts.jsonl", "conversations.jsonl", "data-dtype"):
        assert (again / name).read_bytes() == (work / name).read_bytes()
    _write(work, 5, 4)  # the run grew it
    pack(work, corpus, {"note": "second"})
    history = read_manifest(corpus)["history"]
    assert [h["note"] for h in history] == ["first", "second"]
    assert history[-1]["lines"]["conversations.jsonl"] == 4
    assert not [p for p in corpus.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_work_ahead_is_kept_and_behind_is_updated(tmp_path: Path) -> None:
    work, corpus = tmp_path / "work", tmp_path / "corpus"
    _write(work, 5, 3)
    pack(work, corpus)
    ahead = tmp_path / "ahead"
    _write(ahead, 5, 6)
    before = (ahead / "conversations.jsonl").read_bytes()
    assert unpack(corpus, ahead)["conversations.jsonl"].startswith("kept")
    assert (ahead / "conversations.jsonl").read_bytes() == before
    behind = tmp_path / "behind"
    _write(behind, 5, 1)
    assert unpack(corpus, behind)["conversations.jsonl"].startswith("unpacked")
    assert (behind / "conversations.jsonl").read_bytes() == (work / "conversations.jsonl").read_bytes()


def test_another_corpus_is_refused(tmp_path: Path) -> None:
    work, corpus, other = tmp_path / "work", tmp_path / "corpus", tmp_path / "other"
    _write(work, 5, 3)
    pack(work, corpus)
    other.mkdir()
    (other / "prompts.jsonl").write_text('{"id": "something else"}\n')
    with pytest.raises(CorpusError, match="not a continuation"):
        unpack(corpus, other)
    assert (other / "prompts.jsonl").read_text() == '{"id": "something else"}\n'
    assert sorted(p.name for p in other.iterdir()) == ["prompts.jsonl"]


def test_damaged_file_is_refused(tmp_path: Path) -> None:
    work, corpus = tmp_path / "work", tmp_path / "corpus"
    _write(work, 5, 3)
    pack(work, corpus)
    packed = corpus / "conversations.jsonl.xz"
    data = bytearray(packed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    packed.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=r"conversations\.jsonl\.xz: missing or damaged"):
        unpack(corpus, tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "conversations.jsonl").exists()


def test_pack_refuses_a_shrunk_work_directory(tmp_path: Path) -> None:
    work, corpus = tmp_path / "work", tmp_path / "corpus"
    _write(work, 5, 3)
    pack(work, corpus)
    _write(work, 5, 2)
    with pytest.raises(CorpusError, match="fewer lines"):
        pack(work, corpus)
    assert read_manifest(corpus)["files"]["conversations.jsonl"]["lines"] == 3


def test_own_corpus_writes_the_train_split_and_held_out_questions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``datastore own-corpus``: the train split's conversations for a datastore, the held-out
    split's first user turns (each once) as questions; a damaged corpus is one clear error."""
    from client.cli import main

    work, corpus = tmp_path / "work", tmp_path / "corpus"
    _write(work, 1, 0)

    def turn(cid: str, split: str, question: str) -> str:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "answer"}]
        return json.dumps({"id": cid, "kind": "self", "split": split, "messages": messages}) + "\n"

    with open(work / "conversations.jsonl", "w") as f:
        f.write(turn("self-0", "train", "Hi"))
        f.write(turn("self-1", "heldout", "Why?"))
        f.write(turn("self-1", "heldout", "Why?"))  # a sampled second answer: one question
        f.write(turn("self-2", "train", "How?"))
    pack(work, corpus)
    out, questions = tmp_path / "own.jsonl", tmp_path / "q.jsonl"
    argv = ["datastore", "own-corpus", "--corpus", str(corpus), "--out", str(out)]
    assert main([*argv, "--questions-out", str(questions)]) == 0
    assert json.loads(capsys.readouterr().out)["conversations"] == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["self-0", "self-2"] and records[0]["messages"][0]["content"] == "Hi"
    asked = [json.loads(line) for line in questions.read_text().splitlines()]
    assert asked == [{"question_id": "self-1", "category": "self", "turns": ["Why?"]}]
    packed = corpus / "conversations.jsonl.xz"
    packed.write_bytes(packed.read_bytes()[:-8])
    assert main(argv) == 2
    assert "missing or damaged" in capsys.readouterr().err
