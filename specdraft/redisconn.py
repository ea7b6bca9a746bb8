"""Connecting to Redis, and the access each role gets there.

URLs: ``redis://[USER[:PASSWORD]@]HOST:PORT/DB``, ``rediss://...`` for TLS (redis-py's query
options such as ``?ssl_ca_certs=/path/ca.crt`` apply) or ``unix://``. A URL that names a user but
no password takes it from ``$SPECDRAFT_REDIS_PASSWORD``, so that passwords stay out of command
lines and logs (Kubernetes sets the variable from a Secret). Logs only ever show ``redacted``
URLs.

Roles (``ROLES``): one ACL user each, limited to the ``specdraft:*`` keys it needs and the commands
it sends. A worker that publishes its registry record connects as a user of its own, named as the
worker (``worker_rules``): its record's key is the only registry key it may touch, so a stolen
worker password cannot overwrite, delete or invent another worker's record. ``acl_file`` renders
them (passwords stored as SHA-256, never in clear), with the ``default`` user off.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

PASSWORD_ENV = "SPECDRAFT_REDIS_PASSWORD"
SCHEMES = ("redis://", "rediss://", "unix://")

_CONNECT = "+ping +select"  # redis-py's CLIENT SETINFO on connect may fail: it ignores that
_DENSE = f"~specdraft:datastore:* -@all {_CONNECT} +get +set +del +hgetall +hset +expire"
ROLES: dict[str, str] = {
    # dense statistics and cached dense queries; no registry record (``worker_rules``)
    "worker": _DENSE,
    # each loaded version's dense statistics
    "shard": f"~specdraft:datastore:* -@all {_CONNECT} +get +set",
    # the statistics of a version it built
    "build": f"~specdraft:datastore:* -@all {_CONNECT} +get +set",
    # discovery of workers (clients, load generators): read only
    "client": f"%R~specdraft:workers:* -@all {_CONNECT} +scan +mget +get",
}


def redacted(url: str) -> str:
    """``url`` without its password, in the user part or the query (redis-py reads both):
    ``redis://worker:***@host:6379/0``, ``redis://worker@host/0?password=***``."""
    parts = urlsplit(url)
    if parts.query:
        query = [
            (k, "***" if k.lower() == "password" else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    if parts.password is not None:
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)


def check_url(url: str, what: str) -> None:
    if not url.startswith(SCHEMES):
        raise ValueError(f"{what} URL {redacted(url)!r}: use redis://[USER@]HOST:PORT[/DB] or rediss://")


def connect(url: str, timeout: float, **options: Any) -> Any:
    """A ``redis.Redis`` for ``url`` (password from ``$SPECDRAFT_REDIS_PASSWORD`` when the URL
    names none)."""
    import redis

    password = os.environ.get(PASSWORD_ENV) if urlsplit(url).password is None else None
    kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **options}
    if password:
        kwargs["password"] = password
    return redis.Redis.from_url(url, **kwargs)


_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def worker_rules(worker_id: str) -> str:
    """The ACL rules of the user that worker ``worker_id`` connects as: the ``worker`` role's
    rights plus its own registry record, ``specdraft:workers:<worker_id>``, and no other.

    ``worker_rules("worker-0")`` → ``"~specdraft:workers:worker-0 ~specdraft:datastore:* -@all
    +ping ..."``. The id is a plain name (letters, digits, ``.``, ``_``, ``-``; at most 128), so
    that it is no glob pattern: ``"*"`` or ``"w?"`` would open other workers' keys (ValueError).
    """
    if not _WORKER_ID.fullmatch(worker_id) or worker_id in ROLES or worker_id == "default":
        raise ValueError(f"worker id {worker_id[:80]!r}: not a plain name for a Redis user of its own")
    return f"~specdraft:workers:{worker_id} {_DENSE}"


def acl_file(passwords: Mapping[str, str]) -> str:
    """An ACL file (``redis-server --aclfile``) with one user per name in ``passwords``: a role of
    ``ROLES`` gets the role's rules, any other name is a worker id with ``worker_rules``.
    ``{"client": ..., "worker-0": ...}`` → users ``client`` (discovery) and ``worker-0``."""
    lines = ["user default off"]
    for user, password in passwords.items():
        digest = hashlib.sha256(password.encode()).hexdigest()
        rules = ROLES[user] if user in ROLES else worker_rules(user)
        lines.append(f"user {user} on #{digest} resetchannels {rules}")
    return "\n".join(lines) + "\n"
