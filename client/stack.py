"""The local stack: Redis and LLM workers as processes on loopback (`specdraft up` / `down`).

``up`` starts ``redis-server`` (when installed and not disabled) and N workers that register in it,
waits until every worker's gRPC health check says SERVING, and writes a state file describing what
runs where. ``down`` reads it and stops the processes: workers first with SIGTERM (they drain their
requests in flight), then Redis. Every process runs in its own session and logs to a file beside
the state file, so the stack outlives the shell that started it.

The state file is the contract with other tools: ``specdraft status`` prints it and the locustfile
(``deploy/locustfile.py``) reads it to find the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.common import atomic_write_text

STATE_FILE = "stack.json"


class StackError(Exception):
    """The stack could not be started, found or stopped; the message says why."""


def default_state_dir() -> Path:
    """``$SPECDRAFT_STACK_DIR``, else ``$SPECDRAFT_CACHE/stack``, else ``~/.cache/specdraft/stack``."""
    if os.environ.get("SPECDRAFT_STACK_DIR"):
        return Path(os.environ["SPECDRAFT_STACK_DIR"])
    cache = os.environ.get("SPECDRAFT_CACHE") or str(Path.home() / ".cache" / "specdraft")
    return Path(cache) / "stack"


@dataclass(frozen=True)
class StackConfig:
    workers: int = 1
    """LLM worker processes to start."""
    worker_port: int = 50051
    """gRPC port of the first worker; the others count up. 0 = free ports."""
    metrics_port: int | None = 9100
    """Prometheus port of the first worker (counting up); None = no metrics endpoints. 0 = free ports."""
    redis: bool = True
    """Start a redis-server for the registry (skipped, with a note, when it is not installed)."""
    redis_port: int = 6380
    """Not 6379: a system Redis installed by apt often listens there already. 0 = a free port."""
    worker_args: tuple[str, ...] = ()
    """Extra arguments for every ``specdraft serve worker`` (model, dtype, threads, limits...)."""
    startup_timeout: float = 900.0
    """Seconds to wait for every worker to load its model and report SERVING."""
    grace_seconds: float = 30.0
    """Drain time given to each worker on ``down``."""
    datastore: str | None = None
    """A datastore version directory: one shard server per shard, and workers use them for rest
    and (if the version has a dense index) dresd; Redis then caches dense statistics and queries."""
    datastore_port: int = 50061
    """gRPC port of the first shard server (counting up); 0 = free ports."""
    worker_datastore_addr: str | None = None
    """The shard addresses the workers are given (``host:port,...``, in shard order); None = the
    shards' own. The chaos run gives its fault proxies' (``client/faultproxy.py``)."""


@dataclass
class Process:
    name: str
    kind: str  # "redis" | "datastore" | "worker"
    pid: int
    address: str
    log: str
    started: float = 0.0
    """Kernel start time of the process (``/proc``), so that ``down`` never signals a reused pid."""
    metrics: str = ""
    admin: str = ""
    """A shard's admin address (DatastoreAdmin: LoadVersion, SwapVersion)."""
    argv: list[str] = field(default_factory=list)
    """The command line it was started with (``restart``)."""


@dataclass
class StackState:
    processes: list[Process] = field(default_factory=list)
    registry: str = ""

    def workers(self) -> list[Process]:
        return [p for p in self.processes if p.kind == "worker"]

    def shards(self) -> list[Process]:
        return [p for p in self.processes if p.kind == "datastore"]

    def worker_addresses(self) -> list[str]:
        return [p.address for p in self.workers()]

    def admin_addresses(self) -> list[str]:
        return [p.admin for p in self.shards()]

    def to_json(self) -> dict[str, Any]:
        return {"registry": self.registry, "processes": [asdict(p) for p in self.processes]}

    @staticmethod
    def from_json(data: dict[str, Any]) -> StackState:
        return StackState(
            processes=[Process(**p) for p in data.get("processes", [])], registry=data.get("registry", "")
        )


REDIS_SECRETS_FILE = "redis-passwords.json"
"""The password of each Redis user, mode 0600: every role of ``specdraft.redisconn.ROLES`` and each
worker's own user (``worker-0``, ...); the ACL file holds only their hashes."""


def redis_passwords(state_dir: Path, workers: int) -> dict[str, str]:
    """The stack's Redis passwords by user: the roles and ``worker-0`` .. ``worker-<workers - 1>``,
    each made (random) when the file lacks it."""
    import secrets

    from specdraft.redisconn import ROLES

    path = state_dir / REDIS_SECRETS_FILE
    passwords = dict(json.loads(path.read_text())) if path.exists() else {}
    users = [*ROLES, *(f"worker-{i}" for i in range(workers))]
    if any(user not in passwords for user in users):
        state_dir.mkdir(parents=True, exist_ok=True)
        passwords |= {user: secrets.token_urlsafe(24) for user in users if user not in passwords}
        atomic_write_text(path, json.dumps(passwords) + "\n", mode=0o600)
    return {user: passwords[user] for user in users}


def redis_password(state_dir: Path, user: str) -> str | None:
    """One Redis user's password of the stack in ``state_dir`` (None: the stack has no Redis ACL)."""
    path = state_dir / REDIS_SECRETS_FILE
    return str(json.loads(path.read_text())[user]) if path.exists() else None


ADMIN_TOKEN_FILE = "admin-token"
"""The stack's admin token (the shards accept it for LoadVersion / SwapVersion), mode 0600."""


def admin_token_file(state_dir: Path) -> Path:
    """The stack's admin token file, made (a fresh random token) if missing."""
    path = state_dir / ADMIN_TOKEN_FILE
    if not path.exists():
        import secrets

        state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, secrets.token_urlsafe(32) + "\n", mode=0o600)
    return path


# -- state file ---------------------------------------------------------------------------------


def read_state(state_dir: Path) -> StackState | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        return StackState.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise StackError(f"{path} is not a stack state file ({exc}); remove it by hand") from exc


def write_state(state_dir: Path, state: StackState) -> None:
    """Write atomically: a temporary file renamed over the old one."""
    atomic_write_text(state_dir / STATE_FILE, json.dumps(state.to_json(), indent=2) + "\n")


# -- processes ------------------------------------------------------------------------------------


def _start_time(pid: int) -> float:
    """The process's start time in clock ticks since boot (Linux), 0.0 where /proc is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    return float(stat.rsplit(")", 1)[1].split()[19])  # field 22 of stat(5)


def is_alive(proc: Process) -> bool:
    _reap(proc.pid)  # a child of ours that exited is a zombie until collected
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not proc.started:
        return True
    return _start_time(proc.pid) == proc.started


def _reap(pid: int) -> None:
    """Collect our own exited child (no-op for processes started by another `specdraft up`)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port(base: int, index: int) -> int:
    return _free_port() if base == 0 else base + index


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _spawn(
    name: str, kind: str, argv: Sequence[str], address: str, log: Path, env: dict[str, str] | None = None
) -> Process:
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
    return Process(name, kind, popen.pid, address, str(log), _start_time(popen.pid), argv=list(argv))


def _tail(path: str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _wait_redis(proc: Process, timeout: float, password: str) -> None:
    import redis

    client = redis.Redis.from_url(f"redis://client@{proc.address}/0", socket_timeout=1.0, password=password)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_alive(proc):
            raise StackError(f"redis-server exited at start:\n{_tail(proc.log)}")
        with contextlib.suppress(redis.RedisError):
            if client.ping():
                return
        time.sleep(0.1)
    raise StackError(f"redis-server did not answer within {timeout:.0f} s:\n{_tail(proc.log)}")


def health_status(address: str, timeout: float = 2.0) -> str:
    """The worker's overall grpc.health.v1 status name, or UNREACHABLE."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
    except grpc.RpcError:
        return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def wait_serving(procs: Sequence[Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        for proc in list(waiting):
            if not is_alive(proc):
                raise StackError(f"{proc.name} exited during start-up ({proc.log}):\n{_tail(proc.log)}")
            if health_status(proc.address) == "SERVING":
                waiting.remove(proc)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise StackError(f"{names} not SERVING after {timeout:.0f} s; see {waiting[0].log}")
        if waiting:
            time.sleep(0.25)


def _stop(procs: Sequence[Process], sig: int, timeout: float) -> list[Process]:
    """Signal each live process, wait up to ``timeout``; return those still alive."""
    for proc in procs:
        if is_alive(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if is_alive(p)]
        if alive:
            time.sleep(0.1)
    return alive


def stop_processes(procs: Sequence[Process], grace_seconds: float) -> None:
    """Workers first (SIGTERM: drain), then shards, then the rest; SIGKILL what outlives its grace."""
    workers = [p for p in procs if p.kind == "worker"]
    shards = [p for p in procs if p.kind == "datastore"]
    others = [p for p in procs if p.kind not in ("worker", "datastore")]
    for group, grace in ((workers, grace_seconds + 10.0), (shards, 20.0), (others, 10.0)):
        stubborn = _stop(group, signal.SIGTERM, grace)
        _stop(stubborn, signal.SIGKILL, 5.0)


# -- up / down --------------------------------------------------------------------------------------


def up(cfg: StackConfig, state_dir: Path, log: Any = None) -> StackState:
    """Start the stack and wait until it serves; on any failure stop what was started."""
    say = log or (lambda msg: None)
    if cfg.workers < 1:
        raise StackError("--workers must be at least 1")
    current = read_state(state_dir)
    if current is not None and any(is_alive(p) for p in current.processes):
        raise StackError(f"a stack is already running (state in {state_dir}); run `specdraft down` first")
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    state = StackState()
    try:
        if cfg.redis:
            redis_bin = shutil.which("redis-server")
            if redis_bin is None:
                say("redis-server is not installed: workers run without a registry")
            else:
                port = _port(cfg.redis_port, 0)
                if _port_in_use(port):
                    raise StackError(f"port {port} for redis is in use; choose another with --redis-port")
                from specdraft.redisconn import acl_file

                passwords = redis_passwords(state_dir, cfg.workers)
                acl = state_dir / "redis-users.acl"
                atomic_write_text(acl, acl_file(passwords), mode=0o600)
                argv = [redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
                argv += ["--appendonly", "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]
                argv += ["--dir", str(state_dir), "--protected-mode", "yes", "--aclfile", str(acl.resolve())]
                proc = _spawn("redis", "redis", argv, f"127.0.0.1:{port}", logs / "redis.log")
                state.processes.append(proc)
                write_state(state_dir, state)
                _wait_redis(proc, 30.0, passwords["client"])
                state.registry = f"redis://client@127.0.0.1:{port}/0"  # discovery (read only)
                say(f"redis      {proc.address}  (pid {proc.pid})")
        datastore_addr = ""
        if cfg.datastore:
            shards = start_shards(cfg, state, state_dir, logs)
            say(f"waiting for {len(shards)} datastore shard(s) to load and report SERVING ...")
            wait_serving(shards, cfg.startup_timeout)
            for proc in shards:
                say(f"{proc.name:10s} {proc.address}  (pid {proc.pid})")
            datastore_addr = cfg.worker_datastore_addr or ",".join(p.address for p in shards)
        workers = []
        for i in range(cfg.workers):
            port = _port(cfg.worker_port, i)
            if _port_in_use(port):
                raise StackError(f"port {port} for worker-{i} is in use; choose another with --port")
            argv = [sys.executable, "-m", "client.cli", "serve", "worker", "--port", str(port)]
            argv += ["--worker-id", f"worker-{i}", "--grace-seconds", str(cfg.grace_seconds)]
            metrics = ""
            if cfg.metrics_port is not None:
                mport = _port(cfg.metrics_port, i)
                argv += ["--metrics-port", str(mport)]
                metrics = f"http://127.0.0.1:{mport}/metrics"
            env = None
            if state.registry:  # as its own Redis user "worker-<i>", its password in the environment
                worker_redis = _as_user(state.registry, f"worker-{i}")
                argv += ["--registry", worker_redis]
                env = _redis_env(state_dir, f"worker-{i}")
            if datastore_addr:
                argv += ["--datastore-addr", datastore_addr]
                if state.registry:  # dense statistics and query results, shared by the workers
                    argv += ["--dense-cache", worker_redis]
            argv += list(cfg.worker_args)
            log_file = logs / f"worker-{i}.log"
            proc = _spawn(f"worker-{i}", "worker", argv, f"127.0.0.1:{port}", log_file, env)
            proc.metrics = metrics
            state.processes.append(proc)
            workers.append(proc)
            write_state(state_dir, state)
        say(f"waiting for {len(workers)} worker(s) to load the model and report SERVING ...")
        wait_serving(workers, cfg.startup_timeout)
        for proc in workers:
            say(f"{proc.name:10s} {proc.address}  (pid {proc.pid}) {proc.metrics}")
        write_state(state_dir, state)
        return state
    except BaseException:
        stop_processes(state.processes, grace_seconds=0.0)
        with contextlib.suppress(OSError):
            (state_dir / STATE_FILE).unlink()
        raise


def start_shards(cfg: StackConfig, state: StackState, state_dir: Path, logs: Path) -> list[Process]:
    """One ``serve datastore`` process per shard of ``cfg.datastore``, recorded in ``state`` (and its
    file) as each starts, so that a failure later can stop them; not yet waited for."""
    assert cfg.datastore is not None
    manifest = Path(cfg.datastore) / "manifest.json"
    try:
        count = len(json.loads(manifest.read_text())["shards"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StackError(f"{cfg.datastore} is not a datastore version ({exc})") from None
    shards = []
    for i in range(count):
        port = _port(cfg.datastore_port, i)
        if _port_in_use(port):
            raise StackError(
                f"port {port} for datastore shard {i} is in use; choose another with --datastore-port"
            )
        argv = [sys.executable, "-m", "client.cli", "serve", "datastore", "--datastore", str(cfg.datastore)]
        admin_port = _free_port()
        argv += ["--shard", str(i), "--port", str(port), "--admin-port", str(admin_port)]
        argv += ["--admin-token-file", str(admin_token_file(state_dir))]
        env = None
        if state.registry:  # shards publish dense statistics where workers look first
            argv += ["--redis", _as_user(state.registry, "shard")]
            env = _redis_env(state_dir, "shard")
        proc = _spawn(f"shard-{i}", "datastore", argv, f"127.0.0.1:{port}", logs / f"shard-{i}.log", env)
        proc.admin = f"127.0.0.1:{admin_port}"
        state.processes.append(proc)
        shards.append(proc)
        write_state(state_dir, state)
    return shards


def restart(state_dir: Path, proc: Process) -> Process:
    """Start ``proc`` again with its command line (after it died or was killed), record the new
    pid in the state file, and return it (not yet waited for)."""
    if not proc.argv:
        raise StackError(f"{proc.name}: its command line is not recorded; restart the stack")
    if is_alive(proc):
        raise StackError(f"{proc.name} (pid {proc.pid}) is still running")
    user = {"datastore": "shard", "worker": proc.name}.get(proc.kind)  # a worker's user is its name
    env = _redis_env(state_dir, user) if user else None
    new = _spawn(proc.name, proc.kind, proc.argv, proc.address, Path(proc.log), env)
    new.metrics, new.admin = proc.metrics, proc.admin
    state = read_state(state_dir) or StackState()
    state.processes = [new if p.name == proc.name else p for p in state.processes]
    write_state(state_dir, state)
    return new


def _as_user(url: str, user: str) -> str:
    """The stack's Redis URL as another ACL user: ``redis://client@h:p/0`` → ``redis://worker-0@h:p/0``."""
    return url.replace("redis://client@", f"redis://{user}@", 1)


def _redis_env(state_dir: Path, user: str) -> dict[str, str]:
    from specdraft.redisconn import PASSWORD_ENV

    password = redis_password(state_dir, user)
    return {PASSWORD_ENV: password} if password else {}


def down(state_dir: Path, grace_seconds: float = 30.0) -> StackState | None:
    """Stop the stack described in ``state_dir``; None when there is none."""
    state = read_state(state_dir)
    if state is None:
        return None
    stop_processes(state.processes, grace_seconds)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return state


def status(state_dir: Path) -> list[dict[str, Any]]:
    """One row per process: name, address, pid, alive, and a worker's health."""
    state = read_state(state_dir)
    if state is None:
        return []
    rows = []
    for proc in state.processes:
        alive = is_alive(proc)
        health = health_status(proc.address) if alive and proc.kind == "worker" else ""
        rows.append({**asdict(proc), "alive": alive, "health": health})
    return rows
