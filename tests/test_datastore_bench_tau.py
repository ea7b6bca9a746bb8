"""τ by replay: hand-made references and drafters, and draftretriever's tree cut."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from client.bench.datastore import (
    ReferenceRun,
    accepted_length,
    draft_nodes,
    draftretriever_tree,
    load_references,
    replay_tau,
    save_references,
)


def test_accepted_length_is_the_longest_trie_path_on_the_target() -> None:
    siblings = [[4, 2], [4, 9, 1], [7]]
    assert accepted_length(siblings, [4, 9, 5]) == 2
    assert accepted_length(siblings, [4, 9, 1, 5]) == 3
    assert accepted_length(siblings, [4, 2, 1]) == 2
    assert accepted_length(siblings, [7, 7]) == 1
    assert accepted_length(siblings, [5]) == 0
    assert accepted_length([], [4]) == 0
    assert accepted_length([[4, 9, 1]], [4, 9]) == 2  # the target ends first


def test_draft_nodes_counts_shared_prefixes_once() -> None:
    assert draft_nodes([[4, 2], [4, 9], [7]]) == 4
    assert draft_nodes([[4], [4, 2], [4, 2]]) == 2
    assert draft_nodes([]) == 0


def test_replay_of_the_docstring_example() -> None:
    stats = replay_tau([ReferenceRun((1, 2), (5, 6, 7, 8, 9))], lambda ctx: [[6, 7], [6, 9]])
    assert (stats.steps, stats.emitted, stats.accepted, stats.tau) == (2, 4, 2, 2.0)


def test_replay_sees_prompt_plus_reference_up_to_the_root() -> None:
    seen: list[list[int]] = []

    def propose(ctx: np.ndarray) -> list[list[int]]:
        seen.append(ctx.tolist())
        return []

    stats = replay_tau([ReferenceRun((1, 2), (5, 6, 7))], propose)
    assert seen == [[1, 2, 5], [1, 2, 5, 6]]
    assert stats.to_json() == {
        "tau": 1.0,
        "mean_accepted": 0.0,
        "drafted_share": 0.0,
        "mean_nodes": 0.0,
        "steps": 2,
        "tokens": 2,
    }


def test_replay_with_a_sibling_tree_equals_a_plain_greedy_loop() -> None:
    """A drafter that knows the next tokens on one branch of a tree with siblings: the replay
    equals a step-by-step simulation of greedy verification written out by hand."""
    rng = np.random.default_rng(0)
    reference = tuple(int(t) for t in rng.integers(0, 5, size=60))
    prompt = (9, 9)

    def propose(ctx: np.ndarray) -> list[list[int]]:
        i = len(ctx) - len(prompt) - 1  # position of the root in the reference
        truth = list(reference[i + 1 : i + 1 + int(rng.integers(0, 4))])
        wrong = [(t + 1) % 5 for t in truth]
        branch = truth[:1] + wrong[1:]  # a sibling after the first token
        return [branch, truth, wrong]

    rng_state = rng.bit_generator.state
    stats = replay_tau([ReferenceRun(prompt, reference)], propose)

    rng.bit_generator.state = rng_state  # the same drafts again, by hand
    i, steps, emitted = 0, 0, 0
    while i < len(reference) - 1:
        drafts = propose(np.array(prompt + reference[: i + 1]))
        accepted = 0
        for d in drafts:  # the tree's best path
            n = 0
            while n < len(d) and i + 1 + n < len(reference) and d[n] == reference[i + 1 + n]:
                n += 1
            accepted = max(accepted, n)
        accepted = min(accepted, len(reference) - 2 - i)
        steps += 1
        emitted += accepted + 1
        i += accepted + 1
    assert (stats.steps, stats.emitted) == (steps, emitted) and emitted == len(reference) - 1
    assert stats.tau > 1.5 and stats.drafted_steps < stats.steps  # some drafts were empty


def test_replay_of_several_runs_adds_up() -> None:
    runs = [ReferenceRun((1,), (5, 6, 7, 8)), ReferenceRun((2,), (3,)), ReferenceRun((), ())]

    def oracle(ctx: np.ndarray) -> Sequence[Sequence[int]]:
        return [[6, 7, 8, 99]] if ctx.tolist() == [1, 5] else []

    stats = replay_tau(runs, oracle)
    # run 1: one step accepts 6 7 (8 is the bonus, the last reference token); runs 2, 3: no steps
    assert (stats.steps, stats.emitted, stats.accepted, stats.drafted_steps) == (1, 3, 2, 1)
    assert stats.tau == 3.0


def test_draftretriever_tree_keeps_its_buffers_first_nodes() -> None:
    paths = [[9, 9, -2], [4, 5, 6]]
    assert draftretriever_tree(paths, 3) == [(9,), (4,), (9, 9)]
    assert draftretriever_tree(paths) == [(9,), (4,), (9, 9), (4, 5), (4, 5, 6)]
    # a depth numbers tokens, not nodes: 9 is depth 1's number 0 under 9 and under 4
    assert draftretriever_tree([[9, 9], [4, 9], [4, 5]]) == [(9,), (4,), (9, 9), (4, 9), (4, 5)]
    assert draftretriever_tree([]) == []


def test_draftretriever_tree_matches_the_library_cut() -> None:
    """With more than 64 nodes, the kept nodes are those the library's mask covers (65 rows)."""
    draftretriever = pytest.importorskip("draftretriever")
    import tempfile

    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "x.idx")
        writer = draftretriever.Writer(file_path=path, vocab_size=60)
        for _ in range(200):
            writer.add_entry(rng.integers(0, 40, size=50).tolist())
        writer.finalize()
        del writer
        reader = draftretriever.Reader(index_file_path=path)
        cut = 0
        for _ in range(20):
            query = rng.integers(0, 40, size=16).tolist()
            paths, mask, _, positions, _ = reader.search(query, choices=64)
            if not len(paths):
                continue
            kept = draftretriever_tree(paths)
            assert len(mask) == len(kept) + 1  # the root and the kept nodes
            depths = sorted(len(node) for node in kept)
            assert sorted(positions[1:]) == depths
            cut += draft_nodes(paths) > len(kept)
        assert cut > 0  # the 64-node cut was exercised


def test_references_round_trip(tmp_path: Path) -> None:
    runs = [("q0", 0, ReferenceRun((1, 2), (3, 4))), ("q0", 1, ReferenceRun((1, 2, 3, 4, 5), (6,)))]
    path = tmp_path / "refs.json"
    save_references(path, runs, {"max_new_tokens": 2})
    meta, loaded = load_references(path)
    assert meta == {"max_new_tokens": 2} and loaded == [r for _, _, r in runs]
    assert json.loads(path.read_text())["runs"][1]["question_id"] == "q0"
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a references file"):
        load_references(tmp_path / "bad.json")


def test_cli_datastore_bench_tau_from_saved_references(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Answers that are corpus text: our retriever drafts them (τ > 1); draftretriever too."""
    pytest.importorskip("draftretriever")
    from transformers import AutoTokenizer

    from client.cli import main
    from datastore_svc.store import tokenizer_identity
    from llm_worker.model.loading import default_model_dir

    texts = [f"def add_{i}(x, y):\n    return x + y + {i}\n" for i in range(40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    store = str(tmp_path / "v")
    assert main(["datastore", "build", "--corpus", str(corpus), "--out", store, "--quiet"]) == 0
    capsys.readouterr()
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    runs = []
    for i in (3, 17):
        ids = tok(texts[i], add_special_tokens=False)["input_ids"]
        runs.append((f"q{i}", 0, ReferenceRun(tuple(ids[:4]), tuple(ids[4:]))))
    refs = tmp_path / "refs.json"
    meta = {"tokenizer_fingerprint": tokenizer_identity(tok)["fingerprint"], "max_new_tokens": 128}
    save_references(refs, runs, meta)
    args = ["datastore", "bench", "--datastore", store, "--queries", "20", "--tau", "--references", str(refs)]
    assert main([*args, "--draftretriever"]) == 0
    tau = json.loads(capsys.readouterr().out)["tau"]
    assert tau["references"] == {"runs": 2, "tokens": sum(len(r.reference) for _, _, r in runs)}
    assert tau["specdraft"]["tau"] > 2.0 and tau["specdraft"]["drafted_share"] == 1.0
    assert tau["specdraft_l4"]["tau"] <= 5.0  # 4 drafts and a bonus token per step at most
    assert tau["draftretriever"]["steps"] > 0 and tau["draftretriever_last2"]["steps"] > 0
    assert main([*args, "--max-new-tokens", "64"]) == 2  # answers of another length
    assert "128 new tokens" in capsys.readouterr().err


def test_cli_generates_references_as_specdraft_bench_prompts(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tau without saved answers runs ``ar`` on the questions (each turn sees the earlier
    answers) and saves prompt and answer per turn; a second run reads them back."""
    from client.cli import main
    from llm_worker.chat import chat_prompt_ids
    from llm_worker.config import ModelConfig
    from llm_worker.engine import Engine, GenerationRequest
    from llm_worker.model import load_target

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"item {i} and item {i + 1}"}) for i in range(30)))
    store = str(tmp_path / "v")
    assert main(["datastore", "build", "--corpus", str(corpus), "--out", store, "--quiet"]) == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "a", "category": "x", "turns": ["Hi.", "More."]}) + "\n")
    refs = tmp_path / "refs.json"
    args = ["datastore", "bench", "--datastore", store, "--model", str(tiny_dir), "--queries", "5", "--tau"]
    args += ["--questions", str(questions), "--references", str(refs), "--max-new-tokens", "6"]
    capsys.readouterr()
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["tau"]
    meta, runs = load_references(refs)
    assert meta["max_new_tokens"] == 6 and len(runs) == 2

    target, tokenizer = load_target(ModelConfig(path=str(tiny_dir)))
    engine = Engine(target)
    messages = [{"role": "user", "content": "Hi."}]
    for run, turn in zip(runs, ("Hi.", "More."), strict=True):
        if turn != "Hi.":
            answer = tokenizer.decode(runs[0].reference, skip_special_tokens=True)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": turn}]
        prompt = chat_prompt_ids(tokenizer, messages)
        assert run.prompt == tuple(prompt)
        assert list(run.reference) == engine.generate(GenerationRequest(tuple(prompt), 6, "ar")).token_ids
    assert main(args) == 0  # from the saved answers
    assert json.loads(capsys.readouterr().out)["tau"] == first
