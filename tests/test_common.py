"""The shared bottom-layer utilities: one percentile definition, atomic writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specdraft.common import atomic_path, atomic_write_text, percentile, shorten, temp_sibling


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 9.0, 2.0, 2.0, 7.5, 0.5]])
def test_percentile_is_numpys_linear_interpolation(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)))


def test_percentile_of_nothing_or_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        percentile([1.0], 50)


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_an_atomic_write_is_on_disk_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_replace(src: Any, dst: Any) -> None:
        events.append(("replace", str(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    atomic_write_text(tmp_path / "f.json", "{}")
    ((kind, tmp),) = [e for e in events if e[0] == "replace"]
    assert events.index(("fsync", tmp)) < events.index((kind, tmp))  # the data, then the name
    assert events[-1] == ("fsync", str(tmp_path))  # and the name itself


def test_temp_siblings_are_hidden_and_distinct(tmp_path: Path) -> None:
    a, b = temp_sibling(tmp_path / "v1"), temp_sibling(tmp_path / "v1")
    assert a != b and a.parent == tmp_path and a.name.startswith(".v1.tmp-")


def test_shorten_quotes_the_start_and_says_the_length() -> None:
    assert shorten("pld") == "pld"
    assert shorten("abcdef", 3) == "abc… (6 characters)"
    assert len(shorten("x" * 200_000)) < 100
