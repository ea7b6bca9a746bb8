"""``specdraft up``, ``down``, ``status``: the local stack (``client.stack``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from client.cli.common import (
    CliError,
    add_model_args,
    add_online_store_args,
    online_store_args,
    positive_int,
    print_json,
    worker_model_args,
)


def add_stack(sub: Any) -> None:
    u = sub.add_parser("up", help="start the local stack: redis + workers on loopback")
    add_model_args(u)
    u.add_argument("--workers", type=positive_int, default=1, help="worker processes")
    u.add_argument("--port", type=int, default=50051, help="first worker's gRPC port (0 = free ports)")
    u.add_argument("--metrics-port", type=int, default=9100, help="first worker's metrics port")
    u.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoints")
    u.add_argument("--redis-port", type=int, default=6380, help="0 = a free port")
    u.add_argument("--no-redis", action="store_true", help="workers run without a registry")
    u.add_argument("--datastore", help="a datastore version: one shard server per shard, used by the workers")
    u.add_argument("--datastore-port", type=int, default=50061, help="first shard's port (0 = free ports)")
    u.add_argument("--max-concurrent", type=positive_int, default=4, help="per worker")
    u.add_argument("--grace-seconds", type=float, default=30.0, help="each worker's drain time on down")
    u.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    u.add_argument("--no-warm", dest="warm", action="store_false", help="workers skip the cost curve")
    u.add_argument("--state-dir", help="where the state file and logs live (default: the user cache)")
    add_online_store_args(u)  # each worker's bounds
    u.set_defaults(func=cmd_up)

    d = sub.add_parser("down", help="stop the local stack")
    d.add_argument("--grace-seconds", type=float, default=30.0, help="drain time before SIGKILL")
    d.add_argument("--state-dir", help="as given to up")
    d.set_defaults(func=cmd_down)

    st = sub.add_parser("status", help="what the local stack runs and whether it is healthy")
    st.add_argument("--state-dir", help="as given to up")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    c = sub.add_parser(
        "chaos",
        help="load a fresh local stack with locust while shards, redis, links and a worker fail; report "
        "and check failures, outputs that differ from ar, health latency and the shards' versions",
    )
    c.add_argument(
        "--model", default=None, help="the workers' model directory (default: SmolLM2-135M-Instruct)"
    )
    c.add_argument("--state-dir", required=True, help="a directory for the stack, versions, logs and report")
    c.add_argument("--users", type=positive_int, default=4, help="locust users")
    c.add_argument("--mode", default="rest")
    c.add_argument("--max-new-tokens", type=positive_int, default=32)
    c.add_argument("--step-seconds", type=float, default=10.0, help="time between two failures")
    c.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker")
    c.add_argument("--json-out", help="write the report here too")
    c.set_defaults(func=cmd_chaos)


def _state_dir(args: argparse.Namespace) -> Path:
    from client.stack import default_state_dir

    return Path(args.state_dir) if args.state_dir else default_state_dir()


def cmd_up(args: argparse.Namespace) -> int:
    from client.stack import StackConfig, StackError, up

    threads = args.threads or (max(1, (os.cpu_count() or 1) // args.workers) if args.workers > 1 else None)
    worker_args = worker_model_args(args, threads)
    worker_args += ["--max-concurrent", str(args.max_concurrent), *online_store_args(args)]
    if not args.warm:
        worker_args.append("--no-warm")
    cfg = StackConfig(
        workers=args.workers,
        worker_port=args.port,
        metrics_port=None if args.no_metrics else args.metrics_port,
        redis=not args.no_redis,
        redis_port=args.redis_port,
        worker_args=tuple(worker_args),
        startup_timeout=args.timeout,
        grace_seconds=args.grace_seconds,
        datastore=args.datastore,
        datastore_port=args.datastore_port,
    )
    state_dir = _state_dir(args)
    try:
        state = up(cfg, state_dir, log=lambda msg: sys.stderr.write(msg + "\n"))
    except StackError as exc:
        sys.stderr.write(f"specdraft: error: {exc}\n")
        return 1
    sys.stdout.write(json.dumps({"state_dir": str(state_dir), **state.to_json()}) + "\n")
    hint = f"--server {state.worker_addresses()[0]} "
    if state.registry:  # discovery as the read-only Redis user "client", its password in a file
        from client.stack import REDIS_SECRETS_FILE

        secrets = state_dir / REDIS_SECRETS_FILE
        hint = f"--registry {state.registry} (SPECDRAFT_REDIS_PASSWORD: 'client' in {secrets}) "
    sys.stderr.write(f"ready. try: specdraft generate {hint}--mode pld 'Hello'; stop: specdraft down\n")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from client.stack import StackError, down

    try:
        state = down(_state_dir(args), grace_seconds=args.grace_seconds)
    except StackError as exc:
        raise CliError(str(exc)) from exc
    if state is None:
        sys.stderr.write("no stack is running\n")
    else:
        sys.stderr.write(f"stopped {len(state.processes)} process(es)\n")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from client.stack import StackError, status

    try:
        rows = status(_state_dir(args))
    except StackError as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
    elif not rows:
        sys.stdout.write("no stack is running\n")
    for row in rows if not args.json else []:
        state = row["health"] or ("running" if row["alive"] else "DEAD")
        sys.stdout.write(f"{row['name']:10s} {row['address']:22s} pid {row['pid']:<8d} {state}\n")
    return 0 if all(r["alive"] for r in rows) else 1


def cmd_chaos(args: argparse.Namespace) -> int:
    from client.chaos import ChaosConfig, run_chaos
    from client.stack import StackError

    cfg = ChaosConfig(
        state_dir=Path(args.state_dir),
        model=args.model,
        users=args.users,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        step_seconds=args.step_seconds,
        worker_args=("--threads", str(args.threads)),
    )

    def say(msg: str) -> None:
        sys.stderr.write(msg + "\n")

    try:
        report = run_chaos(cfg, say=say)
    except StackError as exc:
        raise CliError(str(exc)) from exc
    print_json(report, args.json_out, indent=1)
    for wrong in report["wrong"]:
        say(f"chaos: {wrong}")
    return 0 if report["ok"] else 1
