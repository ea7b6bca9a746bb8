"""A chaos run (``specdraft chaos``, ``make chaos``): the local stack — Redis, two workers, two
datastore shards — under locust load while its parts fail, one after another:

1. ``kill -9`` shard 0, then start it again;
2. ``SIGSTOP`` shard 1 for ``stop_seconds`` (a black hole: connections open, no answers), then
   ``SIGCONT``;
3. ``kill -9`` Redis, then start it again (the registry comes back with the workers' heartbeats);
4. rebuild the datastore as the Kubernetes job does (``datastore_svc.rebuild``: marker, build,
   every shard loads, ``DATA/current`` moves, every shard switches, marker removed), killed after
   each of its first five steps in turn (shard 0 is killed and restarted after the kill that
   follows the link's move, so it comes back on the new version while shard 1 still serves the
   old), and rerun each time until it finishes;
5. a network partition between the workers and shard 0 for ``stop_seconds`` (the workers reach
   each shard through a TCP proxy, ``client/faultproxy.py``, which now moves no byte), then healed;
6. a slow link to shard 1 for ``stop_seconds``: ``link_delay_seconds`` each way, then healed;
7. ``SIGTERM`` one of the two workers (it drains; clients fail over to the other).

Reported, and checked (``report["ok"]``, the exit status of ``specdraft chaos``): requests locust
sent and how many failed (0), every finished generation compared with what ``ar`` answers to the
same prompt (0 different), the p50 / p99 of health checks sent to every live worker and shard
during the run (p99 at most ``health_p99_ms``), and the version every shard serves at the end
(one, the rebuilt v2, which ``DATA/current`` names too). ``tests/test_rebuild.py`` kills a
rebuild after every step without load, in more combinations.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.stack import (
    Process,
    StackConfig,
    StackError,
    admin_token_file,
    down,
    is_alive,
    read_state,
    restart,
    up,
    wait_serving,
)
from datastore_svc.rebuild import current_name
from specdraft.common import percentile


@dataclass(frozen=True)
class ChaosConfig:
    state_dir: Path
    """Where the stack, its versions, logs and the locust report go."""
    model: str | None = None
    """The workers' model directory (None = the default model)."""
    users: int = 4
    """Locust users (each one generation at a time)."""
    mode: str = "rest"
    max_new_tokens: int = 32
    corpus_chars: int = 300_000
    """Local text (``datastore local-corpus``) the two datastore versions hold."""
    step_seconds: float = 10.0
    """Time between two failures (and before the first)."""
    stop_seconds: float = 10.0
    """How long shard 1 stays stopped, the partition and the slow link last."""
    link_delay_seconds: float = 0.2
    """The slow link's delay, each way."""
    health_p99_ms: float = 250.0
    """The bound on the p99 of the health checks of workers and of shards. Measured on the 2-core
    development machine: p99 below 40 ms (see docs/security.md); the bound leaves room for a CI
    machine as busy."""
    worker_args: tuple[str, ...] = ()
    """Extra ``serve worker`` arguments."""


@dataclass
class ChaosLog:
    t0: float = field(default_factory=time.monotonic)
    events: list[dict[str, Any]] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    """Processes that are killed or stopped now (health is not measured on them)."""

    def event(self, what: str) -> None:
        self.events.append({"seconds": round(time.monotonic() - self.t0, 2), "event": what})


def _versions(cfg: ChaosConfig, say: Callable[[str], None]) -> tuple[Path, Path]:
    """``state_dir/data`` as the Kubernetes volume holds it (``versions/v1``, ``current`` naming
    it; what an earlier run rebuilt removed), and version v2 built once elsewhere, which the
    run's rebuild copies in; both of local text, 2 shards each. Returns (data, that copy)."""
    from client.bench.datastore import local_corpus
    from datastore_svc.rebuild import PENDING, VERSIONS, point_current
    from datastore_svc.store import build
    from llm_worker.assembly import load_tokenizer

    data, spare = cfg.state_dir / "data", cfg.state_dir / "spare" / "v2"  # its manifest names v2
    corpus = cfg.state_dir / "corpus.jsonl"
    if not corpus.exists():
        local_corpus(corpus, cfg.corpus_chars)
    tokenizer, _ = load_tokenizer(cfg.model)
    for path in (data / VERSIONS / "v1", spare):
        if not path.exists():
            say(f"building datastore version {path.name}")
            build(corpus, tokenizer, path, shards=2, progress=False)
    for old in (data / VERSIONS).iterdir():
        if old.name != "v1":
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    (data / PENDING).unlink(missing_ok=True)
    point_current(data, "v1")
    return data, spare


def _prober(state_dir: Path, log: ChaosLog, stop: threading.Event, seconds: dict[str, list[float]]) -> None:
    """Every 100 ms, one health check to each live worker and shard; latencies by kind."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels: dict[str, Any] = {}
    while not stop.is_set():
        state = read_state(state_dir)
        for proc in state.processes if state else []:
            if proc.kind not in ("worker", "datastore") or proc.name in log.down:
                continue
            channel = channels.setdefault(proc.address, grpc.insecure_channel(proc.address))
            t = time.perf_counter()
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                seconds.setdefault(proc.kind, []).append(time.perf_counter() - t)
            except grpc.RpcError:
                seconds.setdefault(f"{proc.kind} failed", []).append(time.perf_counter() - t)
        stop.wait(0.1)
    for channel in channels.values():
        channel.close()


def _locust(cfg: ChaosConfig, seconds: float, outputs: Path, prefix: Path) -> subprocess.Popen[bytes]:
    locustfile = Path(__file__).resolve().parent.parent / "deploy" / "locustfile.py"
    argv = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "-u", str(cfg.users)]
    argv += ["-r", str(cfg.users), "-t", f"{int(seconds)}s", "--state-dir", str(cfg.state_dir)]
    argv += ["--mode", cfg.mode, "--max-new-tokens", str(cfg.max_new_tokens), "--only-summary"]
    argv += ["--record-outputs", str(outputs), "--csv", str(prefix), "--stop-timeout", "120"]
    log = open(cfg.state_dir / "logs" / "locust.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def _locust_totals(prefix: Path) -> dict[str, int]:
    """Requests and failures of the run (locust's Aggregated row; TTFT entries left out)."""
    sent = failed = 0
    if not Path(f"{prefix}_stats.csv").exists():
        return {"requests": 0, "failed": 0}
    with open(f"{prefix}_stats.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["Name"] in ("GenerateStream", "Generate"):
                sent += int(row["Request Count"])
                failed += int(row["Failure Count"])
    return {"requests": sent, "failed": failed}


def _compare_with_ar(cfg: ChaosConfig, outputs: Path, address: str) -> dict[str, Any]:
    """Every recorded generation against ``ar``'s answer to the same prompt text (asked after
    the run, on a worker that lived through it)."""
    from client.grpc_client import GenerationClient, RequestOptions, build_request

    rows = [json.loads(line) for line in outputs.read_text().splitlines()] if outputs.exists() else []
    reference: dict[str, list[int]] = {}
    options = RequestOptions(mode="ar", max_new_tokens=cfg.max_new_tokens)
    with GenerationClient([address], timeout=600) as client:
        for text in sorted({r["text"] for r in rows}):
            reply = client.generate(build_request(chat=[("user", text)], options=options))
            reference[text] = list(reply.token_ids)
    differ = [r.get("worker", "?") for r in rows if r["token_ids"] != reference[r["text"]]]
    by_worker = {w: differ.count(w) for w in sorted(set(differ))}
    return {
        "compared": len(rows),
        "prompts": len(reference),
        "differ": len(differ),
        "differ_by_worker": by_worker,
    }


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"checks": 0}
    ms = [v * 1000.0 for v in values]
    return {
        "checks": len(ms),
        "p50_ms": round(percentile(ms, 0.5), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
    }


def _shard_versions(state_dir: Path) -> dict[str, str]:
    """The version each shard serves now (its name → version; "" if it does not answer)."""
    import grpc

    from specdraft.stubs import datastore_pb2, datastore_pb2_grpc

    state = read_state(state_dir)
    versions = {}
    for proc in state.shards() if state else []:
        with grpc.insecure_channel(proc.address) as channel:
            try:
                info = datastore_pb2_grpc.DatastoreStub(channel).GetShardInfo(
                    datastore_pb2.ShardInfoRequest(), timeout=10.0
                )
                versions[proc.name] = info.version
            except grpc.RpcError:
                versions[proc.name] = ""
    return versions


def verdict(report: dict[str, Any], cfg: ChaosConfig) -> list[str]:
    """What the run got wrong (empty: nothing): failed requests, outputs differing from ``ar``,
    a health p99 over the bound, shards on different versions (or not on v2) at the end."""
    wrong = []
    if report["load"]["failed"]:
        wrong.append(f"{report['load']['failed']} failed requests")
    if report["outputs"]["differ"] or not report["outputs"]["compared"]:
        wrong.append(
            f"{report['outputs']['differ']} of {report['outputs']['compared']} outputs differ from ar"
        )
    for kind in ("worker", "datastore"):
        p99 = report["health"].get(kind, {}).get("p99_ms")
        if p99 is None or p99 > cfg.health_p99_ms:
            wrong.append(f"{kind} health p99 {p99} ms, the bound {cfg.health_p99_ms} ms")
    if set(report["versions"].values()) != {"v2"}:  # every shard, and DATA/current
        wrong.append(f"shard versions at the end: {report['versions']}")
    return wrong


def run_chaos(cfg: ChaosConfig, say: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Start the stack, load it, break it step by step, stop it; the report (``ok``: every check
    of ``verdict`` passed, ``wrong``: those that did not)."""
    from client.faultproxy import FaultProxy

    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    data, spare = _versions(cfg, say)
    shard_count = 2  # of each version (_versions)
    proxies = [FaultProxy(_shard_address(cfg.state_dir, i)) for i in range(shard_count)]
    worker_args = (*(("--model", cfg.model) if cfg.model else ()), "--grace-seconds", "15", *cfg.worker_args)
    stack = StackConfig(
        workers=2,
        worker_port=0,
        metrics_port=None,
        redis_port=0,
        worker_args=worker_args,
        datastore=str(data / "current"),  # as a Kubernetes shard starts: what the link names
        datastore_port=0,
        worker_datastore_addr=",".join(p.address for p in proxies),
        grace_seconds=15.0,
    )
    say("starting the stack (2 workers, 2 shards, redis)")
    state = up(stack, cfg.state_dir, say)
    outputs, prefix = cfg.state_dir / "outputs.jsonl", cfg.state_dir / "locust"
    outputs.unlink(missing_ok=True)
    log, stop = ChaosLog(), threading.Event()
    health: dict[str, list[float]] = {}
    prober = threading.Thread(target=_prober, args=(cfg.state_dir, log, stop, health), daemon=True)
    step = cfg.step_seconds
    load_seconds = 8 * step + 3 * cfg.stop_seconds
    try:
        prober.start()
        locust = _locust(cfg, load_seconds, outputs, prefix)
        log.event(f"locust: {cfg.users} users, mode {cfg.mode}, {load_seconds:.0f} s")
        _schedule(cfg, state, log, proxies, (data, spare))
        code = locust.wait(load_seconds + 300)
        log.event(f"locust exited ({code})")
        stop.set()
        prober.join(10)
        survivor = next(p for p in (read_state(cfg.state_dir) or state).workers() if is_alive(p))
        say("comparing every generation with ar")
        outputs_check = _compare_with_ar(cfg, outputs, survivor.address)
        versions = _shard_versions(cfg.state_dir)
        versions["DATA/current"] = current_name(data)
    finally:
        stop.set()
        down(cfg.state_dir, grace_seconds=10.0)
        for proxy in proxies:
            proxy.close()
    load = _locust_totals(prefix)
    if load["requests"] == 0:
        raise StackError(f"locust sent nothing; see {cfg.state_dir / 'logs' / 'locust.log'}")
    report: dict[str, Any] = {
        "load": load,
        "outputs": outputs_check,
        "health": {kind: _summary(values) for kind, values in sorted(health.items())},
        "versions": versions,
        "events": log.events,
        "config": {
            "users": cfg.users,
            "mode": cfg.mode,
            "max_new_tokens": cfg.max_new_tokens,
            "model": cfg.model or "default",
            "link_delay_seconds": cfg.link_delay_seconds,
            "health_p99_ms": cfg.health_p99_ms,
        },
    }
    report["wrong"] = verdict(report, cfg)
    report["ok"] = not report["wrong"]
    return report


def _shard_address(state_dir: Path, index: int) -> Callable[[], str]:
    """Where shard ``index`` listens now (the stack's state file): a proxy's upstream."""

    def address() -> str:
        state = read_state(state_dir)
        shards = state.shards() if state else []
        return shards[index].address if index < len(shards) else ""  # "": not started yet

    return address


def _schedule(
    cfg: ChaosConfig, state: Any, log: ChaosLog, proxies: list[Any], volume: tuple[Path, Path]
) -> None:
    """The failures, ``step_seconds`` apart."""

    state_dir = cfg.state_dir
    shards = state.shards()
    redis_proc = next(p for p in state.processes if p.kind == "redis")
    workers = state.workers()

    def at(offset: float) -> None:
        time.sleep(max(0.0, log.t0 + offset - time.monotonic()))

    step = cfg.step_seconds
    at(step)
    shards[0] = _kill_and_restart(state_dir, shards[0], log)
    log.event(f"{shards[0].name} restarted and SERVING")

    at(2 * step)
    _signal(shards[1], signal.SIGSTOP, log)
    time.sleep(cfg.stop_seconds)
    os.kill(shards[1].pid, signal.SIGCONT)
    log.down.discard(shards[1].name)
    log.event(f"SIGCONT {shards[1].name}")

    at(3 * step + cfg.stop_seconds)
    _signal(redis_proc, signal.SIGKILL, log)
    time.sleep(1.0)
    restart(state_dir, redis_proc)
    log.event("redis restarted")

    at(4 * step + cfg.stop_seconds)
    _killed_rebuilds(state_dir, state, log, shards, volume)

    at(5 * step + cfg.stop_seconds)
    proxies[0].blackhole()
    log.event(f"partition: workers - {shards[0].name}")
    time.sleep(cfg.stop_seconds)
    proxies[0].heal()
    log.event(f"partition healed: workers - {shards[0].name}")

    at(6 * step + 2 * cfg.stop_seconds)
    proxies[1].delay(cfg.link_delay_seconds)
    log.event(f"slow link: workers - {shards[1].name}, {cfg.link_delay_seconds * 1000:.0f} ms each way")
    time.sleep(cfg.stop_seconds)
    proxies[1].heal()
    log.event(f"slow link healed: workers - {shards[1].name}")

    at(7 * step + 3 * cfg.stop_seconds)
    _signal(workers[1], signal.SIGTERM, log)


class _Killed(Exception):
    """The rebuild dying right after a step (as SIGKILL would: no later step runs)."""


def _killed_rebuilds(
    state_dir: Path, state: Any, log: ChaosLog, shards: list[Process], volume: tuple[Path, Path]
) -> None:
    """The rebuild to v2, killed after each of its steps but the last in turn, each kill followed
    by a rerun (the Job's retry) that resumes it; shard 0 killed and restarted after the kill that
    follows the link's move. The last rerun finishes."""
    from datastore_svc.rebuild import STEPS, RebuildConfig, rebuild
    from specdraft.security import ClientSecurity

    data, spare = volume
    token = admin_token_file(state_dir).read_text().strip()

    def build(path: Path) -> None:  # the version made elsewhere, moved in whole
        staged = path.with_name(f".{path.name}.copy")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(spare, staged)
        os.replace(staged, path)

    for step in STEPS[:-1]:

        def kill_after(done: str, version: str, step: str = step) -> None:
            if done == step:
                raise _Killed(step)

        cfg = RebuildConfig(data, state.admin_addresses(), "v2", ClientSecurity(token=token))
        try:
            rebuild(cfg, build, kill_after)
        except _Killed:
            log.event(f"rebuild killed after {step!r}: shards on {_shard_versions(state_dir)}")
        if step == "current":
            shards[0] = _kill_and_restart(state_dir, shards[0], log)
            log.event(f"{shards[0].name} restarted: shards on {_shard_versions(state_dir)}")
        time.sleep(1.0)
    cfg = RebuildConfig(data, state.admin_addresses(), "v2", ClientSecurity(token=token))
    log.event(f"rebuild rerun finished: {rebuild(cfg, build)}; shards on {_shard_versions(state_dir)}")


def _kill_and_restart(state_dir: Path, proc: Process, log: ChaosLog) -> Process:
    """SIGKILL ``proc``, start it again with its command line and wait until it serves."""
    _signal(proc, signal.SIGKILL, log)
    time.sleep(1.0)  # reaped: ``restart`` refuses a process that still runs
    new = restart(state_dir, proc)
    wait_serving([new], 300)
    log.down.discard(new.name)
    return new


def _signal(proc: Process, sig: signal.Signals, log: ChaosLog) -> None:
    if not is_alive(proc):
        raise StackError(f"{proc.name} is not running")
    os.kill(proc.pid, sig)
    log.down.add(proc.name)
    log.event(f"{sig.name} {proc.name} (pid {proc.pid})")


__all__ = ["ChaosConfig", "run_chaos"]
