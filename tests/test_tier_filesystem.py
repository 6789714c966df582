"""The filesystem tier on real directories: layout, atomic publish, verification,
watermark eviction by access time, and the faults that must become misses."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.agent.chunk import ChunkHeader, checksum
from kvtier.agent.tiers.base import CorruptChunk, blob_path
from kvtier.agent.tiers.filesystem import QUARANTINE, FilesystemTier
from kvtier.api.config import FilesystemTierConfig
from tests.helpers import NS, key, row

ROW = 16 * 1024


def make_tier(path: Path, **kw: object) -> FilesystemTier:
    return FilesystemTier("fs", FilesystemTierConfig.model_validate({"path": path, **kw}))


def file_of(root: Path, i: int) -> Path:
    """Where the tier keeps chunk `i` of NS: the layout every tier shares (`blob_path`)."""
    return root / blob_path(NS, key(i))


def put(tier: FilesystemTier, i: int, nbytes: int = ROW) -> None:
    data = row(i, nbytes)
    tier.write(ChunkHeader(NS, key(i), nbytes, checksum(data.data)), data.data)


def get(tier: FilesystemTier, i: int, nbytes: int = ROW) -> np.ndarray | None:
    out = np.zeros(nbytes, np.uint8)
    return out if tier.read_into(NS, key(i), out.data) is not None else None


def test_roundtrip_layout_and_manifest(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity="1Mi")
    put(tier, 7)
    hexkey = key(7).hex()
    path = tmp_path / NS / hexkey[:2] / hexkey[2:4] / hexkey
    assert path.is_file() and path.stat().st_size == 4096 + ROW
    manifest = json.loads((tmp_path / NS / "manifest.json").read_text())
    assert manifest["namespace"] == NS and manifest["chunkFormatVersion"] == 1
    out = get(tier, 7)
    assert out is not None and np.array_equal(out, row(7, ROW))
    assert get(tier, 8) is None
    assert tier.exists(NS, [key(7), key(8)]) == [True, False]
    assert not list(tmp_path.rglob(".tmp-*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong-key", "garbage-header"])
def test_bad_files_are_corrupt_and_quarantined(tmp_path: Path, damage: str) -> None:
    tier = make_tier(tmp_path, capacity="1Mi")
    put(tier, 1)
    put(tier, 2)
    path = file_of(tmp_path, 1)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[4096 + 100] ^= 0x01
    elif damage == "truncate":
        raw = raw[: 4096 + ROW // 2]
    elif damage == "wrong-key":
        raw = bytearray(file_of(tmp_path, 2).read_bytes())
    else:
        raw[:16] = b"\xff" * 16
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunk):
        get(tier, 1)
    assert not path.exists()
    assert len(list((tmp_path / QUARANTINE).iterdir())) == 1
    assert get(tier, 1) is None  # afterwards a plain miss
    assert get(tier, 2) is not None


def _write_same_key(root: str, start: mp.synchronize.Event) -> None:
    tier = make_tier(Path(root), capacity="64Mi", fsync=False)
    start.wait()
    for _ in range(30):
        put(tier, 5, 256 * 1024)
        file_of(Path(root), 5).unlink(missing_ok=True)  # force the next publish
    put(tier, 5, 256 * 1024)


def test_concurrent_writers_and_readers_never_see_a_torn_file(tmp_path: Path) -> None:
    """Two processes publish the same key over and over while this one reads it."""
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    writers = [ctx.Process(target=_write_same_key, args=(str(tmp_path), start)) for _ in range(2)]
    for w in writers:
        w.start()
    tier = make_tier(tmp_path, capacity="64Mi")
    start.set()
    while any(w.is_alive() for w in writers):
        out = get(tier, 5, 256 * 1024)  # raises CorruptChunk on a torn read
        if out is not None:
            assert np.array_equal(out, row(5, 256 * 1024))
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert get(tier, 5, 256 * 1024) is not None
    assert not list(tmp_path.rglob(".tmp-*"))


def test_eviction_by_watermarks_oldest_access_first(tmp_path: Path) -> None:
    blob = 4096 + ROW
    tier = make_tier(
        tmp_path,
        capacity=10 * blob,
        highWatermark=0.9,
        lowWatermark=0.5,
        scanIntervalSeconds=3600,
        touchIntervalSeconds=0,
    )
    for i in range(9):
        put(tier, i)
        os.utime(file_of(tmp_path, i), (1000 + i, 1000 + i))
    assert tier.maintain() == 0  # 9 of 10: not above the high watermark
    get(tier, 0)  # a read refreshes the access record of the oldest file
    put(tier, 9)
    assert tier.usage().used_bytes == 10 * blob
    evicted = tier.maintain()
    assert evicted == 5 and tier.usage().used_bytes == 5 * blob
    survivors = [i for i in range(10) if tier.exists(NS, [key(i)])[0]]
    assert survivors == [0, 6, 7, 8, 9]


def test_usage_rebuilt_by_scanning_after_restart(tmp_path: Path) -> None:
    first = make_tier(tmp_path, capacity="1Mi")
    for i in range(4):
        put(first, i)
    (tmp_path / NS / "aa").mkdir()
    stale = tmp_path / NS / "aa" / ".tmp-dead-writer"
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    restarted = make_tier(tmp_path, capacity="1Mi")
    assert restarted.usage().objects == 0
    restarted.maintain()
    assert restarted.usage().objects == 4
    assert restarted.usage().used_bytes == 4 * (4096 + ROW)
    assert not stale.exists()


def test_directory_deleted_under_a_running_tier(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tier = make_tier(root, capacity="1Mi")
    put(tier, 1)
    shutil.rmtree(root)
    assert get(tier, 1) is None
    put(tier, 2)  # recreates what it needs
    assert get(tier, 2) is not None


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB tmpfs, so the disk really fills up (needs root, as in CI)."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_fails_the_write_and_leaves_nothing(small_mount: Path) -> None:
    tier = make_tier(small_mount, capacity="1Gi", fsync=False)
    written = 0
    with pytest.raises(OSError) as info:
        for i in range(100):
            put(tier, i, 64 * 1024)
            written += 1
    assert info.value.errno == errno.ENOSPC
    assert 0 < written < 100
    assert not list(small_mount.rglob(".tmp-*"))
    assert get(tier, 0, 64 * 1024) is not None  # what was published stays readable


def test_read_only_filesystem_refuses_writes(small_mount: Path) -> None:
    tier = make_tier(small_mount, capacity="1Gi")
    put(tier, 1)
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    with pytest.raises(OSError) as info:
        put(tier, 2)
    assert info.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    assert get(tier, 1) is not None
