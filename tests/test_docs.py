"""The documentation runs as written: every fenced block of README.md and docs/ is run, checked or
marked as needing a cluster, a GPU or docker (``helpers.docblocks`` says how), and every relative
link points at a file and heading that exist."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers.docblocks import NEEDS, ROOT, RUN, SHOWN, Block, blocks, pages, shell_commands

README_MAX_LINES = 400
BLOCK_TIMEOUT_SECONDS = 300
WARM_UP_TIMEOUT_SECONDS = 1200

ALL_BLOCKS = [b for page in pages() for b in blocks(page)]


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_block_says_what_it_is() -> None:
    wrong = []
    for b in ALL_BLOCKS:
        if b.language not in RUN + SHOWN:
            wrong.append(f"{b.where}: language {b.language!r} (use one of {RUN + SHOWN})")
        elif b.action != "show" and b.language not in RUN:
            wrong.append(f"{b.where}: a docs-test marker on a {b.language!r} block")
        elif b.action.startswith("needs") and b.action.split()[1] not in NEEDS:
            wrong.append(f"{b.where}: {b.action!r} (a block may need one of {NEEDS})")
    assert not wrong, "\n".join(wrong)


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; details belong in docs/"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: ``## The `ar` mode, again!`` → ``the-ar-mode-again``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # no headings inside code blocks
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def test_relative_links_resolve() -> None:
    broken = []
    for page in pages():
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{_id(page)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{_id(page)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _check_without_running(b: Block) -> list[str]:
    """Problems of a parse-only block: CLI lines the parser refuses, make targets make refuses."""
    from client.cli import build_parser

    if b.language == "python":
        compile(b.code, b.where, "exec")
        return []
    problems = []
    for words in shell_commands(b.code):
        if words[0] == "specdraft":
            try:
                build_parser().parse_args(words[1:])
            except SystemExit:
                problems.append(f"{b.where}: the CLI refuses {' '.join(words)!r}")
        elif words[0] == "make":
            targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
            done = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                problems.append(f"{b.where}: make refuses {' '.join(words)!r}: {done.stderr.strip()}")
    return problems


def test_parse_only_blocks_are_valid() -> None:
    problems = [p for b in ALL_BLOCKS if b.action == "parse" for p in _check_without_running(b)]
    assert not problems, "\n".join(problems)


def _reap(token: str) -> None:
    """Kill what a page's blocks left running (a server they started in the background)."""
    needle = f"SPECDRAFT_DOCS_TEST={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _run(b: Block, env: dict[str, str]) -> None:
    if b.language == "python":
        argv, stdin = [sys.executable, "-"], b.code
    else:
        argv, stdin = ["bash", "-e", "-o", "pipefail", "-c", b.code], None
    try:
        done = subprocess.run(
            argv,
            input=stdin,
            cwd=ROOT,
            env=env,
            text=True,
            capture_output=True,
            timeout=BLOCK_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{b.where}: still running after {BLOCK_TIMEOUT_SECONDS} s")
    if done.returncode != 0:
        output = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        pytest.fail(f"{b.where}: exit {done.returncode}\n{b.code}\n{output}")


RUNNABLE_PAGES = [page for page in pages() if any(b.action == "run" for b in blocks(page))]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def warm_machine() -> None:
    """What a reader's first command does once (convert the model, choose the kernels, measure
    the cost curve: minutes on a new machine), done before the pages' blocks are timed."""
    argv = ["specdraft", "generate", "--max-new-tokens", "1", "--mode", "pld", "warm up"]
    subprocess.run(argv, env=_environment(), capture_output=True, check=True, timeout=WARM_UP_TIMEOUT_SECONDS)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=_id)
def test_page_runs_as_written(page: Path, warm_machine: None) -> None:
    """A page's runnable blocks in order, from the repository root, the project's commands on
    PATH: as a reader would paste them."""
    token = uuid.uuid4().hex
    env = _environment()
    env["SPECDRAFT_DOCS_TEST"] = token
    try:
        for b in blocks(page):
            if b.action == "run":
                _run(b, env)
    finally:
        _reap(token)
