"""Knowing when a client process is gone, across PID namespaces.

A vLLM pod's processes are invisible to the agent's PID namespace, so PIDs cannot tell
whether a client lives. Instead each client holds an exclusive flock on a file in the
agent's run directory (a hostPath both sides mount); the kernel drops the lock when the
process dies, however it dies, and the agent sees the lock as takeable.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class ClientLock:
    """Held by a client for its lifetime."""

    def __init__(self, directory: Path, client_id: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{client_id}.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def holder_alive(path: Path) -> bool:
    """Whether a live process still holds the flock on `path`.

    A missing file counts as gone: a client that closed cleanly removed it.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class ClientRegistry:
    """The clients that said hello, and their lock files."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self._locks: dict[str, Path] = {}

    def register(self, client: str, lock_name: str) -> None:
        path = (self.lock_dir / lock_name).resolve()
        if path.parent != self.lock_dir.resolve():
            raise ValueError(f"lock {lock_name!r} must be a file name inside {self.lock_dir}")
        self._locks[client] = path

    def gone(self) -> list[str]:
        """Registered clients whose process has died; they are forgotten and their lock
        files removed."""
        dead = [c for c, path in self._locks.items() if not holder_alive(path)]
        for client in dead:
            self._locks.pop(client).unlink(missing_ok=True)
        return dead

    def __len__(self) -> int:
        return len(self._locks)
