"""The datastore rebuild (``datastore_svc.rebuild``, ``specdraft datastore rebuild``) against
real shard servers on loopback that start from ``DATA/current``, as the Kubernetes shards do:
killed after every step, with a shard restarted, then run again; shards restarting while it
runs; and the command line resuming a pending rebuild."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from client.cli import main
from datastore_svc.rebuild import (
    PENDING,
    STEPS,
    VERSIONS,
    RebuildConfig,
    current_name,
    point_current,
    read_pending,
    rebuild,
)
from datastore_svc.server import ShardServerConfig
from datastore_svc.shard import ShardState
from datastore_svc.store import load_shard_arrays, write_version
from helpers.datastores import tiny_identity
from helpers.servers import ADMIN, ADMIN_TOKEN, ShardThread
from specdraft.security import ServerSecurity

VOCAB = 96
IDENTITY = tiny_identity(VOCAB)


def docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 6, size=50).astype(np.int32) for _ in range(20)]


class Volume:
    """``DATA`` (``versions/v1``, ``current -> versions/v1``) and two shards serving it, each
    started as a Kubernetes shard is: from ``DATA/current``, versions resolved under
    ``DATA/versions``."""

    def __init__(self, data: Path) -> None:
        self.data = data
        write_version(docs(1), data / VERSIONS / "v1", VOCAB, IDENTITY, shards=2)
        point_current(data, "v1")
        self.shards = [self._start(i) for i in range(2)]
        self.builds = 0

    def _start(self, index: int, ports: tuple[int, int] = (0, 0)) -> ShardThread:
        state = ShardState.open(self.data / "current", index, versions_root=self.data / VERSIONS)
        security = ServerSecurity(admin_tokens=(ADMIN_TOKEN,))
        return ShardThread(state, ShardServerConfig(port=ports[0], admin_port=ports[1], security=security))

    def restart(self, index: int) -> None:
        """Stop shard ``index`` and start it again on the same ports (a StatefulSet pod keeps its
        address): it loads what ``DATA/current`` names."""
        old = self.shards[index]
        old.stop()
        self.shards[index] = self._start(index, (old.server.port, old.server.admin_port))

    def served(self) -> list[str]:
        return [s.state.current_version() for s in self.shards]

    def build(self, path: Path) -> None:
        self.builds += 1
        write_version(docs(self.builds + 1), path, VOCAB, IDENTITY, shards=2)

    def rebuild(self, report: Callable[[str, str], None] = lambda step, version: None) -> str:
        cfg = RebuildConfig(self.data, [s.admin_address for s in self.shards], security=ADMIN)
        return rebuild(cfg, self.build, report)

    def versions(self) -> set[str]:
        """The versions on the volume (not the build lock)."""
        return {p.name for p in (self.data / VERSIONS).iterdir() if not p.name.endswith(".lock")}

    def stop(self) -> None:
        for s in self.shards:
            s.stop()


@pytest.fixture()
def volume(tmp_path: Path) -> Iterator[Volume]:
    vol = Volume(tmp_path / "data")
    yield vol
    vol.stop()


class Killed(Exception):
    """The rebuild's process dying right after a step (as SIGKILL would: no step after it runs)."""


def kill_after(step: str) -> Callable[[str, str], None]:
    def report(done: str, version: str) -> None:
        if done == step:
            raise Killed(step)

    return report


@pytest.mark.parametrize("killed_after", STEPS[:-1])
def test_a_rebuild_killed_after_any_step_never_sends_a_restart_back_and_its_rerun_finishes(
    volume: Volume, killed_after: str
) -> None:
    """Killed after each step, then shard 0 restarted (it loads ``DATA/current``): the running
    shards serve one version; no shard serves a version ``DATA/current`` does not name or replace
    (a restart never goes back); shards disagree only if the kill fell between moving the link
    and switching, and then the restarted one is ahead, on the version the rerun brings every
    shard to. The rerun (the Job's retry) finishes the same version without building it again:
    every shard on it, restarted ones too, the link on it, no marker, no other version."""
    with pytest.raises(Killed):
        volume.rebuild(kill_after(killed_after))
    running = volume.served()
    assert len(set(running)) == 1, f"running shards on different versions: {running}"
    new = read_pending(volume.data)
    assert new, "the marker names the version under way"

    volume.restart(0)
    served, current = volume.served(), current_name(volume.data)
    assert served[0] == current
    assert set(served) <= {"v1", current}, (
        f"after a kill after {killed_after!r}, shards serve {served} but {volume.data}/current names "
        f"{current!r}: a shard that restarts goes back to a version no running shard serves"
    )
    if killed_after != "current":
        assert served[0] == served[1], f"a restarted shard disagrees with the running one: {served}"

    assert volume.rebuild() == new
    assert volume.served() == [new, new]
    assert current_name(volume.data) == new and not (volume.data / PENDING).exists()
    assert volume.builds == 1, "the rerun built the version again"
    assert volume.versions() == {"v1", new}
    volume.restart(0)
    volume.restart(1)
    assert volume.served() == [new, new]


def test_the_link_moves_only_when_every_shard_holds_the_version(volume: Volume) -> None:
    """When ``DATA/current`` moves, every shard already holds the new version (loaded and
    checked, not served), so the only window in which a kill and a restart can split the shards,
    between moving the link and switching, is one round of compare-and-swap calls, not loads."""
    held: list[set[str]] = []

    def report(step: str, version: str) -> None:
        if step == "current":
            held.extend(set(s.state.loaded_versions()) for s in volume.shards)

    new = volume.rebuild(report)
    assert held == [{"v1", new}, {"v1", new}]


@pytest.mark.parametrize("restarted_after", ["loaded", "current"])
def test_a_shard_that_restarts_during_the_rebuild_is_brought_forward(
    volume: Volume, restarted_after: str
) -> None:
    """A shard restarting after every shard loaded the new version (it starts on the old one and
    holds no new one: the compare-and-swap finds it not loaded) or after the link moved (it
    starts on the new one: the compare-and-swap finds it changed) is loaded again and switched,
    never rolled back: the run ends with every shard on the new version."""

    def restart(step: str, version: str) -> None:
        if step == restarted_after:
            volume.restart(1)

    new = volume.rebuild(restart)
    assert volume.served() == [new, new] and current_name(volume.data) == new
    assert not (volume.data / PENDING).exists()


def test_cli_rebuild_resumes_a_pending_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``specdraft datastore rebuild`` (what the Kubernetes job runs) finds the marker a killed
    run left, builds that version and makes it current on the shard and in ``DATA/current``,
    reporting each step; a run naming another version while one is pending is refused."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(30))
    )
    data = tmp_path / "data"
    build = ["datastore", "build", "--corpus", str(corpus), "--quiet"]
    assert main([*build, "--out", str(data / VERSIONS / "v1")]) == 0
    point_current(data, "v1")
    (data / PENDING).write_text(json.dumps({"version": "v2"}))
    monkeypatch.setenv("SPECDRAFT_ADMIN_TOKEN", ADMIN_TOKEN)
    shard = ShardThread(ShardState.open(data / "current", 0, versions_root=data / VERSIONS))
    try:
        command = ["datastore", "rebuild", "--corpus", str(corpus), "--data", str(data), "--quiet"]
        command += ["--admin-addr", shard.admin_address]
        capsys.readouterr()
        assert main([*command, "--version", "v3"]) == 2
        assert "a rebuild of 'v2' is pending" in capsys.readouterr().err
        assert main(command) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["version"] == "v2"
        assert [line.split(": ")[1] for line in err.splitlines() if line.startswith("rebuild of v2")] == [
            f"{i}/{len(STEPS)} {step}" for i, step in enumerate(STEPS, 1)
        ]
        assert shard.state.current_version() == "v2" and current_name(data) == "v2"
        assert not (data / PENDING).exists()
    finally:
        shard.stop()


def test_cli_rebuild_from_a_committed_corpus_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``datastore rebuild --corpus corpus/<model>`` (the Kubernetes job with the own-corpus
    component, k8s/components/own-corpus) builds the target's own committed corpus: the train
    split's conversations, never a held-out one's answer, and makes it current on the running
    shard and in ``DATA/current``; a directory that is no committed corpus is one clear error."""
    from transformers import AutoTokenizer

    from llm_worker.training.corpus import pack

    work, corpus = tmp_path / "work", tmp_path / "corpus" / "de7dc0073f16aefd"
    work.mkdir()
    (work / "prompts.jsonl").write_text(json.dumps({"id": "self-0", "kind": "self", "text": "q"}) + "\n")
    with open(work / "conversations.jsonl", "w") as f:
        for i, split in enumerate(["train", "heldout", "train", "train"]):
            answer = "the held-out answer" if split == "heldout" else f"def square_{i}(x): return x * x"
            messages = [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": answer},
            ]
            f.write(
                json.dumps({"id": f"self-{i}", "kind": "self", "split": split, "messages": messages}) + "\n"
            )
    pack(work, corpus)
    data = tmp_path / "data"
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    assert (
        main(["datastore", "build", "--corpus", str(first), "--quiet", "--out", str(data / VERSIONS / "v1")])
        == 0
    )
    point_current(data, "v1")
    monkeypatch.setenv("SPECDRAFT_ADMIN_TOKEN", ADMIN_TOKEN)
    shard = ShardThread(ShardState.open(data / "current", 0, versions_root=data / VERSIONS))
    try:
        command = [
            "datastore",
            "rebuild",
            "--data",
            str(data),
            "--admin-addr",
            shard.admin_address,
            "--quiet",
        ]
        capsys.readouterr()
        assert main([*command, "--corpus", str(tmp_path / "work")]) == 2
        assert "not a committed corpus" in capsys.readouterr().err
        assert main([*command, "--corpus", str(corpus), "--version", "own"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["version"] == "own" and "3 train conversations" in err
        assert shard.state.current_version() == "own" and current_name(data) == "own"
    finally:
        shard.stop()
    manifest = json.loads((data / VERSIONS / "own" / "manifest.json").read_text())
    assert manifest["documents"] == 3
    tokens = load_shard_arrays(data / VERSIONS / "own", 0)["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(manifest["model"])
    text = tokenizer.decode([int(t) for t in tokens if t < manifest["separator"]])
    assert "def square_3(x)" in text and "held-out" not in text
