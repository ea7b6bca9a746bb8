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


def test_features_store_the_hidden_states_a_recipe_asks_for(tiny_dir: Path, tmp_path: Path) -> None:
    """EDD's features: one layer's hidden states at every position and no K/V; they are the
    target's own (``output_hidden_states``); a directory made for other layers is refused."""
    import json

    import pytest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_worker.training.features import FeatureConfig, load_sequences, make_features

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    conv = {"split": "train", "messages": [{"role": "user", "content": "Say hi."}]}
    conv["messages"].append({"role": "assistant", "content": "Hi there, friend."})
    (tmp_path / "c.jsonl").write_text(json.dumps(conv) + "\n")
    cfg = FeatureConfig(layer=None, hidden_layers=(1,))
    assert cfg.dirname == "features-h1"
    both = FeatureConfig(layer=2, hidden_layers=(0, 1), hidden_everywhere=True)
    assert both.dirname == "features-l2-h0-h1-all"
    out = tmp_path / cfg.dirname
    make_features(model, tok, tmp_path / "c.jsonl", out, cfg, "w")
    (seq,) = load_sequences(out, "train")
    assert seq.keys is None and seq.values is None and set(seq.states) == {1}
    with torch.inference_mode():
        expected = model.base_model(input_ids=seq.tokens[None], output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(seq.states[1].float(), expected, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="another target or layer"):
        other = FeatureConfig(layer=None, hidden_layers=(2,))
        make_features(model, tok, tmp_path / "c.jsonl", out, other, "w")


class RoundCompleter:
    """A stand-in for the target writing instructions: round ``seed``'s row i writes instruction
    number (7 · seed + i) mod 50, so rounds repeat each other's texts now and then."""

    batch_size = 8

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def complete(
        self, prefixes: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> list[tuple[list[int], bool]]:
        self.calls += 1
        texts = [
            f"Please write a short note about topic number {(7 * seed + i) % 50}."
            for i in range(len(prefixes))
        ]
        return [(self.tokenizer(t, add_special_tokens=False)["input_ids"], True) for t in texts]  # type: ignore[operator]


def test_a_resumed_prompt_stage_goes_on_from_the_next_round(tiny_dir: Path, tmp_path: Path) -> None:
    """Instructions made in two runs: the second starts at the round after the first's last (not
    at round 0, whose texts are all there already and which used to stall it for good), reaches
    the count, and a prompt's follow-up flag is the same whichever run wrote it."""
    import json

    from transformers import AutoTokenizer

    from llm_worker.training.data import DataConfig, make_prompts

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    make_prompts(RoundCompleter(tok), tok, DataConfig(instructions=40, local_tasks=0), whole)
    make_prompts(RoundCompleter(tok), tok, DataConfig(instructions=12, local_tasks=0), parts)
    second = RoundCompleter(tok)
    counts = make_prompts(second, tok, DataConfig(instructions=40, local_tasks=0), parts)
    assert counts["self"] == 40

    def records(path: Path) -> list[dict[str, object]]:
        return [json.loads(line) for line in path.read_text().splitlines()]

    first_rounds = [r["round"] for r in records(parts)[:12]]
    assert min(r["round"] for r in records(parts)[12:]) == max(first_rounds) + 1  # type: ignore[operator]
    flags = {r["text"]: r["follow_up"] for r in records(whole)}
    assert all(flags[r["text"]] == r["follow_up"] for r in records(parts) if r["text"] in flags)
    assert len({r["text"] for r in records(parts)}) == 40


def test_features_follow_the_conversations_and_keep_a_held_out_chunk(tiny_dir: Path, tmp_path: Path) -> None:
    """A chunk made before the conversations grew is made again (a resumed run does not skip the
    new ones), and the size bound never leaves the held-out split without features."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_worker.training.features import FeatureConfig, load_sequences, make_features

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()

    def conv(i: int, split: str = "train") -> str:
        messages = [{"role": "user", "content": f"Say hi {i}."}, {"role": "assistant", "content": f"Hi {i}!"}]
        return json.dumps({"id": f"c{i}", "split": split, "messages": messages}) + "\n"

    path, out = tmp_path / "c.jsonl", tmp_path / "f"
    cfg = FeatureConfig(layer=0, sequences_per_chunk=2)
    path.write_text("".join(conv(i) for i in range(3)))
    make_features(model, tok, path, out, cfg, "w")
    assert len(list(load_sequences(out, "train"))) == 3
    path.write_text("".join(conv(i) for i in range(4)))  # the conversations grew: c3 joins chunk 1
    make_features(model, tok, path, out, cfg, "w")
    assert len(list(load_sequences(out, "train"))) == 4

    bounded = tmp_path / "bounded"
    path.write_text("".join(conv(i) for i in range(4)) + conv(9, "heldout"))
    manifest = make_features(model, tok, path, bounded, FeatureConfig(layer=0, max_bytes=1), "w")
    assert manifest["truncated"] and len(list(load_sequences(bounded, "heldout"))) == 1


def test_batched_teacher_forcing_matches_one_sequence_at_a_time(tiny_dir: Path) -> None:
    """Features of sequences of different lengths forced together (right-padded, in groups that
    fit the token budget) are those of each sequence alone, up to float rounding."""
    from unittest import mock

    import torch
    from transformers import AutoModelForCausalLM

    from llm_worker.training import features

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(1, 90, (n,), generator=generator).tolist() for n in (7, 30, 1, 18)]
    alone = [features._teacher_forced(model, [s], 1, (0, 2))[0] for s in sequences]
    with mock.patch.object(features, "FORWARD_TOKENS", 40):  # two forwards: 30 + 18 > 40
        together = features._teacher_forced(model, sequences, 1, (0, 2))
    for s, one, many in zip(sequences, alone, together, strict=True):
        pairs = [(one.keys, many.keys), (one.values, many.values), (one.final, many.final)]
        pairs += [(one.states[h], many.states[h]) for h in (0, 2)]
        for a, b in pairs:
            assert a is not None and b is not None
            assert a.shape[-2 if a.dim() == 3 else 0] == len(s)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
