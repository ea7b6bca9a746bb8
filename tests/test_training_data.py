"""The training data's pieces: instruction filter, a stable held-out split, answer masks through the
real chat template, the draft vocabulary."""

from __future__ import annotations

from pathlib import Path

from llm_worker.training.data import keep_instruction, local_tasks, split_of, user_turn_prefix
from llm_worker.training.features import conversation_ids


def test_instruction_filter() -> None:
    assert keep_instruction("Give me three tips for a job interview.")
    for bad in (
        "ok",
        "<|im_start|>user hello there friend",
        "这是一个很长的中文句子，不是英文的指令。",
        "a" * 700,
    ):
        assert not keep_instruction(bad), bad


def test_split_is_stable_and_near_its_fraction() -> None:
    texts = [f"prompt number {i}" for i in range(4000)]
    held = [t for t in texts if split_of(t, 0.1) == "heldout"]
    assert 300 < len(held) < 500
    assert held == [t for t in reversed(texts) if split_of(t, 0.1) == "heldout"][::-1]
    assert split_of("  Prompt Number 7 ", 0.1) == split_of("prompt number 7", 0.1)


def test_answer_mask_covers_each_answer_and_its_end(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Hi again."},
    ]
    made = conversation_ids(tok, messages)
    assert made is not None
    ids, mask = made
    predicted = [tok.decode([ids[p + 1]]) for p in range(len(ids) - 1) if mask[p]]
    assert (
        "".join(predicted).replace("<|im_end|>", "|") == "Hi there!|\nHi again.|\n"
    )  # the template's turn end
    prefix = tok.decode(user_turn_prefix(tok, []))
    assert prefix.endswith("<|im_start|>user\n")


def test_local_tasks_leave_out_excluded_modules() -> None:
    tasks = local_tasks(20, seed=1, exclude_modules={"textwrap"}, doc_root=Path("/nonexistent"))
    assert len(tasks) == 20 and len(set(tasks)) == 20
    assert not any("def shorten(text, width" in t for t in tasks)


def test_features_store_hidden_states_at_answers_or_everywhere(tiny_dir: Path, tmp_path: Path) -> None:
    import json

    import pytest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_worker.training.features import FeatureConfig, load_sequences, make_features

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    conv = {"split": "train", "messages": [{"role": "user", "content": "Say hi."}]}
    conv["messages"].append({"role": "assistant", "content": "Hi there, friend."})
    (tmp_path / "c.jsonl").write_text(json.dumps(conv) + "\n")
    for everywhere in (False, True):
        out = tmp_path / f"f-{everywhere}"
        cfg = FeatureConfig(layer=0, hidden_everywhere=everywhere)
        make_features(model, tok, tmp_path / "c.jsonl", out, cfg, "w")
        (seq,) = load_sequences(out, "train")
        assert seq.hidden.shape[0] == int(seq.hidden_mask.sum())
        assert bool((seq.hidden_mask | ~seq.loss_mask).all())  # every answer position has a label
        expected = len(seq.tokens) - 1 if everywhere else int(seq.loss_mask.sum())
        assert int(seq.hidden_mask.sum()) == expected
        with pytest.raises(ValueError):  # the same directory for another layer is refused
            make_features(model, tok, tmp_path / "c.jsonl", out, FeatureConfig(layer=1), "w")
