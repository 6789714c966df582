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
