"""A datastore rebuild whose interruptions never send a restarting shard back, and that a rerun
finishes.

Two things say which version a shard serves: the running shards' memory (``SwapVersion``) and
the link ``DATA/current``, which a shard that (re)starts loads. They cannot change together, so
the order decides what a kill in between leaves. Steps, each reported when done:

1. ``pending``: ``DATA/.rebuild-pending`` names the new version (written atomically). A run that
   finds it resumes that version instead of starting another.
2. ``built``: ``DATA/versions/<V>`` is built (atomic: a killed build leaves no version), or
   reused when it exists (a resumed run never builds twice).
3. ``loaded``: every running shard loads V beside its current version (checksums, tokenizer,
   shard count: the slow part); nothing serves it yet. A shard that cannot stops the run here,
   with nothing changed.
4. ``current``: ``DATA/current`` points at V (a symlink renamed into place). From here on a
   shard that restarts loads V: the commit point.
5. ``switched``: every shard serves V (``swap_forward``: compare-and-swap, a shard that changed
   meanwhile loaded again; forward only, as ``current`` already names V).
6. ``done``: the marker is removed.

Killed after 1, 2 or 3, nothing a shard serves or loads at start has changed. Killed after 4,
every shard serves the old version or V and ``current`` names V, so a restart only ever moves a
shard forward, to where the rerun takes every shard. (``datastore swap`` followed by moving the
link, the job's former order, left running shards on V and ``current`` on the old version: a
restart went back, and nothing but a whole new build brought it forward again.) The only split a
kill can leave is between 4 and 5 — one round of swap calls — and it heals forward.

Example: ``rebuild(RebuildConfig(Path("/data"), ("shard-0:50062", "shard-1:50062")), build)``
with no marker builds ``/data/versions/20250101-030000`` through ``build(path)``, and returns
that name once both shards and ``/data/current`` are on it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from datastore_svc.fanout import load_all, swap_forward
from datastore_svc.shard import BadVersionName, check_version_name
from specdraft.common import atomic_write_text, file_lock, fsync_path, temp_sibling
from specdraft.security import ClientSecurity

PENDING = ".rebuild-pending"
"""The marker, beside ``current``: ``{"version": "<V>"}`` while a rebuild of V is under way."""
CURRENT = "current"
"""The link to ``versions/<V>`` that a (re)starting shard loads."""
VERSIONS = "versions"
"""The directory of the immutable versions (the shards' ``--versions-root``)."""

STEPS = ("pending", "built", "loaded", "current", "switched", "done")
"""The steps in their order; ``rebuild`` reports each when it is done."""


class RebuildError(RuntimeError):
    """A rebuild that cannot start or resume (the text says why and what to do)."""


@dataclass(frozen=True)
class RebuildConfig:
    data: Path
    """The volume: ``versions/<V>``, the link ``current`` and the marker ``.rebuild-pending``."""
    admin_addresses: Sequence[str]
    """Every shard's admin port, one per shard, in shard order."""
    version: str = ""
    """The new version's name; "" = the UTC time (``20250101-030000``). A pending rebuild keeps its own."""
    security: ClientSecurity = field(default_factory=ClientSecurity)
    """The admin identity and transport for the shards' admin ports."""
    timeout_seconds: float = 600.0
    """How long each shard may take to load the version."""


def rebuild(
    cfg: RebuildConfig,
    build: Callable[[Path], None],
    report: Callable[[str, str], None] = lambda step, version: None,
) -> str:
    """Build a version with ``build(path)`` (or resume the pending one) and make it current on
    every shard and in ``DATA/current``, in the order of the module's docstring; the version's
    name. ``report(step, version)`` follows each step. Rebuilds on one volume take turns (the lock
    file ``.rebuild.lock``). RebuildError, or fanout's SwapError, if it cannot finish: the marker
    stays and a rerun resumes."""
    data = cfg.data
    with file_lock(data / ".rebuild.lock"):
        name = start_or_resume(data, cfg.version)
        report("pending", name)
        target = data / VERSIONS / name
        if not target.exists():
            build(target)
        report("built", name)
        expected = load_all(cfg.admin_addresses, name, cfg.security, cfg.timeout_seconds)
        report("loaded", name)
        point_current(data, name)
        report("current", name)
        swap_forward(cfg.admin_addresses, name, expected, cfg.security, cfg.timeout_seconds)
        report("switched", name)
        (data / PENDING).unlink()
        fsync_path(data)
        report("done", name)
    return name


def start_or_resume(data: Path, wanted: str = "") -> str:
    """The version this run makes current: the pending one (``DATA/.rebuild-pending``) if any,
    else ``wanted`` (or the UTC time), recorded in a new marker first. ``wanted`` naming another
    version than the pending one, or a version that already exists, is a RebuildError."""
    pending = read_pending(data)
    if pending:
        if wanted and wanted != pending:
            raise RebuildError(
                f"a rebuild of {pending!r} is pending ({data / PENDING}): rerun without a version to "
                "finish it, or remove the marker to abandon it"
            )
        return pending
    name = wanted or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        check_version_name(name)
    except BadVersionName as exc:
        raise RebuildError(str(exc)) from None
    if (data / VERSIONS / name).exists():
        raise RebuildError(f"version {name!r} exists (versions are immutable): choose another name")
    (data / VERSIONS).mkdir(parents=True, exist_ok=True)
    atomic_write_text(data / PENDING, json.dumps({"version": name}) + "\n")
    return name


def read_pending(data: Path) -> str:
    """The version ``DATA/.rebuild-pending`` names; "" when there is none."""
    marker = data / PENDING
    try:
        name = json.loads(marker.read_text(encoding="utf-8"))["version"]
        check_version_name(name)
    except FileNotFoundError:
        return ""
    except (ValueError, KeyError, TypeError, BadVersionName) as exc:
        raise RebuildError(f"{marker} is not a rebuild marker ({exc}): remove it and rerun") from None
    return str(name)


def point_current(data: Path, name: str) -> None:
    """Point ``DATA/current`` at ``versions/<name>`` (relative): a new symlink renamed over the
    old one, so a reader sees one or the other; durable once this returns. Links left by a run
    killed before its rename are removed first."""
    link = data / CURRENT
    for stale in data.glob(f".{CURRENT}.tmp-*"):
        stale.unlink()
    tmp = temp_sibling(link)
    os.symlink(f"{VERSIONS}/{name}", tmp)
    os.replace(tmp, link)
    fsync_path(data)


def current_name(data: Path) -> str:
    """The version ``DATA/current`` names (``versions/v2`` → ``"v2"``)."""
    return Path(os.readlink(data / CURRENT)).name
