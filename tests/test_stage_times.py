"""scripts/gpu/stage_times.py, the GPU call's time split, runs on the CPU with a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stage_times_reports_every_part(tiny_dir: Path, tmp_path: Path) -> None:
    lines = []
    for i in range(6):
        split = "heldout" if i == 0 else "train"
        messages = [
            {"role": "user", "content": f"Question {i}: name three colours."},
            {"role": "assistant", "content": "Red, green and blue. " * (i + 2)},
        ]
        lines.append(json.dumps({"id": f"self-{i}", "kind": "self", "split": split, "messages": messages}))
    (tmp_path / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu/stage_times.py"), "--work", str(tmp_path), "--device", "cpu",
         "--model", str(tiny_dir), "--conversations", "6", "--steps", "4"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["conversations"] == 6 and report["tokens"] > 0
    assert report["features_tokens_per_s"] > 0
    assert set(report["edd_step_ms"]) == {"host_batch", "to_device", "forward_backward_step"}
