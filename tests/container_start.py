"""A container's start, as a runtime does it: run as root in a mount namespace of its own
(`unshare --mount --propagation unchanged`), it mounts the root filesystem and the
container's bind mounts, changes root, drops to the container's identity and executes the
container's command. Read by tests/kubelet.py, which writes the spec (JSON) it is given.

Its own mount namespace is what lets a container stop without taking anything with it: the
namespace's mounts go with its last process, and nothing of that propagates back, exactly
as when containerd stops a container (a Bidirectional mount's submounts made *inside* the
container still reach the node, as they do on a real one). Standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from pathlib import Path

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
MS_PRIVATE, MS_SHARED = 1 << 18, 1 << 20
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _mount(source: str, target: Path, fstype: str | None, flags: int, data: str = "") -> None:
    result = _libc.mount(
        source.encode(),
        str(target).encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _target(rootfs: Path, source: Path, inside: str) -> Path:
    target = rootfs / inside.lstrip("/")
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    return target


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rootfs = Path(spec["rootfs"])
    _mount("tmpfs", rootfs, "tmpfs", 0, "mode=0755,size=64m")
    for link, to in spec["links"].items():
        (rootfs / link).symlink_to(to)
    (rootfs / "etc").mkdir(exist_ok=True)
    for name in spec["etc"]:
        shutil.copy(Path("/etc", name), rootfs / "etc" / name)
    (rootfs / "tmp").mkdir(mode=0o1777)
    (rootfs / "tmp").chmod(0o1777)
    readonly = []
    # Parents before children: a mount inside another volume (a Secret below the config
    # directory) gets its mount point made in that volume, as runc makes it.
    for bind in sorted(spec["binds"], key=lambda b: b["inside"].count("/")):
        source = Path(bind["source"])
        target = _target(rootfs, source, bind["inside"])
        _mount(str(source), target, None, MS_BIND | MS_REC)
        if not bind.get("shared"):
            _mount("none", target, None, MS_REC | MS_PRIVATE)
        if bind.get("readOnly"):
            readonly.append(target)
    for target in readonly:
        _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    if spec["readOnlyRootFilesystem"]:
        _mount("none", rootfs, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.chroot(rootfs)
    os.chdir("/")
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    os.umask(0o022)
    argv, env = spec["argv"], spec["env"]
    program = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
    os.execve(program, argv, env)


if __name__ == "__main__":
    main(sys.argv[1])
