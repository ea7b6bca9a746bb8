"""A learned drafter's checkpoint (weights + JSON) is written as one unit: a save killed between
any two of its steps leaves the old checkpoint or the new one, loadable, never a mix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_worker.drafters.checkpoint import DrafterCheckpoint, load_checkpoint, save_checkpoint


class Killed(BaseException):
    """The process dying at this point (nothing after it runs)."""


def checkpoint(value: float) -> DrafterCheckpoint:
    return DrafterCheckpoint(
        kind="glide",
        config={"layers": 1},
        d2t=torch.arange(8),
        weights={"w": torch.full((4, 4), value)},
        target={"weights_id": "t", "name": "tiny", "vocab_size": 8},
    )


def saved_value(stem: Path) -> float:
    return float(load_checkpoint(stem, "t", "glide").weights["w"][0, 0])


class Dying:
    """Renames and links that run until the ``kill_at``-th (from 0), where the process dies."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at, self.calls = kill_at, 0

    def wrap(self, real: Any) -> Any:
        def call(*args: Any) -> None:
            if self.calls == self.kill_at:
                raise Killed
            self.calls += 1
            real(*args)

        return call


def steps_of_a_save(stem: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many renames and links one save makes (each a point a kill can fall before)."""
    calls = [0]
    replace, link = os.replace, os.link

    def count(real: Any) -> Any:
        def call(*args: Any) -> None:
            calls[0] += 1
            real(*args)

        return call

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", count(replace))
        patch.setattr(os, "link", count(link))
        save_checkpoint(checkpoint(0.0), stem)
    return calls[0]


def test_a_save_killed_between_any_two_steps_leaves_a_whole_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stem = tmp_path / "glide"
    steps = steps_of_a_save(tmp_path / "probe", monkeypatch)
    assert steps >= 2
    save_checkpoint(checkpoint(1.0), stem)
    for kill_at in range(steps):
        old = saved_value(stem)
        with monkeypatch.context() as patch, pytest.raises(Killed):
            dying = Dying(kill_at)
            patch.setattr(os, "replace", dying.wrap(os.replace))
            patch.setattr(os, "link", dying.wrap(os.link))
            save_checkpoint(checkpoint(old + 1.0), stem)
        assert saved_value(stem) in (old, old + 1.0), f"killed before step {kill_at}"
    save_checkpoint(checkpoint(9.0), stem)  # a save that completes clears what killed ones left
    assert saved_value(stem) == 9.0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("glide")) == [
        "glide.json",
        "glide.safetensors",
    ]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".glide")]
