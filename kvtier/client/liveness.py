"""Knowing when a client process is gone, across PID namespaces.

A vLLM pod's processes are invisible to the agent's PID namespace, so PIDs cannot tell
whether a client lives. Instead each client holds an exclusive flock on a file in the
agent's run directory (a directory both sides mount); the kernel drops the lock when the
process dies, however it dies, and the agent sees the lock as takeable.

Lock files outlive agent restarts: the agent also sweeps the directory for locks no process
holds (a client that died while no agent ran, or that never said hello to this agent), so
they never accumulate.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("kvtier.client.liveness")

# A lock file younger than this is never swept: its client may be between creating the file
# and taking the lock.
SWEEP_AFTER_SECONDS = 5.0


class ClientLock:
    """Held by a client for its lifetime. Group-readable, so an agent running as another
    uid with the tier's group can test it."""

    def __init__(self, directory: Path, client_id: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{client_id}.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o660)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(self._fd)
            raise

    def release(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def holder_alive(path: Path) -> bool | None:
    """Whether a live process still holds the flock on `path`; None when the agent may not
    open it (it then cannot tell, and keeps the client).

    A missing file counts as gone: a client that closed cleanly removed it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


class ClientRegistry:
    """The clients that said hello, and their lock files."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        # Made by the agent, open to the whole tier group: were the first client to make it,
        # its umask (vLLM's 022) would close it to every other uid of the group.
        lock_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(lock_dir, 0o3770)  # sticky: a client removes only its own lock
        except PermissionError:
            log.warning("cannot open %s to the tier's group: it belongs to another uid", lock_dir)
        self._locks: dict[str, Path] = {}
        self._unreadable: set[Path] = set()

    def register(self, client: str, lock_name: str) -> None:
        """Remember a client by its lock file; refuses (ValueError) a lock that is not a
        file of the lock directory held by a live process."""
        path = self.lock_dir / lock_name
        if path.parent != self.lock_dir or lock_name in {".", ".."}:
            raise ValueError(f"lock {lock_name!r} must be a file name inside {self.lock_dir}")
        if holder_alive(path) is False:
            raise ValueError(f"lock {lock_name!r} is not held by a live process; hold it first")
        self._locks[client] = path

    def gone(self) -> list[str]:
        """Registered clients whose process has died; they are forgotten and their lock
        files removed."""
        dead = [c for c, path in self._locks.items() if holder_alive(path) is False]
        for client in dead:
            self._locks.pop(client).unlink(missing_ok=True)
        return dead

    def sweep(self) -> int:
        """Remove lock files of the directory that no process holds and no registered
        client owns; returns how many went."""
        registered = set(self._locks.values())
        stale = time.time() - SWEEP_AFTER_SECONDS
        removed = 0
        try:
            entries = list(os.scandir(self.lock_dir))
        except OSError:
            return 0
        for entry in entries:
            path = Path(entry.path)
            if not entry.name.endswith(".lock") or path in registered:
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime > stale:
                    continue
            except OSError:
                continue
            alive = holder_alive(path)
            if alive is None and path not in self._unreadable:
                self._unreadable.add(path)
                log.warning("cannot open client lock %s to test it; give it the tier's group", path)
            if alive is False:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def __contains__(self, client: str) -> bool:
        return client in self._locks

    def __len__(self) -> int:
        return len(self._locks)
