"""``specdraft secrets``: fresh credentials for a deployment, as files for ``kubectl create secret``."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any

from client.cli.common import CliError
from specdraft.common import atomic_write_text


def add_secrets(sub: Any) -> None:
    s = sub.add_parser(
        "secrets",
        help="make an admin token, client tokens, Redis passwords and their ACL file (README, Security)",
    )
    s.add_argument("--out", required=True, help="a new directory for the files (mode 0700, files 0600)")
    s.add_argument("--client-tokens", type=int, default=1, help="bearer tokens for the workers' clients")
    s.add_argument(
        "--workers",
        type=int,
        default=0,
        help="Redis users worker-0 .. worker-<N-1>, each allowed its own registry record alone "
        "(for workers that publish with --worker-id worker-<i>)",
    )
    s.set_defaults(func=cmd_secrets)


def _write(path: Path, text: str) -> None:
    atomic_write_text(path, text, mode=0o600)


def cmd_secrets(args: argparse.Namespace) -> int:
    from specdraft.redisconn import ROLES, acl_file

    if args.workers < 0:
        raise CliError("--workers must be 0 or more")
    out = Path(args.out)
    try:
        out.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        raise CliError(f"{out} exists: secrets are written to a new directory only") from None
    users = [*ROLES, *(f"worker-{i}" for i in range(args.workers))]
    passwords = {user: secrets.token_urlsafe(24) for user in users}
    _write(out / "admin-token", secrets.token_urlsafe(32) + "\n")
    _write(
        out / "client-tokens", "".join(secrets.token_urlsafe(32) + "\n" for _ in range(args.client_tokens))
    )
    _write(out / "users.acl", acl_file(passwords))
    for user, password in passwords.items():
        _write(out / f"redis-{user}", password)
    files = sorted(p.name for p in out.iterdir())
    sys.stdout.write(json.dumps({"out": str(out), "files": files}) + "\n")
    return 0
