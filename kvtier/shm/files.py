"""The agent's files in shared memory (the pool, its staging area, the published index), made
whole before anyone maps them. This module imports only the standard library: the vLLM
plug-in loads the modules that use it.

Every page of such a file is allocated (posix_fallocate) before it is mapped: on a tmpfs
smaller than the file, a sparse file maps fine and then kills whoever first touches a page
the filesystem cannot supply, with SIGBUS; allocating raises OSError (ENOSPC) instead. The
mode is set on the open file, so the umask neither widens nor narrows it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from pathlib import Path


def new_file(path: Path, size: int, mode: int, header: bytes) -> Path:
    """A fresh file beside `path` (`<name>.new`) of `size` bytes, all allocated, with exactly
    `mode` and `header` at its start. The caller moves it over `path` (os.replace) once it is
    ready, so a reader opens a whole file or the one it replaces; on failure it is removed
    (a `.new` left by a process killed meanwhile is truncated by the next one)."""
    target = path.with_name(path.name + ".new")
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, header, 0)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return target


def claim(path: Path) -> list[int]:
    """Remove `path` and its `.new` if this process does not own them (or they are not
    plain files): in the agent's directory only the agent makes files, so another uid's
    file there (planted before this agent's first start, or left from a layout where the
    tier's group could write the directory) is never taken up. Returns the owners of what
    was removed."""
    removed = []
    for candidate in (path, path.with_name(path.name + ".new")):
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            continue
        os.unlink(candidate)
        removed.append(info.st_uid)
    return removed


def foreign(fd: int, path: Path, group_writes: bool) -> str | None:
    """Why the file open at `fd` (found at `path`) is not the agent's, or None. The agent's
    files belong to the owner of their directory, which nobody else may change (not
    writable by the group unless sticky, never by others); a pool or index is writable by
    its owner alone (`group_writes` false), the staging area by its group too."""
    info, directory = os.fstat(fd), os.stat(path.parent)
    sticky = directory.st_mode & stat.S_ISVTX
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a file"
    if info.st_uid != directory.st_uid:
        return f"{path} belongs to uid {info.st_uid}, not to its directory's owner"
    if directory.st_mode & 0o002 or (directory.st_mode & 0o020 and not sticky):
        return f"{path.parent} may be changed by others than its owner"
    if info.st_mode & (0o002 if group_writes else 0o022):
        return f"{path} is writable by others than its owner"
    return None


def close_directory(directory: Path) -> None:
    """The agent's own pool directory made unwritable to its group and others (a directory
    it made itself, outside a CSI volume, may have been made with a loose umask): only then
    do clients trust the files in it (`foreign`)."""
    info = os.stat(directory)
    if info.st_uid == os.geteuid() and info.st_mode & 0o022:
        os.chmod(directory, stat.S_IMODE(info.st_mode) & ~0o022)


def hold_lock(path: Path, wait: float) -> int | None:
    """An exclusive lock on `path` (made the agent's own, 0600, with this process's pid in
    it), waiting up to `wait` seconds for whoever holds it, or None with the lock still
    held by another. The kernel drops the lock when its process ends however it ends, so a
    restart after a kill finds it free; the descriptor is not inherited by children, which
    would otherwise hold the lock past their parent."""
    close_directory(path.parent)  # so nobody else can put a file of theirs there
    claim(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.1)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, 0)
    with contextlib.suppress(OSError):  # the pid is for messages; a full volume keeps none
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
    return fd


def lock_holder(path: Path) -> str:
    """The pid written in a lock file, for messages ("?" when unreadable)."""
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"
