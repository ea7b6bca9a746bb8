"""The fenced code blocks of the user documentation (README.md, docs/), and what a test does with
each: run it, check it without running it, or leave it to a cluster, a GPU or docker.

A block's language decides (``RUN`` and ``SHOWN``); a marker on the line just before its opening
fence can change that::

    <!-- docs-test: parse -->          checked, not run (too long for a test, or needs servers
                                       started elsewhere): every ``specdraft ...`` line is parsed
                                       by the CLI's own argument parser, every ``make T`` line by
                                       ``make -n T``, a python block is compiled
    <!-- docs-test: needs cluster -->  not run: needs a Kubernetes cluster (also: gpu, docker)

Example: a page holding ```` ```sh ```` / ``specdraft modes`` / ```` ``` ```` gives one
``Block(page, line, "sh", "specdraft modes\\n", "run")``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN = ("sh", "bash", "python")
"""Languages whose blocks are code a reader runs."""
SHOWN = ("text", "proto", "yaml", "json", "toml", "diff", "ini", "dockerfile", "promql", "cpp")
"""Languages of blocks that only show something: output, a diagram, a file's excerpt."""
NEEDS = ("cluster", "gpu", "docker")
"""What a ``needs`` marker may name."""

_SEPARATORS = ("&&", "||", ";", "|", "&")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(parse|needs\s+(\w+))\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    """The fence's language tag ("" when it has none)."""
    code: str
    action: str
    """``run``, ``parse``, ``show`` or ``needs <what>``."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page under docs/ (measurement logs included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, each with the action its language and marker ask."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2).lower()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        if marker is not None:
            action = "parse" if marker.group(1) == "parse" else f"needs {marker.group(2)}"
        else:
            action = "run" if language in RUN else "show"
        found.append(Block(page, i + 1, language, code, action))
        i = end + 1
    return found


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block as argument lists: continuation lines joined, comments,
    blank lines and leading ``VAR=value`` assignments dropped, ``a && b`` (also ``;``, ``|``, ``&``)
    split into two.

    ``"FOO=1 specdraft modes  # list\\nmake \\\\\\n  demo\\n"``
    → ``[["specdraft", "modes"], ["make", "demo"]]``
    """
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        words: list[str] = []
        for word in [*shlex.split(line, comments=True), ";"]:
            if word not in _SEPARATORS:
                words.append(word)
                continue
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            if words:
                commands.append(words)
            words = []
    return commands
