"""The filesystem tier: content-addressed files on a directory several nodes may share.

Publishing is atomic (temporary name, optional fsync, rename), so a reader on any node sees
a whole file or none, and two agents writing the same key each publish a complete copy. A
file's modification time is its access record: reads refresh it (at most every
`touchIntervalSeconds`), it survives agent restarts, every agent sharing the mount sees it,
and eviction removes the least recently used files once usage passes the high watermark.
Removing a file another agent is reading is safe: POSIX keeps an open file's data until it
is closed, and every read is verified against the header checksum anyway.

Files that failed verification are moved to `.quarantine/` for inspection: they count as
used space (they fill the volume like any file), are the first to go when the tier is over
its high watermark, and are removed after QUARANTINE_SECONDS. Temporary files of writers
count as used too; those older than STALE_TEMP_SECONDS are left by dead writers and removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvtier.agent.chunk import CHUNK_VERSION, ChunkHeader
from kvtier.agent.tiers.base import HEADER_BYTES, BlobTier, CorruptChunk, TierUsage, namespace_dir
from kvtier.api.config import FilesystemTierConfig
from kvtier.api.pool_layout import PAGE

log = logging.getLogger("kvtier.agent.tiers.filesystem")

QUARANTINE = ".quarantine"
STALE_TEMP_SECONDS = 3600.0
QUARANTINE_SECONDS = 3600.0


def _aligned(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _vectored(
    io: Callable[[int, list[memoryview], int], int],
    fd: int,
    buffers: list[bytes | memoryview],
    offset: int,
) -> int:
    """Run pwritev/preadv until every buffer is done (or EOF on a read): the calls may
    move fewer bytes than asked. Returns the bytes moved."""
    views = [memoryview(b).cast("B") for b in buffers]
    done = 0
    while views:
        n = io(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return done


_local = threading.local()
_File = tuple[float, int, Path]  # modification time, size, path


def _header_page() -> memoryview:
    """A page-aligned (O_DIRECT-safe) header buffer, one per thread, reused."""
    page: memoryview | None = getattr(_local, "page", None)
    if page is None:
        page = _local.page = memoryview(mmap.mmap(-1, HEADER_BYTES))
    return page


def _writer_suffix() -> str:
    """A per-thread unique suffix for temporary names (cheaper than a UUID per write)."""
    suffix: str | None = getattr(_local, "suffix", None)
    if suffix is None:
        suffix = _local.suffix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return suffix


class FilesystemTier(BlobTier[FilesystemTierConfig]):
    kind = "filesystem"
    blob = "file"

    def __init__(self, name: str, config: FilesystemTierConfig) -> None:
        super().__init__(name, config, f"{config.path}/")
        config.path.mkdir(parents=True, exist_ok=True)
        self._objects = 0
        self._next_scan = 0.0
        self._direct = config.direct_io and hasattr(os, "O_DIRECT")
        # The chunks this tier is known to hold (for its KV events): what the last scan
        # found, plus what was written since, less what was removed; chunks written while
        # a scan runs are not taken for gone by that scan.
        self._listed: set[tuple[str, bytes]] = set()
        self._written: set[tuple[str, bytes]] = set()

    # --- reads and writes --------------------------------------------------------------

    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        exists = os.path.exists
        return [exists(self.blob_name(namespace, k)) for k in keys]

    def _held(self, namespace: str, key: bytes) -> None:
        with self._lock:
            self._listed.add((namespace, key))
            self._written.add((namespace, key))
        self.holdings(namespace, [key], False)

    def _gone(self, path: str | Path) -> None:
        chunk = self.chunk_of(str(path))
        if chunk is None:
            return
        with self._lock:
            self._listed.discard(chunk)
            self._written.discard(chunk)
        self.holdings(chunk[0], [chunk[1]], True)

    def namespace_named(self, directory: str) -> str | None:
        """A namespace directory's manifest names its namespace (hashed ones too)."""
        try:
            manifest = json.loads((self.config.path / directory / "manifest.json").read_text())
        except (OSError, ValueError):
            return super().namespace_named(directory)
        named = manifest.get("namespace") if isinstance(manifest, dict) else None
        if isinstance(named, str) and namespace_dir(named) == directory:
            return named
        return super().namespace_named(directory)

    def write(self, header: ChunkHeader, payload: memoryview) -> None:
        path = self.blob_name(header.namespace, header.key)
        self.learn_namespace(header.namespace)
        if os.path.exists(path):
            self._held(header.namespace, header.key)
            return
        parent, name = os.path.split(path)
        tmp = f"{parent}/.tmp-{name}-{_writer_suffix()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC
        try:
            fd = self._open(tmp, flags)
        except FileNotFoundError:
            # First chunk of this fan-out directory, or the tier was removed under us.
            os.makedirs(parent, exist_ok=True)
            self._write_manifest(header.namespace)
            fd = self._open(tmp, flags)
        try:
            if self._direct:
                # O_DIRECT moves whole pages from page-aligned buffers: pool slots are aligned,
                # the header goes through an anonymous (aligned) mapping.
                page = _header_page()
                page[:] = header.page()
                _vectored(os.pwritev, fd, [page, payload[: _aligned(header.length)]], 0)
            else:
                _vectored(os.pwritev, fd, [header.page(), payload[: header.length]], 0)
            if self.config.fsync:
                os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                self._next_scan = 0.0  # the volume is fuller than counted: rescan now
            raise
        os.close(fd)
        os.rename(tmp, path)
        with self._lock:
            self._used += HEADER_BYTES + header.length
            self._objects += 1
        self._held(header.namespace, header.key)

    def read_into(self, namespace: str, key: bytes, out: memoryview) -> ChunkHeader | None:
        path = self.blob_name(namespace, key)
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._gone(path)  # evicted by another agent sharing the volume
            return None
        try:
            try:
                # One read for header and payload; the header lands in an aligned page.
                page = _header_page()
                got = _vectored(os.preadv, fd, [page, out], 0) - HEADER_BYTES
                header = self.checked_read(page, namespace, key, out, lambda _: got)
            except CorruptChunk:
                self._quarantine(Path(path))
                self._gone(path)
                raise
            if time.time() - os.fstat(fd).st_mtime > self.config.touch_interval_seconds:
                with contextlib.suppress(OSError):
                    os.utime(path)
            return header
        finally:
            os.close(fd)

    # --- upkeep ------------------------------------------------------------------------

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.config.capacity, self._used, self._objects)

    def maintain(self) -> int:
        """Rescan when due (other agents write here too), then evict from above the high
        watermark down to the low one: quarantined files first, then the least recently
        used chunks."""
        now = time.monotonic()
        cfg = self.config
        with self._lock:
            over = self._used > cfg.high_watermark * cfg.capacity
        if now < self._next_scan and not over:
            return 0
        self._next_scan = now + cfg.scan_interval_seconds
        with self._lock:
            self._written.clear()
        chunks, quarantined, pending = self._scan()
        self._announce_scan(chunks)
        used = pending + sum(size for _, size, _ in chunks + quarantined)
        evicted = 0
        if used > cfg.high_watermark * cfg.capacity:
            target = cfg.low_watermark * cfg.capacity
            for _mtime, size, path in sorted(quarantined) + sorted(chunks):
                if used <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    if path.parent.name != QUARANTINE:
                        evicted += 1
                        self._gone(path)
                used -= size
        with self._lock:
            self._used, self._objects = used, len(chunks) - evicted
        if evicted:
            log.info("evicted %d files from tier %s", evicted, self.name)
        return evicted

    def _announce_scan(self, chunks: list[_File]) -> None:
        """What a scan found against what the tier was known to hold: files other agents
        wrote are held now, files gone (evicted by other agents, removed by hand) are not;
        a file written while the scan ran is not taken for gone."""
        found: set[tuple[str, bytes]] = set()
        for _mtime, _size, path in chunks:
            chunk = self.chunk_of(str(path))
            if chunk is not None:
                found.add(chunk)
        with self._lock:
            gone = self._listed - found - self._written
            new = found - self._listed
            self._listed = (self._listed | found) - gone
        for removed, items in ((True, gone), (False, new)):
            by_namespace: dict[str, list[bytes]] = {}
            for namespace, key in sorted(items):
                by_namespace.setdefault(namespace, []).append(key)
            for namespace, keys in by_namespace.items():
                self.holdings(namespace, keys, removed)

    def _scan(self) -> tuple[list[_File], list[_File], int]:
        """The chunk files, the quarantined files and the bytes of writers' temporary files;
        removes quarantined and temporary files past their age."""
        chunks: list[_File] = []
        quarantined: list[_File] = []
        pending = 0
        now = time.time()
        for dirpath, _dirnames, filenames in os.walk(self.config.path):
            in_quarantine = os.path.basename(dirpath) == QUARANTINE
            for name in filenames:
                if name == "manifest.json":
                    continue
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                if in_quarantine:
                    if st.st_mtime < now - QUARANTINE_SECONDS:
                        path.unlink(missing_ok=True)
                    else:
                        quarantined.append((st.st_mtime, st.st_size, path))
                elif name.startswith(".tmp-"):
                    if st.st_mtime < now - STALE_TEMP_SECONDS:  # left by a writer that died
                        path.unlink(missing_ok=True)
                    else:
                        pending += st.st_size
                else:
                    chunks.append((st.st_mtime, st.st_size, path))
        return chunks, quarantined, pending

    def _quarantine(self, path: Path) -> None:
        """Move a bad file aside (for inspection) so no agent reads it again."""
        target = self.config.path / QUARANTINE / f"{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            target.parent.mkdir(exist_ok=True)
            os.rename(path, target)
        except OSError:
            path.unlink(missing_ok=True)

    def _write_manifest(self, namespace: str) -> None:
        """A readable description of what a namespace directory holds, for operators.
        Checked on every write (one stat next to a multi-MiB write) because the directory
        may be removed under a running agent."""
        directory = self.config.path / namespace_dir(namespace)
        manifest = directory / "manifest.json"
        if not manifest.exists():
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".tmp-manifest-{uuid.uuid4().hex[:8]}"
            tmp.write_text(
                json.dumps(
                    {
                        "namespace": namespace,
                        "chunkFormatVersion": CHUNK_VERSION,
                        "layout": "<namespace>/<2 hex>/<2 hex>/<key hex>",
                        "headerBytes": HEADER_BYTES,
                    },
                    indent=2,
                )
            )
            os.rename(tmp, manifest)

    def _open(self, path: str, flags: int) -> int:
        if self._direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("tier %s: O_DIRECT not supported here, using buffered I/O", self.name)
                self._direct = False
        return os.open(path, flags, 0o644)
