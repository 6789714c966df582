"""Mounting for the CSI node plugin through the mount(2) system calls themselves (no mount
command, no shell), and the kernel's own view of what is mounted (/proc/self/mountinfo),
which is the plugin's only state: a restarted plugin finds its tmpfs mounts and bind mounts
as it left them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str, target: Path, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode(),
            str(target).encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def unmount(target: Path) -> None:
    _check(_libc.umount2(str(target).encode(), 0), f"unmount {target}")


@dataclass(frozen=True)
class Mount:
    device: str  # major:minor, shared by a filesystem and every bind mount of it
    root: str  # the directory of the filesystem mounted here
    point: Path
    fstype: str
    options: str  # per-superblock options, e.g. size=... for tmpfs


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return field.encode().decode("unicode_escape")


def mounts() -> list[Mount]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        found.append(
            Mount(
                device=fields[2],
                root=_unescape(fields[3]),
                point=Path(_unescape(fields[4])),
                fstype=tail[0],
                options=tail[2] if len(tail) > 2 else "",
            )
        )
    return found


def mount_at(point: Path) -> Mount | None:
    """The mount whose mount point is exactly `point` (the last one, if stacked)."""
    found = [m for m in mounts() if m.point == point]
    return found[-1] if found else None
