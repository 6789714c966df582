"""Checks of an agent config against the machine it starts on: directories writable, the
pool fitting its filesystem, NIXL present where the config asks for it. Run once at start
(and by `kvtier agent --check`) before anything is created; kept apart from the config model,
which the operator imports and which must not touch the filesystem or load numpy or NIXL.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from kvtier.api.config import AgentConfig, ConfigError
from kvtier.api.pool_layout import (
    pool_geometry,
    tier_files_bytes,
)
from kvtier.api.units import format_bytes
from kvtier.shm.pool import staging_path
from kvtier.shm.table import index_path


def _check_writable_dir(field: str, directory: Path, create: bool) -> str | None:
    """Whether the agent can write in `directory`, made if missing. Without `create` (`kvtier
    agent --check`) nothing is made: a missing directory is judged by the directory it
    would be made in."""
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvtier-probe-"):
                pass
        else:
            _writable_or_makeable(directory)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return (
            f"{field}: {directory} is not a writable directory ({reason}); "
            f"fix: point {field} at a writable directory or mount one there"
        )
    return None


def _existing(directory: Path) -> Path:
    """`directory`, or where it is missing the nearest directory above it that exists (the
    one a start would make it in)."""
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent
    return directory


def _writable_or_makeable(directory: Path) -> None:
    """Raises the OSError a start would meet making or writing in `directory`."""
    probe = _existing(directory)
    if not probe.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(probe))


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def _check_pool_fits(config: AgentConfig) -> str | None:
    """A pool file larger than the free space of its filesystem maps fine and then kills
    whoever touches a page the filesystem cannot supply (SIGBUS): refuse to start instead.
    The staging area and the published index live beside the pool and count too."""
    host = config.host
    geometry = pool_geometry(host.capacity, host.chunk_bytes)
    needed = tier_files_bytes(geometry)
    pool = config.pool_path
    try:
        st = os.statvfs(_existing(host.pool_dir))  # not made yet under `--check`
    except OSError:
        return None  # the writable-directory check reports it
    free = st.f_bavail * st.f_frsize
    # Pool and staging area are resized in place, or removed before they are made anew
    # (pool_resize.py, pool.open_staging): what they hold counts as room, and so does a
    # `.new` file a killed agent left (truncated when that file is made again). The index
    # is made beside the one it replaces, which readers may still map.
    for path in (pool, staging_path(pool)):
        free += _allocated(path) + _allocated(path.with_name(path.name + ".new"))
    free += _allocated(index_path(pool).with_name(index_path(pool).name + ".new"))
    if free >= needed:
        return None
    return (
        f"host.capacity ({format_bytes(host.capacity)}: a pool file of "
        f"{format_bytes(geometry.file_bytes)}, {format_bytes(needed)} with its staging area "
        f"and index) does not fit in host.poolDir {host.pool_dir}: its filesystem has "
        f"{format_bytes(free)} free; fix: lower host.capacity or give the pool's filesystem "
        "more room (the tier's volume size, or the pod's /dev/shm)"
    )


def check_runtime(config: AgentConfig, create: bool = True) -> None:
    """Checks that need the filesystem, done once at start before anything else is created
    (the directories are, unless `create` is false)."""
    checks = [("host.poolDir", config.host.pool_dir), ("runDir", config.run_dir)]
    checks += [
        (f"tiers[{i}].filesystem.path", t.filesystem.path)
        for i, t in enumerate(config.tiers)
        if t.filesystem is not None
    ]
    problems = [p for field, path in checks if (p := _check_writable_dir(field, path, create))]
    problems += [p for p in [_check_pool_fits(config)] if p]
    from kvtier.agent.tiers import nixl_path  # loads NIXL, which only this check needs here

    problems += [
        f"tiers[{i}].peer.dataPath is 'nixl' but NIXL is not installed: install nixl-cu12 "
        "(`make test` does) or set dataPath to 'auto' or 'zmq'"
        for i, t in enumerate(config.tiers)
        if t.peer is not None and t.peer.data_path == "nixl" and not nixl_path.available()
    ]
    if config.report.target == "kubernetes":
        from kvtier.kube import credentials_problem

        problem = credentials_problem()
        if problem is not None:
            problems.append(
                f"report.target is 'kubernetes' but there are no Kubernetes credentials here "
                f"({problem}); fix: run the agent in a pod with a service account, set "
                "KUBECONFIG, or set report.target to 'file' or 'none'"
            )
    if problems:
        raise ConfigError(problems)
