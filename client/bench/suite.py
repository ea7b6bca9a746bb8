"""Benchmark questions: a built-in input-guided suite, a workload of repeated questions, calibration
prompts and a JSONL loader.

*Input-guided* tasks (the PLD+ paper's term) are tasks whose answer largely copies from the
input: summarizing a text, editing code, rewriting a paragraph, continuing a conversation about a
snippet. Retrieval drafters shine on them, so they are the suite the benchmark runs by default.

The built-in suite is generated at run time from text every CPython installation carries:
standard-library docstrings and source code (``inspect.getdoc`` / ``inspect.getsource``). Only the
short task instructions live in this file. The same Python version gives the same questions;
a source that fails to import, or has no docstring or source (a C function, a frozen module),
is skipped, always in the same way.

Size of a question = total characters over its turns; every generated question lies in
[``MIN_CHARS``, ``MAX_CHARS``] (about 150–900 tokens for SmolLM2's tokenizer). Long texts are
cut at a line boundary.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final

CATEGORIES: Final = (
    "summarization",
    "code-editing",
    "short-text-editing",
    "long-text-editing",
    "multi-turn",
)
"""The input-guided categories, in the order questions interleave."""

MIN_CHARS: Final = 600
"""Smallest question (all turns together), in characters."""
MAX_CHARS: Final = 3500
"""Largest question (all turns together), in characters."""

_RESERVE: Final = 450
"""Characters kept free for instructions and fences when a source text is cut to size."""
_SHORT_TEXT_MAX: Final = 1100
"""Longest body of a short-text-editing question (leading prose paragraphs of a docstring)."""
_LONG_TEXT_MIN: Final = 1000
"""Shortest docstring that counts as a long text."""
_LONG_TEXT_PARAGRAPHS: Final = 3
"""Fewest paragraphs a long text must have."""
_MULTI_TURN_CODE_MAX: Final = 2000
"""Longest snippet in a multi-turn question: the model's first answer joins the context too."""


@dataclass(frozen=True)
class Question:
    """One benchmark question: a conversation of user turns.

    Each turn is one user chat message; the model answers each in order, and later turns see the
    model's own earlier answers (Spec-Bench / MT-Bench convention).
    """

    question_id: str
    """Unique within a suite, e.g. ``"ig-summarization-0"``."""
    category: str
    """Task category, one of ``CATEGORIES`` for the built-in suite."""
    turns: tuple[str, ...]
    """User messages, first to last; never empty."""
    system: str = ""
    """A system message before the first turn ("" = the chat template's own default)."""

    def messages(self, turns: int = 1) -> list[dict[str, str]]:
        """The chat of the first ``turns`` user turns, without answers (the system message first):
        what the first turn sends, for ``turns = 1``."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": t} for t in self.turns[:turns]]


# ---------------------------------------------------------------------------------------------
# Sources: dotted names of standard-library modules, functions and methods (Python >= 3.11).
# The suite and the calibration set use disjoint top-level modules.

SUITE_SOURCES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "summarization": (
            "json",
            "argparse",
            "heapq",
            "subprocess",
            "csv",
            "itertools",
            "random",
            "typing",
        ),
        "code-editing": (
            "textwrap.dedent",
            "json.dumps",
            "functools.total_ordering",
            "heapq.merge",
            "statistics.median",
            "fnmatch.translate",
            "string.capwords",
            "textwrap.indent",
            "shlex.split",
        ),
        "short-text-editing": (
            "functools.lru_cache",
            "statistics.quantiles",
            "difflib.get_close_matches",
            "string",
            "json.JSONEncoder",
            "random.Random.sample",
            "typing.get_type_hints",
            "textwrap.dedent",
        ),
        "long-text-editing": (
            "json.loads",
            "subprocess.run",
            "difflib.unified_diff",
            "statistics.linear_regression",
            "textwrap.TextWrapper",
            "collections.Counter",
            "statistics.median_grouped",
            "difflib.SequenceMatcher",
        ),
        "multi-turn": (
            "heapq.nsmallest",
            "statistics.variance",
            "difflib.get_close_matches",
            "textwrap.shorten",
            "collections.Counter.most_common",
            "calendar.TextCalendar.formatmonth",
            "fnmatch.filter",
            "subprocess.getstatusoutput",
        ),
    }
)
"""Per category of the input-guided suite, the stdlib objects its questions are made from."""

CALIBRATION_SOURCES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "summarization": (
            "timeit",
            "sched",
            "urllib.parse",
            "mimetypes",
            "tempfile",
            "getopt",
            "pprint",
            "colorsys",
        ),
        "code-editing": (
            "glob.glob",
            "mimetypes.guess_type",
            "ast.get_docstring",
            "cmd.Cmd.onecmd",
            "timeit.Timer.autorange",
            "ipaddress.ip_network",
            "queue.Queue.get",
            "email.utils.formataddr",
            "traceback.format_exception",
        ),
        "short-text-editing": (
            "dataclasses.field",
            "dataclasses.dataclass",
            "shutil.rmtree",
            "shutil.get_terminal_size",
            "urllib.parse.urlsplit",
            "getopt.getopt",
            "tempfile.mkstemp",
            "uuid.UUID.__init__",
        ),
        "long-text-editing": (
            "copy",
            "uuid",
            "hashlib",
            "shutil.copytree",
            "urllib.parse.quote",
            "logging.basicConfig",
            "logging.Formatter",
            "cmd",
        ),
    }
)
"""Per single-turn category, the stdlib objects calibration prompts are made from."""


# ---------------------------------------------------------------------------------------------
# Reading text out of the standard library.


def resolve(dotted: str) -> object | None:
    """The object a dotted name denotes (``"json.JSONEncoder.default"``), or None if unavailable.

    The longest importable prefix is imported; the rest is looked up with ``getattr``.
    """
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                return None
            obj = getattr(obj, attr)
        return obj
    return None


def source_of(obj: object) -> str | None:
    """Dedented source code of a function, method or class; None if there is none (C, frozen)."""
    try:
        return textwrap.dedent(inspect.getsource(obj)).strip("\n")  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


def docstring_of(obj: object) -> str | None:
    """Cleaned docstring of a module, class or function; read from source under ``python -OO``."""
    doc = getattr(obj, "__doc__", None)  # not inspect.getdoc: that inherits a base class's docstring
    if isinstance(doc, str) and doc.strip():
        return inspect.cleandoc(doc).strip()
    try:
        text = inspect.getsource(obj)  # type: ignore[arg-type]
        tree = ast.parse(textwrap.dedent(text))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree if inspect.ismodule(obj) else (tree.body[0] if tree.body else None)
    if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return ast.get_docstring(node, clean=True) or None


def truncate_at_line(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a line boundary (word boundary if one line).

    Example: ``truncate_at_line("ab\\ncd\\nef", 6) == "ab\\ncd"``.
    """
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit + 1)
    if cut <= 0:
        cut = text.rfind(" ", 0, limit + 1)
    return text[: cut if cut > 0 else limit].rstrip()


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of ``text``, stripped, empty ones dropped."""
    return [part.strip("\n") for part in re.split(r"\n\s*\n", text) if part.strip()]


def is_prose(paragraph: str) -> bool:
    """Whether a docstring paragraph is running text (no doctest, no indented block)."""
    lines = paragraph.splitlines()
    return not any(line.startswith((" ", "\t")) or line.lstrip().startswith(">>>") for line in lines)


def leading_prose(doc: str, limit: int) -> str:
    """The docstring's first run of prose paragraphs, as many as fit in ``limit`` characters."""
    kept: list[str] = []
    for paragraph in paragraphs(doc):
        if not is_prose(paragraph):
            if kept:
                break
            continue
        if len("\n\n".join([*kept, paragraph])) > limit:
            break
        kept.append(paragraph)
    return "\n\n".join(kept)


# ---------------------------------------------------------------------------------------------
# Code helpers: what a rename instruction may refer to.

_MIN_NAME_LEN: Final = 3
"""Shorter names ("a", "s") also match ordinary words, so they are never rename targets."""


def function_header(code: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The first function definition of ``code``, parsed from its header lines only.

    Works on sources cut to size, whose body may no longer parse: the decorators and ``def``
    line(s) are parsed with ``pass`` as the body. None if ``code`` does not start with a function.
    """
    lines = code.splitlines()
    for end in range(1, min(len(lines), 40) + 1):
        try:
            tree = ast.parse("\n".join(lines[:end]) + "\n    pass")
        except SyntaxError:
            continue
        node = tree.body[0] if tree.body else None
        return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
    return None


def count_occurrences(name: str, text: str) -> int:
    """How often ``name`` occurs in ``text`` as a whole identifier."""
    return len(re.findall(rf"(?<![\w.]){re.escape(name)}\b", text))


def fresh_name(base: str, code: str, suffixes: Sequence[str]) -> str | None:
    """``base + suffix`` for the first suffix whose result does not occur in ``code``."""
    for suffix in suffixes:
        if count_occurrences(base + suffix, code) == 0:
            return base + suffix
    return None


def rename_target(code: str) -> tuple[str, str] | None:
    """(old, new): a parameter of the function in ``code`` that is used in it, and a new name.

    The parameter used most often wins (ties: first in the signature); ``self``/``cls`` and names
    shorter than three characters are never chosen. Example: for ``def f(text, width):
    return text[:width] + text`` the answer is ``("text", "text_value")``.
    """
    header = function_header(code)
    if header is None:
        return None
    args = header.args
    params = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    candidates = [p for p in params if p not in ("self", "cls") and len(p) >= _MIN_NAME_LEN]
    used = [
        (count_occurrences(p, code), -i, p)
        for i, p in enumerate(candidates)
        if count_occurrences(p, code) >= 2
    ]
    if not used:
        return None
    old = max(used)[2]
    new = fresh_name(old, code, ("_value", "_arg", "_param"))
    return (old, new) if new is not None else None


def function_rename(code: str) -> tuple[str, str] | None:
    """(old, new): the name of the function in ``code`` and a new name not used in it."""
    header = function_header(code)
    if header is None or header.name.startswith("__"):
        return None
    new = fresh_name(header.name, code, ("_impl", "_v2", "_new"))
    return (header.name, new) if new is not None else None


# ---------------------------------------------------------------------------------------------
# Task templates. A template takes the material's text and returns the turns, or None if it
# does not apply (e.g. nothing to rename).

Template = Callable[[str], tuple[str, ...] | None]


def fenced(code: str) -> str:
    """``code`` in a Markdown Python fence."""
    return f"```python\n{code}\n```"


def _instruction(text: str) -> Callable[[str], tuple[str, ...]]:
    """Template: one turn, the instruction followed by the plain text."""
    return lambda body: (f"{text}\n\n{body}",)


def _code_instruction(text: str) -> Callable[[str], tuple[str, ...]]:
    """Template: one turn, the instruction followed by the fenced code."""
    return lambda code: (f"{text}\n\n{fenced(code)}",)


def _rename_parameter(code: str) -> tuple[str, ...] | None:
    """Template: rename a parameter that occurs in the code."""
    target = rename_target(code)
    if target is None:
        return None
    old, new = target
    return (
        f"Rename the parameter `{old}` to `{new}` everywhere in the following Python code and "
        f"return the complete updated code.\n\n{fenced(code)}",
    )


def _rename_function(code: str) -> tuple[str, ...] | None:
    """Template: rename the function itself."""
    target = function_rename(code)
    if target is None:
        return None
    old, new = target
    return (
        f"Rename the function `{old}` to `{new}` in the following Python code, including any "
        f"place that refers to it, and return the complete code.\n\n{fenced(code)}",
    )


def _about_code(code: str, question: str) -> str:
    """A first turn that shows the code and asks a question about it."""
    return f"Here is a Python function:\n\n{fenced(code)}\n\n{question}"


def _conversation(question: str, edit: str) -> Callable[[str], tuple[str, ...]]:
    """Template: two turns, a question about the code, then an edit of it."""
    return lambda code: (_about_code(code, question), edit)


def _rename_conversation(code: str) -> tuple[str, ...] | None:
    """Template: two turns, ask about the parameters, then rename one of them."""
    target = rename_target(code)
    if target is None:
        return None
    old, new = target
    return (
        _about_code(code, "Which parameters does it take, and what is each one used for?"),
        f"Rename the parameter `{old}` to `{new}` and show the complete updated function.",
    )


SUMMARIZE: Final[tuple[Template, ...]] = (
    _instruction("Summarize the following documentation in a few sentences."),
    _instruction("Write a summary of at most three sentences of the following documentation."),
    _instruction("Summarize the following documentation for a programmer who has never used it."),
)
EDIT_CODE: Final[tuple[Template, ...]] = (
    _rename_parameter,
    _code_instruction(
        "Add type hints to every parameter and return value in the following Python code. "
        "Change nothing else and return the complete code."
    ),
    _code_instruction(
        "Add a short comment above each block of the following Python code explaining what it "
        "does. Keep the code itself unchanged and return all of it."
    ),
    _rename_function,
    _code_instruction(
        "Remove the docstring and all comments from the following Python code, leaving every "
        "statement exactly as it is."
    ),
)
EDIT_SHORT_TEXT: Final[tuple[Template, ...]] = (
    _instruction(
        "Fix any grammar, spelling or punctuation mistakes in the following text and return the "
        "corrected text in full."
    ),
    _instruction("Rewrite the following text in a more formal tone, keeping every fact."),
    _instruction('Rewrite the following text so that it addresses the reader as "you", keeping its content.'),
    _instruction("Convert the following text to Markdown, putting every code name in backticks."),
)
EDIT_LONG_TEXT: Final[tuple[Template, ...]] = (
    _instruction(
        "Rewrite the following documentation as clear, well-structured prose, keeping all of its "
        "content and examples."
    ),
    _instruction(
        "Format the following documentation as a bulleted Markdown list, one bullet per point, "
        "keeping the original wording as far as possible."
    ),
    _instruction(
        "Add a short Markdown heading before each paragraph of the following documentation. "
        "Keep the paragraphs themselves unchanged."
    ),
    _instruction(
        "Correct any grammar mistakes in the following documentation and return the complete corrected text."
    ),
)
MULTI_TURN: Final[tuple[Template, ...]] = (
    _conversation(
        "What does it do? Answer in two or three sentences.",
        "Now rewrite the function with type hints on every parameter and on the return value. "
        "Show the complete function.",
    ),
    _rename_conversation,
    _conversation(
        "Can this code raise an exception? If so, when?",
        "Add a comment above each block of the function explaining what it does, and show the "
        "complete function.",
    ),
)


# ---------------------------------------------------------------------------------------------
# Per category: how to read the material, and the templates.


def _doc_text(obj: object) -> str | None:
    """Whole docstring, cut to size."""
    doc = docstring_of(obj)
    return truncate_at_line(doc, MAX_CHARS - _RESERVE) if doc else None


def _short_text(obj: object) -> str | None:
    """Leading prose paragraphs of the docstring (about one paragraph)."""
    doc = docstring_of(obj)
    return (leading_prose(doc, _SHORT_TEXT_MAX) or None) if doc else None


def _long_text(obj: object) -> str | None:
    """A docstring of several paragraphs, cut to size; None for short ones."""
    doc = docstring_of(obj)
    if not doc or len(doc) < _LONG_TEXT_MIN or len(paragraphs(doc)) < _LONG_TEXT_PARAGRAPHS:
        return None
    return truncate_at_line(doc, MAX_CHARS - _RESERVE)


def _code_text(obj: object) -> str | None:
    """Source code, cut to size."""
    code = source_of(obj)
    return truncate_at_line(code, MAX_CHARS - _RESERVE) if code else None


def _snippet_text(obj: object) -> str | None:
    """Source code short enough for a conversation."""
    code = source_of(obj)
    return truncate_at_line(code, _MULTI_TURN_CODE_MAX) if code else None


@dataclass(frozen=True)
class TaskKind:
    """How one category turns a stdlib object into questions."""

    extract: Callable[[object], str | None]
    """The material (a docstring, a paragraph, source code), or None if the object has none."""
    templates: tuple[Template, ...]
    """Instruction variants; each maps the material to the turns, or None if it does not apply."""


TASKS: Final[Mapping[str, TaskKind]] = MappingProxyType(
    {
        "summarization": TaskKind(_doc_text, SUMMARIZE),
        "code-editing": TaskKind(_code_text, EDIT_CODE),
        "short-text-editing": TaskKind(_short_text, EDIT_SHORT_TEXT),
        "long-text-editing": TaskKind(_long_text, EDIT_LONG_TEXT),
        "multi-turn": TaskKind(_snippet_text, MULTI_TURN),
    }
)
"""Per category, its task kind."""


def question_size(turns: Sequence[str]) -> int:
    """Characters over all turns."""
    return sum(len(turn) for turn in turns)


def category_items(task: TaskKind, sources: Sequence[str], limit: int) -> list[tuple[str, ...]]:
    """Up to ``limit`` questions (as turns) of one category, deterministically.

    Round r pairs source i with template (i + r) mod T, so the first round uses every source once
    with rotating instructions, and later rounds reuse sources with other instructions.
    Unavailable sources, inapplicable templates and out-of-bounds sizes are skipped.
    """
    materials = [
        text for name in sources if (obj := resolve(name)) is not None and (text := task.extract(obj))
    ]
    count = len(task.templates)
    items: list[tuple[str, ...]] = []
    for round_ in range(count):
        for i, text in enumerate(materials):
            if len(items) >= limit:
                return items
            turns = task.templates[(i + round_) % count](text)
            if turns is not None and MIN_CHARS <= question_size(turns) <= MAX_CHARS:
                items.append(turns)
    return items


def interleave(columns: Sequence[Sequence[tuple[str, ...]]]) -> list[tuple[int, int]]:
    """(column, row) pairs row by row: [[a0, a1], [b0]] → (0,0), (1,0), (0,1)."""
    depth = max((len(column) for column in columns), default=0)
    return [(c, r) for r in range(depth) for c, column in enumerate(columns) if r < len(column)]


# ---------------------------------------------------------------------------------------------
# Public entry points.


def _input_guided(per_category: int) -> list[Question]:
    """The input-guided suite: ``per_category`` questions of each of ``CATEGORIES``, interleaved."""
    columns = []
    for category in CATEGORIES:
        items = category_items(TASKS[category], SUITE_SOURCES[category], per_category)
        if len(items) < per_category:
            raise ValueError(
                f"suite 'input-guided' has only {len(items)} {category} questions on this Python; "
                f"asked for {per_category} per category"
            )
        columns.append(items)
    return [Question(f"ig-{CATEGORIES[c]}-{r}", CATEGORIES[c], columns[c][r]) for c, r in interleave(columns)]


REPEATED_WORKLOAD: Final = Path(__file__).parent / "workloads" / "repeated.jsonl"
"""The ``repeated`` suite's questions: 8 held-out questions of the committed corpus
(``corpus/*/prompts.jsonl.xz``, split ``heldout``, none of ``heldout16``) asked first, then again
by other users: word for word (``repeated``), reworded a little (``near-repeated``), and followed
by a second turn that restates the answer (``follow-up``)."""


SHARED_PREFIX_WORKLOAD: Final = Path(__file__).parent / "workloads" / "shared-prefix.json"
"""The ``shared-prefix`` suite: 16 customer questions to one shop's support assistant, whose
~550-token system prompt (the shop's facts) every question shares, as production chat traffic
shares long system prompts. Written for this suite; no corpus text."""


def _shared_prefix(per_category: int) -> list[Question]:
    """The ``shared-prefix`` suite: the first ``4 * per_category`` of its questions (all 16 at
    the default 4), each one turn after the shared system prompt."""
    data = json.loads(SHARED_PREFIX_WORKLOAD.read_text(encoding="utf-8"))
    questions = data["questions"][: 4 * per_category]
    return [Question(f"sp-{i}", "shared-system", (q,), data["system"]) for i, q in enumerate(questions)]


def _repeated(per_category: int) -> list[Question]:
    """The ``repeated`` suite: the first ``per_category`` questions of each of its categories
    (``first``, ``repeated``, ``near-repeated``, ``follow-up``), in the file's order, which asks
    every question first before any user asks it again."""
    questions = load_questions(REPEATED_WORKLOAD)
    taken: dict[str, int] = {}
    kept = []
    for q in questions:
        if taken.get(q.category, 0) < per_category:
            taken[q.category] = taken.get(q.category, 0) + 1
            kept.append(q)
    return kept


_SUITES: Final[Mapping[str, Callable[[int], list[Question]]]] = MappingProxyType(
    {"input-guided": _input_guided, "repeated": _repeated, "shared-prefix": _shared_prefix}
)
"""Built-in suites by name."""


def suite_names() -> list[str]:
    """Names of the built-in suites."""
    return sorted(_SUITES)


def builtin_suite(name: str = "input-guided", per_category: int = 4) -> list[Question]:
    """A built-in suite: ``input-guided`` is generated from the standard library of the running
    Python, its questions interleaving categories (q0 = first summarization, q1 = first
    code-editing, ...), so the first ``len(CATEGORIES)`` questions (``--limit 5``) cover every
    category once; ``repeated`` is a committed workload of questions asked again (``_repeated``);
    ``shared-prefix`` asks questions after one long system prompt (``_shared_prefix``).
    Raises ValueError for an unknown name, a negative count, or a count this Python cannot supply.
    """
    if name not in _SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(suite_names())}")
    if per_category < 0:
        raise ValueError(f"per_category must be >= 0, got {per_category}")
    return _SUITES[name](per_category)


def calibration_prompts(count: int = 24) -> list[str]:
    """``count`` single-turn input-guided user messages for induction-head calibration.

    Built like the suite's single-turn categories, but from ``CALIBRATION_SOURCES``, whose modules
    the suite never uses, so calibration never sees benchmark text. Deterministic; categories
    interleave. Raises ValueError for a negative count or more than this Python can supply.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    columns = [category_items(TASKS[c], names, count) for c, names in CALIBRATION_SOURCES.items()]
    order = interleave(columns)
    if len(order) < count:
        raise ValueError(f"only {len(order)} calibration prompts available on this Python; asked for {count}")
    return [columns[c][r][0] for c, r in order[:count]]


def _field_error(where: str, message: str) -> ValueError:
    """A loader error that names the file and line."""
    return ValueError(f"{where}: {message}")


def parse_question(record: object, where: str, line_number: int) -> Question:
    """One JSONL record as a Question; ``where`` ("file:line") prefixes every error.

    Accepts ``{"question_id", "category", "turns": [str, ...]}`` (Spec-Bench; ``question_id`` may
    be an int, and defaults to the line number; ``category`` defaults to ``"default"``) and
    ``{"prompt": str}`` (one turn, category ``"default"``, id = line number), either with an
    optional ``"system"`` message. Extra keys are ignored.
    """
    if not isinstance(record, dict):
        raise _field_error(where, f"expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise _field_error(where, "'turns' must be a non-empty list of strings (none blank)")
    elif "prompt" in record:
        prompt = record["prompt"]
        if not (isinstance(prompt, str) and prompt.strip()):
            raise _field_error(where, "'prompt' must be a non-empty string")
        turns = [prompt]
    else:
        raise _field_error(where, "each line needs 'turns' (a list of strings) or 'prompt' (a string)")
    question_id = record.get("question_id", line_number)
    if isinstance(question_id, bool) or not isinstance(question_id, str | int) or str(question_id) == "":
        raise _field_error(where, "'question_id' must be a non-empty string or an integer")
    category = record.get("category", "default")
    if not (isinstance(category, str) and category.strip()):
        raise _field_error(where, "'category' must be a non-empty string")
    system = record.get("system", "")
    if not isinstance(system, str):
        raise _field_error(where, "'system' must be a string")
    return Question(str(question_id), category, tuple(turns), system)


def load_questions(path: str | Path) -> list[Question]:
    """Questions from a JSONL file, one JSON object per line; blank lines are skipped.

    Raises ValueError naming ``path:line`` for invalid JSON, missing or empty fields, and
    duplicate question ids.
    """
    path = Path(path)
    questions: list[Question] = []
    seen: dict[str, int] = {}
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise _field_error(where, f"invalid JSON: {error.msg} (column {error.colno})") from None
        question = parse_question(record, where, line_number)
        first = seen.setdefault(question.question_id, line_number)
        if first != line_number:
            raise _field_error(
                where, f"duplicate question_id {question.question_id!r} (first on line {first})"
            )
        questions.append(question)
    return questions
