"""The interface every secondary tier implements.

Tiers are called from the agent's worker threads, never from its request loop, so they may
block on I/O. Every blob a tier holds is a chunk header page followed by the payload; a tier
verifies what it reads against that header and reports a bad blob as CorruptChunk after
removing it, so the caller only counts it and treats it as a miss.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import xxhash

from kvtier.agent.chunk import HEADER_BYTES, ChunkHeader, checksum
from kvtier.api.stats import TierStats


class CorruptChunk(Exception):
    """A blob failed verification (header, key or checksum); it has been removed."""


@dataclass(frozen=True)
class TierUsage:
    capacity_bytes: int
    used_bytes: int
    objects: int


_SAFE_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASHED_NAMESPACE = re.compile(r"^ns-[0-9a-f]{32}$")


def namespace_dir(namespace: str) -> str:
    """A path segment for a namespace: itself when already safe, else a stable hash."""
    if _SAFE_NAMESPACE.match(namespace):
        return namespace
    return "ns-" + xxhash.xxh3_128_hexdigest(namespace.encode())


def blob_path(namespace: str, key: bytes) -> str:
    """`<namespace>/<2 hex>/<2 hex>/<key hex>`: the same relative layout on every tier, with
    two levels of fan-out so no directory grows past a few thousand entries per million keys."""
    hexkey = key.hex()
    return f"{namespace_dir(namespace)}/{hexkey[:2]}/{hexkey[2:4]}/{hexkey}"


def check_blob(
    header_page: bytes | memoryview, namespace: str, key: bytes, room: int
) -> ChunkHeader:
    """Parse and check a blob's header against what was asked for; raises CorruptChunk."""
    header = ChunkHeader.unpack(header_page)
    if header is None or header.namespace != namespace or header.key != key:
        raise CorruptChunk("header does not describe the requested chunk")
    if header.length > room:
        raise CorruptChunk(f"chunk of {header.length} bytes does not fit a {room}-byte slot")
    return header


def check_payload(header: ChunkHeader, payload: memoryview) -> None:
    if checksum(payload[: header.length]) != header.checksum:
        raise CorruptChunk("checksum mismatch")


Holdings = Callable[[str, list[bytes], bool], None]  # (namespace, keys, removed)


def _ignore(_namespace: str, _keys: list[bytes], _removed: bool) -> None:
    return None


class SecondaryTier(ABC):
    kind: str

    def __init__(self, name: str) -> None:
        self.name = name
        # Told every chunk this tier comes to hold or stops holding, for any reason (a
        # write, a listing or scan finding what other agents wrote; an eviction, a
        # quarantine, a chunk found gone): the node's KV events (events.NodeEvents).
        self.holdings: Holdings = _ignore

    def report_holdings(self, holdings: Holdings) -> None:
        self.holdings = holdings

    @abstractmethod
    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys this tier holds, asked as one batch."""

    @abstractmethod
    def write(self, header: ChunkHeader, payload: memoryview) -> None:
        """Publish a chunk atomically; raises OSError (or the backend's error) on failure."""

    @abstractmethod
    def read_into(self, namespace: str, key: bytes, out: memoryview) -> ChunkHeader | None:
        """Read a chunk's payload into `out` and verify it; None when absent."""

    reads_in_batches = False  # whether read_many beats one read_into per key in parallel
    # Seconds within which `exists` always returns, where it bounds itself (a call over the
    # network with a timeout of its own); None for a call that may block longer.
    exists_seconds: float | None = None

    def read_many(
        self, namespace: str, keys: list[bytes], outs: list[memoryview]
    ) -> list[ChunkHeader | CorruptChunk | None]:
        """Several chunks at once: per key its header, the CorruptChunk it failed with, or
        None when absent. Tiers that gain from batching override it."""
        results: list[ChunkHeader | CorruptChunk | None] = []
        for key, out in zip(keys, outs, strict=True):
            try:
                results.append(self.read_into(namespace, key, out))
            except CorruptChunk as exc:
                results.append(exc)
        return results

    def probe(self) -> bool:
        """A cheap request that raises when the tier cannot be reached (True otherwise):
        the agent asks it of a tier marked unhealthy, bypassing any cache, to learn when it
        works again."""
        self.exists("kvtier-probe", [b"probe"])
        return True

    @abstractmethod
    def usage(self) -> TierUsage: ...

    @abstractmethod
    def maintain(self) -> int:
        """Periodic upkeep (rescans, eviction to the watermarks); returns chunks evicted."""

    def peers(self) -> list[str]:
        """The other agents this tier works with (their endpoints, as last read), for the
        agent's stats; a tier that works with none has none."""
        return []

    def ask_source(self, source: str, namespace: str, keys: list[bytes]) -> None:
        """A request named `source`, another agent, as holding `keys`: a tier that can read
        from other agents remembers it as their holder; the others ignore it."""
        return None

    def stats(self, common: TierStats) -> TierStats:
        """This tier's stats: `common`, what the chain reports of every tier, with what this
        kind of tier adds (most add nothing)."""
        return common

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release clients and threads."""


class BlobConfig(Protocol):
    capacity: int


C = TypeVar("C", bound=BlobConfig)


class BlobTier(SecondaryTier, Generic[C]):
    """A tier that keeps each chunk as one blob, its header page then its payload, named
    `blob_path` under a root (a directory, a bucket's prefix), and counts the bytes it
    holds against its configured capacity. `_lock` guards what subclasses count."""

    blob = "blob"  # what one is called in errors: "file", "object"

    def __init__(self, name: str, config: C, root: str) -> None:
        super().__init__(name)
        self.config = config
        self._root = root
        self._lock = threading.Lock()
        self._used = 0
        self._namespaces: dict[str, str] = {}  # namespace_dir -> namespace, as seen

    def blob_name(self, namespace: str, key: bytes) -> str:
        # A plain string: pathlib costs several microseconds per operation on a hot path.
        return self._root + blob_path(namespace, key)

    def learn_namespace(self, namespace: str) -> None:
        self._namespaces.setdefault(namespace_dir(namespace), namespace)

    def chunk_of(self, name: str) -> tuple[str, bytes] | None:
        """The (namespace, key) a blob name (`blob_name`'s form) holds; None for anything
        else, or for a hashed namespace directory this tier has not seen named."""
        parts = name[len(self._root) :].split("/") if name.startswith(self._root) else []
        if len(parts) != 4 or parts[1] != parts[3][:2] or parts[2] != parts[3][2:4]:
            return None
        try:
            key = bytes.fromhex(parts[3])
        except ValueError:
            return None
        namespace = self._namespaces.get(parts[0])
        if namespace is None:
            namespace = self.namespace_named(parts[0])
            if namespace is None:
                return None
            self._namespaces[parts[0]] = namespace
        return namespace, key

    def namespace_named(self, directory: str) -> str | None:
        """The namespace a directory not yet seen holds: itself where `namespace_dir` keeps
        it as it is; tiers that keep a manifest read it."""
        if _HASHED_NAMESPACE.match(directory):
            return None  # namespace_dir's hash of a namespace never seen here
        return directory if namespace_dir(directory) == directory else None

    def checked_read(
        self,
        header_page: bytes | memoryview,
        namespace: str,
        key: bytes,
        out: memoryview,
        read_payload: Callable[[ChunkHeader], int],
    ) -> ChunkHeader:
        """A blob read back into `out`: its header checked against what was asked for,
        then its payload, which `read_payload` puts in `out` (returning the bytes it got),
        checked for length and checksum. Raises CorruptChunk."""
        header = check_blob(header_page, namespace, key, len(out))
        if read_payload(header) < header.length:
            raise CorruptChunk(f"{self.blob} is shorter than its header says")
        check_payload(header, out)
        return header


__all__ = [
    "HEADER_BYTES",
    "BlobTier",
    "CorruptChunk",
    "Holdings",
    "SecondaryTier",
    "TierUsage",
    "blob_path",
    "check_blob",
    "check_payload",
    "namespace_dir",
]
