"""The built-in question suites, calibration prompts and the JSONL loader (no model needed)."""

from __future__ import annotations

import json
import lzma
import re
import subprocess
import sys
from pathlib import Path

import pytest

from client.bench.suite import (
    CALIBRATION_SOURCES,
    CATEGORIES,
    MAX_CHARS,
    MIN_CHARS,
    SUITE_SOURCES,
    Question,
    builtin_suite,
    calibration_prompts,
    count_occurrences,
    function_rename,
    leading_prose,
    load_questions,
    rename_target,
    suite_names,
    truncate_at_line,
)

RENAME = re.compile(r"Rename the (?:parameter|function) `(\w+)` to `(\w+)`")
FENCE = re.compile(r"```python\n(.*?)\n```", re.DOTALL)


@pytest.fixture(scope="module")
def suite() -> list[Question]:
    return builtin_suite()


def size(turns: tuple[str, ...]) -> int:
    return sum(len(turn) for turn in turns)


def top_modules(sources: dict[str, tuple[str, ...]]) -> set[str]:
    return {name.split(".")[0] for names in sources.values() for name in names}


# ----------------------------------------------------------------------------- builtin_suite


def test_suite_is_deterministic(suite: list[Question]) -> None:
    assert builtin_suite() == suite
    assert builtin_suite("input-guided", 4) == suite


def test_every_category_has_per_category_questions(suite: list[Question]) -> None:
    assert len(suite) == 4 * len(CATEGORIES)
    for category in CATEGORIES:
        ids = [q.question_id for q in suite if q.category == category]
        assert ids == [f"ig-{category}-{i}" for i in range(4)]
    assert len({q.question_id for q in suite}) == len(suite)


def test_per_category_scales() -> None:
    assert len(builtin_suite(per_category=1)) == len(CATEGORIES)
    assert builtin_suite(per_category=0) == []
    bigger = builtin_suite(per_category=8)
    assert len(bigger) == 8 * len(CATEGORIES)
    # A larger suite extends the smaller one: same questions first.
    assert bigger[: 4 * len(CATEGORIES)] == builtin_suite(per_category=4)


def test_order_interleaves_categories(suite: list[Question]) -> None:
    assert [q.category for q in suite] == list(CATEGORIES) * 4
    assert [q.question_id for q in suite[: len(CATEGORIES)]] == [f"ig-{c}-0" for c in CATEGORIES]


def test_questions_are_distinct(suite: list[Question]) -> None:
    assert len({q.turns for q in builtin_suite(per_category=8)}) == 8 * len(CATEGORIES)


def test_sizes_within_bounds() -> None:
    for question in builtin_suite(per_category=8):
        assert question.turns and all(turn.strip() for turn in question.turns)
        assert MIN_CHARS <= size(question.turns) <= MAX_CHARS, question.question_id


def test_turn_counts(suite: list[Question]) -> None:
    for question in suite:
        assert len(question.turns) == (2 if question.category == "multi-turn" else 1)


def test_code_questions_carry_code(suite: list[Question]) -> None:
    for question in suite:
        if question.category in ("code-editing", "multi-turn"):
            assert FENCE.search(question.turns[0]), question.question_id


def test_rename_targets_occur_in_their_code() -> None:
    renames = 0
    for question in builtin_suite(per_category=8):
        text = "\n".join(question.turns)
        match = RENAME.search(text)
        if match is None:
            continue
        renames += 1
        old, new = match.groups()
        code = FENCE.search(question.turns[0])
        assert code is not None
        assert count_occurrences(old, code.group(1)) >= 1, question.question_id
        assert count_occurrences(new, code.group(1)) == 0, question.question_id
    assert renames >= 3


def test_unknown_suite_name() -> None:
    assert "input-guided" in suite_names()
    with pytest.raises(ValueError, match="input-guided"):
        builtin_suite("no-such-suite")


def test_impossible_counts_raise() -> None:
    with pytest.raises(ValueError):
        builtin_suite(per_category=-1)
    with pytest.raises(ValueError, match="per category"):
        builtin_suite(per_category=10_000)


# ----------------------------------------------------------------------------- calibration


def test_calibration_prompts_deterministic_and_sized() -> None:
    prompts = calibration_prompts()
    assert prompts == calibration_prompts(24)
    assert len(prompts) == 24
    assert len(set(prompts)) == 24
    assert all(MIN_CHARS <= len(p) <= MAX_CHARS for p in prompts)
    assert calibration_prompts(5) == prompts[:5]
    assert calibration_prompts(0) == []


def test_calibration_sources_disjoint_from_suite() -> None:
    assert set(CALIBRATION_SOURCES) <= set(CATEGORIES)
    assert not top_modules(dict(SUITE_SOURCES)) & top_modules(dict(CALIBRATION_SOURCES))


def test_calibration_text_not_in_suite(suite: list[Question]) -> None:
    suite_text = "\n".join(turn for q in builtin_suite(per_category=8) for turn in q.turns)
    for prompt in calibration_prompts():
        body = prompt.split("\n\n", 1)[1]  # drop the instruction
        assert body[:200] not in suite_text


# ----------------------------------------------------------------------------- helpers


def test_rename_target_picks_a_used_parameter() -> None:
    code = "def f(self, text, width, a):\n    return text[:width] + text + a\n"
    assert rename_target(code) == ("text", "text_value")
    assert rename_target("def f(a, b):\n    return a + b\n") is None  # names too short
    assert rename_target("x = 1\n") is None
    taken = "def f(text):\n    text_value = text\n    return text_value\n"
    assert rename_target(taken) == ("text", "text_arg")


def test_rename_target_on_truncated_code() -> None:
    code = 'def g(\n    items,\n    key=None,\n):\n    """Doc.\n    for item in items:'
    assert rename_target(code) == ("items", "items_value")
    assert function_rename(code) == ("g", "g_impl")


def test_truncate_at_line() -> None:
    assert truncate_at_line("ab\ncd\nef", 6) == "ab\ncd"
    assert truncate_at_line("ab\ncd", 10) == "ab\ncd"
    assert truncate_at_line("one two three", 8) == "one two"


def test_leading_prose_stops_at_examples() -> None:
    doc = "First.\n\nSecond para.\n\n>>> f()\n1\n\nAfter."
    assert leading_prose(doc, 1000) == "First.\n\nSecond para."
    assert leading_prose(doc, 10) == "First."


# ----------------------------------------------------------------------------- load_questions


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_spec_bench_format(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "q.jsonl",
        [
            json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"], "reference": []}),
            "",
            json.dumps({"question_id": "x-1", "category": "qa", "turns": ["c"]}),
        ],
    )
    assert load_questions(path) == [
        Question("81", "writing", ("a", "b")),
        Question("x-1", "qa", ("c",)),
    ]


def test_load_prompt_format(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "p.jsonl", ["  ", json.dumps({"prompt": "hello"}), json.dumps({"prompt": "hi"})]
    )
    assert load_questions(str(path)) == [
        Question("2", "default", ("hello",)),
        Question("3", "default", ("hi",)),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"question_id": 1}), "each line needs 'turns'"),
        (json.dumps({"turns": []}), "'turns' must be a non-empty list of strings"),
        (json.dumps({"turns": ["ok", 3]}), "'turns' must be a non-empty list of strings"),
        (json.dumps({"turns": ["  "]}), "'turns' must be a non-empty list of strings"),
        (json.dumps({"prompt": ""}), "'prompt' must be a non-empty string"),
        (json.dumps({"prompt": "x", "category": ""}), "'category'"),
        (json.dumps({"prompt": "x", "question_id": ""}), "'question_id'"),
    ],
)
def test_load_malformed(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), "", line])
    with pytest.raises(ValueError, match=re.escape(f"bad.jsonl:3: {message}")):
        load_questions(path)


def test_load_duplicate_ids(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "dup.jsonl",
        [json.dumps({"question_id": 7, "turns": ["a"]}), json.dumps({"question_id": "7", "turns": ["b"]})],
    )
    with pytest.raises(ValueError, match=r"dup\.jsonl:2: duplicate question_id '7' \(first on line 1\)"):
        load_questions(path)


def test_same_questions_without_docstrings() -> None:
    """Under ``python -OO`` docstrings are read from the source: the suite must not change."""
    script = (
        "import json; from client.bench.suite import builtin_suite, calibration_prompts; "
        "print(json.dumps([list(q.turns) for q in builtin_suite()] + calibration_prompts()))"
    )
    result = subprocess.run([sys.executable, "-OO", "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == [list(q.turns) for q in builtin_suite()] + calibration_prompts()


def test_the_repeated_suite_asks_held_out_questions_again() -> None:
    suite = builtin_suite("repeated", 8)
    first_turns = [q.turns[0] for q in suite if q.category == "first"]
    assert len(first_turns) == 8 and len(suite) == 32
    for position, q in enumerate(suite):
        if q.category == "first":
            continue
        asked = [i for i, text in enumerate(first_turns) if text in q.turns[0]]
        assert len(asked) == 1, q.question_id  # another user asks one earlier question again
        assert suite.index(next(f for f in suite if f.turns[0] == first_turns[asked[0]])) < position
        assert (q.category == "follow-up") == (len(q.turns) == 2)
    categories = [q.category for q in builtin_suite("repeated", 1)]
    assert categories == ["first", "repeated", "near-repeated", "follow-up"]
    # the corpus's held-out questions only: no drafter was trained on them
    (prompts,) = (Path(__file__).parents[1] / "corpus").glob("*/prompts.jsonl.xz")
    with lzma.open(prompts, "rt", encoding="utf-8") as f:
        split = {(r := json.loads(line))["text"].strip(): r["split"] for line in f}
    assert {split[text] for text in first_turns} == {"heldout"}
