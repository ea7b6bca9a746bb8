"""The local stack (`specdraft up` / `down`) with real processes: redis-server, two workers, locust."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client.cli import main
from client.grpc_client import GenerationClient, RequestOptions, build_request
from client.stack import (
    StackConfig,
    StackError,
    StackState,
    down,
    is_alive,
    read_state,
    redis_password,
    status,
    up,
)
from llm_worker.registry import RedisRegistry, discover

pytestmark = pytest.mark.redis
REPO = Path(__file__).resolve().parents[1]


def tiny_stack_config(tiny_dir: Path, **overrides: object) -> StackConfig:
    args = ("--model", str(tiny_dir), "--threads", "1", "--no-warm", "--max-concurrent", "4")
    base: dict[str, object] = dict(
        workers=2,
        worker_port=0,
        metrics_port=0,
        redis_port=0,
        worker_args=args,
        startup_timeout=240.0,
        grace_seconds=5.0,
    )
    base.update(overrides)
    return StackConfig(**base)  # type: ignore[arg-type]


def stack_registry(state_dir: Path, state: StackState) -> RedisRegistry:
    """The stack's registry as Redis user ``client`` (read only), with its password."""
    registry = RedisRegistry(state.registry)
    registry.client.connection_pool.connection_kwargs["password"] = redis_password(state_dir, "client")
    return registry


def running_stack(tiny_dir: Path, state_dir: Path) -> Iterator[tuple[Path, StackState]]:
    """Redis and two workers of the tiny model, started in ``state_dir`` and stopped afterwards."""
    state = up(tiny_stack_config(tiny_dir), state_dir)
    try:
        yield state_dir, state
    finally:
        down(state_dir, grace_seconds=5.0)


@pytest.fixture(scope="module")
def stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, StackState]]:
    """A stack shared by the tests that only read from it or send it requests: each leaves it as it
    found it (every process alive, the state file in place), so their order does not matter."""
    yield from running_stack(tiny_dir, tmp_path_factory.mktemp("stack"))


@pytest.fixture
def own_stack(tiny_dir: Path, tmp_path: Path) -> Iterator[tuple[Path, StackState]]:
    """A stack of one test alone, for tests that kill or stop its processes."""
    yield from running_stack(tiny_dir, tmp_path / "stack")


def test_up_serves_registers_and_exports_metrics(stack: tuple[Path, StackState]) -> None:
    state_dir, state = stack
    rows = status(state_dir)
    assert [r["kind"] for r in rows] == ["redis", "worker", "worker"]
    assert all(r["alive"] for r in rows)
    assert [r["health"] for r in rows if r["kind"] == "worker"] == ["SERVING", "SERVING"]
    assert sorted(discover(stack_registry(state_dir, state), "pld")) == sorted(state.worker_addresses())
    for proc in state.workers():
        with urllib.request.urlopen(proc.metrics, timeout=5) as reply:
            assert b"specdraft_requests_total" in reply.read()


def test_cli_status_and_a_second_up_is_refused(
    stack: tuple[Path, StackState], tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir, _ = stack
    assert main(["status", "--state-dir", str(state_dir), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    with pytest.raises(StackError, match="already running"):
        up(tiny_stack_config(tiny_dir), state_dir)


def test_locust_headless_run_has_no_failures(stack: tuple[Path, StackState], tmp_path: Path) -> None:
    state_dir, _ = stack
    prefix = tmp_path / "load"
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "deploy" / "locustfile.py"), "--headless"]
    cmd += ["-u", "3", "-r", "3", "-t", "20s", "--state-dir", str(state_dir), "--mode", "pld"]
    cmd += ["--max-new-tokens", "16", "--csv", str(prefix), "--html", str(tmp_path / "load.html")]
    run = subprocess.run([*cmd, "--only-summary"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
    assert {"GenerateStream", "GenerateStream TTFT"} <= set(rows)
    summary = json.loads(Path(f"{prefix}_generation.json").read_text())
    assert summary["generations"] > 0 and summary["tokens"] > 0
    assert summary["aggregate_tokens_per_second"] > 0
    assert (tmp_path / "load.html").stat().st_size > 0


def test_client_fails_over_when_a_worker_dies_mid_run(own_stack: tuple[Path, StackState]) -> None:
    """SIGKILL the first worker while a client keeps generating: every call still succeeds."""
    state_dir, state = own_stack
    addresses = discover(stack_registry(state_dir, state), "pld")
    victim = next(p for p in state.workers() if p.address == addresses[0])
    request = build_request(text="fail over", options=RequestOptions(mode="pld", max_new_tokens=24))
    with GenerationClient(addresses, timeout=60) as client, ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(client.generate, request) for _ in range(12)]
        calls[0].result()
        os.kill(victim.pid, signal.SIGKILL)  # calls are in flight on it or queued for it
        results = [c.result() for c in calls]  # raises if any call failed
    assert len({tuple(r.token_ids) for r in results}) == 1  # greedy: the same tokens from either worker
    survivor = next(p.name for p in state.workers() if p is not victim)
    assert results[-1].worker_id == survivor


def test_down_stops_every_process(own_stack: tuple[Path, StackState]) -> None:
    state_dir, state = own_stack
    stopped = down(state_dir, grace_seconds=5.0)
    assert stopped is not None
    assert not any(is_alive(p) for p in state.processes)
    assert read_state(state_dir) is None and down(state_dir) is None


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_worker_that_cannot_start_stops_the_whole_stack(tmp_path: Path) -> None:
    cfg = StackConfig(
        workers=1,
        worker_port=0,
        metrics_port=None,
        redis_port=0,
        worker_args=("--model", str(tmp_path / "no-such-model")),
        startup_timeout=120.0,
    )
    with pytest.raises(StackError, match="worker-0 exited during start-up"):
        up(cfg, tmp_path)
    assert read_state(tmp_path) is None
    assert _processes_mentioning(str(tmp_path)) == []  # redis (started with --dir tmp_path) is gone


def test_up_with_a_datastore_serves_rest_through_shard_servers(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"step {i}: add {i} to the total"}) for i in range(50)))
    version = tmp_path / "v1"
    argv = ["datastore", "build", "--corpus", str(corpus), "--out", str(version), "--shards", "2", "--quiet"]
    assert main([*argv, "--model", str(tiny_dir)]) == 0
    capsys.readouterr()
    cfg = tiny_stack_config(
        tiny_dir, workers=1, redis=False, metrics_port=None, datastore=str(version), datastore_port=0
    )
    state_dir = tmp_path / "stack"
    state = up(cfg, state_dir)
    try:
        assert [p.kind for p in state.processes] == ["datastore", "datastore", "worker"]
        request = build_request(text="step 3: add 3", options=RequestOptions(mode="rest", max_new_tokens=8))
        with GenerationClient(state.worker_addresses(), timeout=60) as client:
            assert "rest" in [m.name for m in client.list_modes().modes if m.available]
            assert client.generate(request).datastore_version == "v1"
    finally:
        down(state_dir, grace_seconds=5.0)
    assert not any(is_alive(p) for p in state.processes)


def test_the_stack_redis_is_locked_down(stack: tuple[Path, StackState]) -> None:
    """protected-mode, no default user, one ACL user per role limited to its keys and commands."""
    import redis

    state_dir, state = stack
    address = state.registry.split("@", 1)[1].rsplit("/", 1)[0]
    host, port = address.split(":")
    anonymous = redis.Redis(host=host, port=int(port), socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()

    def as_role(role: str) -> redis.Redis:
        return redis.Redis(
            host=host,
            port=int(port),
            username=role,
            password=redis_password(state_dir, role),
            socket_timeout=5,
        )

    client, shard, worker = as_role("client"), as_role("shard"), as_role("worker")
    assert client.ping() and client.mget(["specdraft:workers:none"]) == [None]
    with pytest.raises(redis.exceptions.NoPermissionError):  # discovery is read only
        client.set("specdraft:workers:evil", "{}")
    with pytest.raises(redis.exceptions.NoPermissionError):  # a shard writes statistics, not workers
        shard.set("specdraft:workers:evil", "{}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.set("elsewhere", "x")  # outside specdraft:*
    for dangerous in (worker.flushall, worker.config_get, lambda: worker.execute_command("KEYS", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            dangerous()
    assert shard.set("specdraft:datastore:probe", b"x") and worker.get("specdraft:datastore:probe") == b"x"


def test_a_workers_redis_credential_writes_its_own_record_alone(stack: tuple[Path, StackState]) -> None:
    """Each worker publishes as a Redis user of its own. With the credential worker-0 runs with
    (the user its ``--registry`` URL names, the password in its environment) one can write
    worker-0's record, but neither overwrite nor delete worker-1's, nor plant a record: a stolen
    worker password cannot point clients elsewhere."""
    import redis

    from specdraft.redisconn import PASSWORD_ENV

    state_dir, state = stack
    first, second = state.workers()
    url = first.argv[first.argv.index("--registry") + 1]
    variables = Path(f"/proc/{first.pid}/environ").read_bytes().decode().split("\0")
    password = dict(v.split("=", 1) for v in variables if "=" in v)[PASSWORD_ENV]
    stolen = redis.Redis.from_url(url, password=password, socket_timeout=5)
    reader = stack_registry(state_dir, state).client
    own, other = (f"specdraft:workers:{p.name}" for p in (first, second))
    current = reader.get(other)
    assert current is not None
    for what, attempt in {
        "overwrite worker-1's record": lambda: stolen.set(other, current, keepttl=True),
        "delete worker-1's record": lambda: stolen.delete(other),
        "plant a record": lambda: stolen.set("specdraft:workers:planted", current, px=2000),
    }.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
            pytest.fail(f"worker-0's credential could {what}")
    assert stolen.set(own, reader.get(own), keepttl=True)  # its own record: a heartbeat's write
    assert sorted(discover(stack_registry(state_dir, state), "pld")) == sorted(state.worker_addresses())


@pytest.mark.slow
def test_chaos_under_load_loses_nothing(tiny_dir: Path, tmp_path: Path) -> None:
    """The chaos run, quick and on the tiny model: a shard killed and restarted, another stopped,
    redis killed and restarted, the datastore rebuilt with the rebuild killed after each step (and
    a shard restarted after the link moved), the link to a shard partitioned, then slow (200 ms
    each way), a worker terminated — under locust load. No request fails, every output equals
    ar's, health p99 stays under its bound, every shard and DATA/current are on v2 at the end."""
    from client.chaos import ChaosConfig, run_chaos

    cfg = ChaosConfig(
        state_dir=tmp_path / "chaos",
        model=str(tiny_dir),
        users=2,
        max_new_tokens=16,
        corpus_chars=60_000,
        step_seconds=4.0,
        stop_seconds=4.0,
        worker_args=("--threads", "1", "--no-warm"),
    )
    report = run_chaos(cfg)
    events = " | ".join(e["event"] for e in report["events"])
    for expected in (
        "SIGKILL shard-0",
        "SIGSTOP shard-1",
        "SIGCONT",
        "SIGKILL redis",
        "rebuild killed after 'pending'",
        "rebuild killed after 'built'",
        "rebuild killed after 'loaded'",
        "rebuild killed after 'current'",
        "rebuild killed after 'switched'",
        "rebuild rerun finished: v2",
        "partition: workers - shard-0",
        "partition healed",
        "slow link: workers - shard-1, 200 ms each way",
        "slow link healed",
        "SIGTERM worker-1",
    ):
        assert expected in events, events
    assert report["ok"] and report["wrong"] == [], report
    assert report["load"]["requests"] > 0 and report["load"]["failed"] == 0, report
    assert report["outputs"]["compared"] > 0 and report["outputs"]["differ"] == 0, report
    assert report["health"]["worker"]["checks"] > 10, report
    assert report["health"]["worker"]["p99_ms"] <= cfg.health_p99_ms, report
    assert report["health"]["datastore"]["p99_ms"] <= cfg.health_p99_ms, report
    assert report["versions"] == {"shard-0": "v2", "shard-1": "v2", "DATA/current": "v2"}, report
    print(f"\nchaos: {json.dumps({k: report[k] for k in ('load', 'outputs', 'health', 'versions')})}")
    assert _processes_mentioning(str(tmp_path)) == []  # everything stopped
