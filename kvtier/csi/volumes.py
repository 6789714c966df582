"""The node plugin's volumes: per node and tier one size-limited tmpfs (the shared pool and
the agent's socket directory), created on the first publish for that tier, bind-mounted into
each pod of the tier, and freed when the tier is gone and no pod uses it any more.

The tier directory belongs to root and the tier's group, its `pool/` and `run/` to the
agent's uid and the tier's group, setgid and closed to other uids: any uid holding the group
(root, the agent's 65532, OpenShift's random uids) reads the pool and talks to the agent, no
other uid does, and files created inside keep the tier's group. Only the agent makes files in
`pool/`; in `run/` (sticky) each client touches only its own lock file.

Whatever the plugin finds at start is adopted, never cleared: tier tmpfs mounts and bind
mounts from before a restart are the pools of running agents, and a directory kubelet gave
the plugin (a hostPath) is a mount point that cannot be removed or renamed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvtier.csi.mounts import (
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    mount,
    mount_at,
    mounts,
    unmount,
)

log = logging.getLogger("kvtier.csi")
# The volume's root: setgid (what is made inside keeps the tier's group), and not writable
# by the group, or a member could rename pool/ or run/ away and put a directory of its own
# there; only the plugin makes the two.
DIR_MODE = 0o2750
AGENT_UID = 65532  # the agent's runAsUser (the operator's agentUid, the image's USER)
# The agent's poolDir and runDir inside the volume, both the agent's: the tier's group opens
# files in pool/ but cannot create, rename or remove any (so it cannot put a file of its own
# in the pool's place), and in run/ (sticky) makes its lock files and touches only those.
SUBDIRS = {"pool": 0o2750, "run": 0o3770}


@dataclass(frozen=True)
class TierVolume:
    """What a tier's directory must be, read from the KVCacheTier itself (never from the
    pod's volume attributes, which any tenant writes)."""

    name: str  # directory name, unique per namespace and tier
    size_bytes: int
    gid: int


class Volumes:
    def __init__(self, state_dir: Path, target_root: Path, agent_uid: int = AGENT_UID) -> None:
        self.state_dir = state_dir
        self.target_root = target_root
        self.agent_uid = agent_uid
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o711)  # tier directories are reached by exact name only

    def tier_path(self, volume: TierVolume) -> Path:
        return self.state_dir / volume.name

    def ensure(self, volume: TierVolume) -> Path:
        """The tier's tmpfs, mounted once per node; resized when the tier's size changed."""
        path = self.tier_path(volume)
        current = mount_at(path)
        if current is None:
            path.mkdir(mode=0o700, exist_ok=True)
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, _options(volume))
            log.info(
                "tier volume %s created (%d bytes, gid %d)",
                volume.name,
                volume.size_bytes,
                volume.gid,
            )
        elif f"size={volume.size_bytes // 1024}k" not in current.options:
            self._resize(path, volume)
        self._lay_out(path, volume)
        return path

    def _lay_out(self, path: Path, volume: TierVolume) -> None:
        """Owners and modes of the volume's root, pool/ and run/, set again on every publish
        and sweep: a volume an earlier version laid out is brought to this layout without
        waiting for another pod."""
        os.chmod(path, DIR_MODE)
        for sub, mode in SUBDIRS.items():
            sub_path = path / sub
            sub_path.mkdir(exist_ok=True)
            os.chown(sub_path, self.agent_uid, volume.gid)
            os.chmod(sub_path, mode)

    def _resize(self, path: Path, volume: TierVolume) -> None:
        """A remount to the new size keeps the files. The kernel refuses to shrink a tmpfs
        below what its files hold: the pool is shrunk by the agent that restarts with the
        new capacity (in place), so until then the volume keeps its size and a later
        publish or sweep shrinks it."""
        try:
            mount("tmpfs", path, "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, _options(volume))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.info(
                "tier volume %s stays larger than %d bytes until its agent shrinks its pool",
                volume.name,
                volume.size_bytes,
            )
            return
        log.info("tier volume %s resized to %d bytes", volume.name, volume.size_bytes)

    def refresh_live(self, volumes: list[TierVolume]) -> None:
        """Bring mounted tier volumes to their tiers' sizes (a shrink the kernel refused
        earlier goes through once the agent has shrunk its pool) and to this layout."""
        for volume in volumes:
            path = self.tier_path(volume)
            current = mount_at(path)
            if current is None:
                continue
            if f"size={volume.size_bytes // 1024}k" not in current.options:
                self._resize(path, volume)
            self._lay_out(path, volume)

    def check_target(self, target: Path) -> Path:
        """Only paths under kubelet's pods directory are published to or unpublished."""
        resolved = Path(os.path.normpath(target))
        if not resolved.is_absolute() or not resolved.is_relative_to(self.target_root):
            raise ValueError(f"target path {target} is not under {self.target_root}")
        return resolved

    def publish(self, volume: TierVolume, target: Path, readonly: bool) -> None:
        """Idempotent: a target already holding this tier's directory is left as it is."""
        target = self.check_target(target)
        source = self.ensure(volume)
        tier_mount = mount_at(source)
        existing = mount_at(target)
        if existing is not None and tier_mount is not None and existing.device == tier_mount.device:
            return
        if existing is not None:
            raise FileExistsError(f"{target} already holds another volume")
        target.mkdir(parents=True, exist_ok=True)
        mount(str(source), target, None, MS_BIND)
        if readonly:
            mount(str(source), target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)

    def unpublish(self, target: Path) -> None:
        """Idempotent: an unmounted or missing target is a success, as CSI requires."""
        target = self.check_target(target)
        while mount_at(target) is not None:
            unmount(target)
        if target.is_dir():
            target.rmdir()

    def in_use(self, path: Path) -> bool:
        tier_mount = mount_at(path)
        if tier_mount is None:
            return False
        return any(m.device == tier_mount.device and m.point != path for m in mounts())

    def sweep(self, live: set[str]) -> list[str]:
        """Frees the directories of tiers not in `live` that no pod mounts any more;
        returns their names."""
        freed = []
        for path in sorted(self.state_dir.iterdir()):
            if path.name in live or self.in_use(path):
                continue
            if mount_at(path) is not None:
                unmount(path)
            path.rmdir()
            freed.append(path.name)
            log.info("tier volume %s freed", path.name)
        return freed


def _options(volume: TierVolume) -> str:
    return f"size={volume.size_bytes},mode={DIR_MODE:o},uid=0,gid={volume.gid}"


# What earlier agents made in their pool directory: `<tier>.pool`, and beside it its
# staging area, index, lock and half-made `.new` files (`<tier>.pool.<suffix>`).
_LEGACY_FILE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\.pool(\.[a-z]+)*")


def remove_legacy_pools(directory: Path) -> list[str]:
    """Pools that earlier versions left in a node's /dev/shm/kvtier (a hostPath): their files
    removed, since nothing uses that path any more. The directory itself stays: kubelet
    mounts a hostPath into the container, so it is a mount point (removing it fails with
    EBUSY), and the next start finds it empty."""
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        try:
            if entry.is_dir(follow_symlinks=False) or not _LEGACY_FILE.fullmatch(entry.name):
                continue  # not a file an earlier agent made here: not ours to remove
            os.unlink(entry.path)
        except OSError as exc:
            log.warning("cannot remove legacy pool %s: %s", entry.path, exc)
            continue
        removed.append(entry.name)
    return removed
