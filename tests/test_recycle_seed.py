"""``recycle`` seeds (a hot start): rows written from the target's own answers equal its top k at
those positions, a file round-trips whole or is refused with the reason, every tenant starts from
the seed and writes only its own copy, and the CLI builds one from a chat corpus on a tiny model
that a bench then loads."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from numpy.lib.npyio import NpzFile

from helpers.models import tiny_target
from llm_worker.assembly import AssemblyError, ResourceConfig, build_resources
from llm_worker.drafters.recycle_seed import SeedError, SeedInfo, load_seed, save_seed, seed_rows
from llm_worker.drafters.recycle_store import EMPTY, RecycleStore, TenantMatrix
from llm_worker.types import ArtifactNeeds

SLOTS = 1 << 10


def test_seeded_rows_are_the_targets_top_k_after_each_answer_position() -> None:
    target = tiny_target()
    examples = [([3, 4, 5], [6, 7, 8]), ([9, 10], [11]), ([12], [])]  # the last has no answer
    matrix, read, written = seed_rows(target, examples, k=4, slots=SLOTS)
    assert (read, written) == (2, 4 + 2)
    for prompt, answer in examples[:2]:
        ids = [*prompt, *answer]
        logits = target.forward(target.start(), torch.tensor(ids), None, ArtifactNeeds()).logits
        for i in range(len(prompt) - 1, len(ids)):
            top = torch.topk(logits[i], 4).indices.tolist()
            row, order, when = matrix.row(ids[max(0, i - 2) : i + 1])
            assert row.tolist() == top and when == 0
            assert order == min(i + 1, 3) if i >= 1 else order == 1
    assert matrix.written[[5, 6, 7, 8, 10, 11]].tolist() == [0] * 6 and matrix.written[3] == -1


def seeded() -> tuple[TenantMatrix, SeedInfo]:
    matrix = TenantMatrix.empty(20, 4, SLOTS)
    matrix.next[5] = [1, 2, 3, 4]
    matrix.written[5] = 0
    return matrix, SeedInfo("abc", 20, 4, SLOTS, 1, 1, "test")


def test_a_seed_file_round_trips_and_a_foreign_or_broken_one_is_refused(tmp_path: Path) -> None:
    matrix, info = seeded()
    path = tmp_path / "seed.npz"
    save_seed(path, matrix, info)
    loaded, read = load_seed(path, "abc", 4, SLOTS, vocab=20)
    assert read == info and loaded.next.tolist() == matrix.next.tolist()
    assert loaded.written.tolist() == matrix.written.tolist()
    assert not loaded.next.flags.writeable and not loaded.context_next.flags.writeable  # shared, read-only
    with pytest.raises(SeedError, match="another tokenizer"):
        load_seed(path, "xyz", 4, SLOTS)
    with pytest.raises(SeedError, match="vocabulary of 20"):
        load_seed(path, "abc", 4, SLOTS, vocab=21)
    with pytest.raises(SeedError, match="k=4"):
        load_seed(path, "abc", 8, SLOTS)
    good = path.read_bytes()
    rng = np.random.default_rng(0)
    for offset in rng.integers(0, len(good), 60).tolist():  # any damaged byte: a SeedError or a seed
        broken = bytearray(good)
        broken[offset] ^= 0xFF
        path.write_bytes(bytes(broken))
        with contextlib.suppress(SeedError):
            load_seed(path, "abc", 4, SLOTS)
    path.write_bytes(good[:100])
    with pytest.raises(SeedError, match="not a readable seed"):
        load_seed(path, "abc", 4, SLOTS)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m, i: (m.next.__setitem__(6, [25, 1, 2, 3]), i), "outside the vocabulary"),
        (lambda m, i: (m.context_next.__setitem__(3, [1, 2, 99, 3]), i), "outside the vocabulary"),
        (lambda m, i: (m.next.__setitem__(6, [1, 2, 1, 3]), i), "a token twice"),
        (lambda m, i: (None, SeedInfo(5, 20, 4, SLOTS, 1, 1)), "malformed record"),  # type: ignore[arg-type]
    ],
    ids=["token", "context token", "twice", "record"],
)
def test_a_seed_with_rows_no_target_writes_is_refused(tmp_path: Path, change: object, reason: str) -> None:
    matrix, info = seeded()
    _, info = change(matrix, info)  # type: ignore[operator]
    path = tmp_path / "seed.npz"
    save_seed(path, matrix, info)
    with pytest.raises(SeedError, match=reason):
        load_seed(path, None, 4, SLOTS)


def test_arrays_other_than_the_record_declares_are_refused_before_they_are_read(tmp_path: Path) -> None:
    matrix, _ = seeded()
    path = tmp_path / "seed.npz"
    save_seed(path, matrix, SeedInfo("abc", 10**9, 4, SLOTS, 1, 1))  # a record claiming 10**9 tokens
    read = NpzFile.__getitem__

    def record_only(self: NpzFile, key: str) -> np.ndarray:
        assert key == "info", f"{key} decompressed"
        return read(self, key)  # type: ignore[no-any-return]

    with (
        mock.patch.object(NpzFile, "__getitem__", record_only),
        pytest.raises(SeedError, match="next is int32"),
    ):
        load_seed(path, None, 4, SLOTS)


def test_a_failed_write_leaves_the_old_seed_and_no_partial_file(tmp_path: Path) -> None:
    matrix, info = seeded()
    path = tmp_path / "seed.npz"
    save_seed(path, matrix, info)
    before = path.read_bytes()
    with mock.patch("numpy.savez_compressed", side_effect=OSError("disk full")), pytest.raises(OSError):
        save_seed(path, TenantMatrix.empty(20, 4, SLOTS), info)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["seed.npz"]


def test_every_tenant_starts_from_the_seed_and_writes_its_own_copy() -> None:
    seed, _ = seeded()
    store = RecycleStore(k=4, context_slots=SLOTS, seed=seed)
    assert store.get("a") is seed and store.get("b") is seed  # read, not copied, until written
    store.observe("a", 20, np.array([5]), np.array([[9, 8, 7, 6]]))
    a = store.get("a")
    assert a is not None and a is not seed and a.next[5].tolist() == [9, 8, 7, 6]
    assert seed.next[5].tolist() == [1, 2, 3, 4] and store.get("b") is seed  # b never sees a's rows
    store.observe("b", 20, np.array([6]), np.array([[1, 1, 1, 1]]))
    b = store.get("b")
    assert b is not None and b.next[5].tolist() == [1, 2, 3, 4] and b.next[6].tolist() == [1, 1, 1, 1]
    assert a.next[6].tolist() == [EMPTY] * 4
    small = RecycleStore(max_tenants=1, k=4, context_slots=SLOTS, seed=seed)
    small.observe("a", 20, np.array([5]), np.array([[9, 8, 7, 6]]))
    small.observe("b", 20, np.array([6]), np.array([[9, 8, 7, 6]]))  # evicts a
    assert small.get("a") is seed  # a starts from the seed again
    with pytest.raises(ValueError, match="k and context_slots"):
        RecycleStore(k=8, context_slots=SLOTS, seed=seed)


def test_a_worker_refuses_a_seed_it_cannot_use(tmp_path: Path) -> None:
    path = tmp_path / "seed.npz"
    path.write_text("not a seed")
    with pytest.raises(AssemblyError, match="not a readable seed"):
        build_resources(ResourceConfig(recycle_seed=str(path)), None)


@pytest.mark.slow
def test_the_cli_builds_a_seed_that_a_bench_loads(tiny_dir: Path, tmp_path: Path) -> None:
    from client.cli import main

    corpus = tmp_path / "corpus.jsonl"
    chats = [("Name a colour.", "Blue is a colour."), ("Count to three.", "One, two, three.")]
    with corpus.open("w") as f:
        for question, answer in chats:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
        f.write(json.dumps({"text": "no chat"}) + "\n")  # skipped
    out = tmp_path / "seed.npz"
    base = ["datastore", "recycle-seed", "--model", str(tiny_dir), "--corpus", str(corpus), "--out", str(out)]
    assert main(base) == 0
    matrix, info = load_seed(out, None, 8, 1 << 16)
    assert info.conversations == 2 and info.tokens > 10 and (matrix.written == 0).sum() > 5
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": "q", "category": "c", "turns": ["Name a colour."]}) + "\n"
    )
    bench = ["bench", "--model", str(tiny_dir), "--questions", str(questions), "--modes", "ar,recycle"]
    assert main([*bench, "--max-new-tokens", "8", "--recycle-seed", str(out)]) == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "x"}) + "\n")
    none = tmp_path / "none.npz"
    assert main([*base[:-4], "--corpus", str(empty), "--out", str(none)]) == 2  # one CLI line
    assert not none.exists()


def test_a_seeded_store_drafts_from_the_start_and_stays_lossless() -> None:
    from helpers.models import FLAT_CURVE
    from llm_worker.config import EngineConfig, PlannerConfig, SamplingParams
    from llm_worker.drafters import DraftResources
    from llm_worker.engine import Engine, GenerationRequest

    target = tiny_target()
    prompt = (5, 6, 7, 8, 5, 6, 7)
    plain = Engine(target, EngineConfig(planner=PlannerConfig()), curve=FLAT_CURVE)
    answer = plain.generate(GenerationRequest(prompt, 24, "ar")).token_ids
    seed, _, _ = seed_rows(target, [(prompt, answer)])  # the target's own answer to this prompt
    resources = DraftResources(recycling=RecycleStore(seed=seed))
    engine = Engine(target, EngineConfig(planner=PlannerConfig()), curve=FLAT_CURVE, resources=resources)
    first = engine.generate(GenerationRequest(prompt, 24, "recycle", tenant="new"))
    assert first.token_ids == answer and first.stats.accepted_tokens > 0  # its very first request
    for seed_value in range(3):
        params = SamplingParams(temperature=0.8, seed=seed_value)
        ref = plain.generate(GenerationRequest(prompt, 24, "ar", params)).token_ids
        assert engine.generate(GenerationRequest(prompt, 24, "recycle", params)).token_ids == ref
