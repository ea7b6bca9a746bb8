"""The layers contract (``.importlinter``): client → llm_worker → datastore_svc → specdraft, nothing
imports upward; lazy imports inside functions count too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_package_imports_a_higher_layer() -> None:
    exe = Path(sys.executable).parent / "lint-imports"
    command = str(exe) if exe.exists() else shutil.which("lint-imports")
    assert command, "lint-imports (import-linter) is not installed: run `make setup`"
    done = subprocess.run(
        [command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout
