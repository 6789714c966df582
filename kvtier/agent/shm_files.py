"""The agent's files in shared memory (the pool, its staging area, the published index), made
whole before anyone maps them. This module imports only the standard library: the vLLM
plug-in loads the modules that use it.

Every page of such a file is allocated (posix_fallocate) before it is mapped: on a tmpfs
smaller than the file, a sparse file maps fine and then kills whoever first touches a page
the filesystem cannot supply, with SIGBUS; allocating raises OSError (ENOSPC) instead. The
mode is set on the open file, so the umask neither widens nor narrows it.
"""

from __future__ import annotations

import os
from pathlib import Path


def new_file(path: Path, size: int, mode: int, header: bytes) -> Path:
    """A fresh file beside `path` (`<name>.new`) of `size` bytes, all allocated, with exactly
    `mode` and `header` at its start. The caller moves it over `path` (os.replace) once it is
    ready, so a reader opens a whole file or the one it replaces; on failure it is removed."""
    target = path.with_name(path.name + ".new")
    _allocate(target, os.O_CREAT | os.O_TRUNC, size, mode, header)
    return target


def allocate(path: Path, size: int, mode: int) -> None:
    """The existing file at `path`, kept as it is, given exactly `mode` and every page of its
    `size` bytes (a warm restart reuses the pool of an agent that may have set another mode)."""
    _allocate(path, 0, size, mode, None)


def _allocate(path: Path, create: int, size: int, mode: int, header: bytes | None) -> None:
    fd = os.open(path, os.O_RDWR | create, mode)
    try:
        os.fchmod(fd, mode)
        os.posix_fallocate(fd, 0, size)
        if header is not None:
            os.pwrite(fd, header, 0)
    except BaseException:
        os.close(fd)
        if create:
            path.unlink(missing_ok=True)
        raise
    os.close(fd)
