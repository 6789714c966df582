"""The agent's access log: which chunks each request asked for, so a tier can be sized from
its own traffic (`kvtier trace` exports it, `kvtier plan` reads it).

What is kept is the least a replay needs and nothing that reveals a prompt: per request its
arrival time, how many of its chunks the pool held, and its chunk keys as 64-bit ids. The
agent names a key by its index digest (so lookups it answers and lookups clients answer and
report name a key alike); the id is the interpreter's keyed hash of that (SipHash with the
process's random secret), taken when a page is read, not on the lookup path (a 1k-key
lookup kept its digests as 8 KiB of bytes, where hashing them there cost it 200 µs), and
mixed with a salt per namespace keyed by a secret drawn when the agent starts. Equal keys are
equal ids within one agent's log, namespaces (which name models) stay apart and unnamed, and
the export renumbers the ids in order of first appearance, as Mooncake's traces do, so what
leaves the node is only the reuse structure. vLLM's keys are themselves chained hashes of
token ids, never tokens.

Requests are sampled whole, never chunk by chunk: a replay counts a request's hits up to its
first miss, so a request missing half its keys would be a different request. The choice is
made on the id of the request's first chunk (spatial sampling, as in SHARDS): requests
that start with the same chunk are all kept or all dropped, so the reuse among the ones kept
is the real reuse, and a cache of capacity C for the whole traffic behaves like a cache of
rate x C for the sample (`kvtier plan` scales capacities by the rate it reads from the
export). With one system prompt in front of every request, sample at 1 (the default).

The log is bounded by the number of keys it holds; the oldest requests are dropped first and
counted, so an export says how much it lost. Recording a request is O(its keys) and takes
the log's own lock, never the index's: callers are the agent's request loop, for lookups it
answers and for the batched reports of lookups clients answered from the published index
(`record_digests`, keys named by their index digests; `record_request` for keys named
otherwise).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

from kvtier.client import protocol as p

if TYPE_CHECKING:
    from kvtier.shm.table import U64

DEFAULT_MAX_KEYS = 1 << 20  # about 40 MiB at most
PAGE_KEYS = 1 << 16  # keys per page of an export (well under the protocol's message bound)
_SAMPLE_SPACE = 1 << 24
MAX_NAMESPACES = 4096


class DigestIds(Sequence[int]):
    """A request's keys as recorded by `record_digests`: their 8-byte index digests, kept as
    bytes, each read as its id (the interpreter's keyed hash of the 8 bytes, the same id
    `record` gives it) when the log is read."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw) // 8

    def __iter__(self) -> Iterator[int]:
        raw = self._raw
        return map(hash, [raw[i : i + 8] for i in range(0, len(raw), 8)])

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("key index out of range")
        start = 8 * (i % n)
        return hash(self._raw[start : start + 8])


@dataclass(frozen=True)
class Logged:
    """One request in the log. `seq` numbers requests from 1 in arrival order."""

    seq: int
    time: float  # seconds, the clock the request was recorded at
    ids: Sequence[int]  # the keys' 64-bit ids
    hits: int  # keys the pool held when the request was answered
    salt: int = 0  # the namespace's, not yet mixed into `ids`


class AccessLog:
    def __init__(
        self,
        max_keys: int = DEFAULT_MAX_KEYS,
        sample_rate: float = 1.0,
        secret: bytes | None = None,
    ) -> None:
        if max_keys < 1:
            raise ValueError("the access log must hold at least one key")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample rate {sample_rate} is not in (0, 1]")
        self.max_keys = max_keys
        self.sample_rate = sample_rate
        self._threshold = round(sample_rate * _SAMPLE_SPACE)
        self._secret = secret if secret is not None else secrets.token_bytes(16)
        self._salts: dict[str, int] = {}
        self._entries: deque[Logged] = deque()
        self._keys = 0
        self._seq = 0
        self._lock = threading.Lock()
        self.requests_seen = 0
        self.requests_sampled = 0
        self.dropped = 0  # sampled requests pushed out by newer ones

    def _salt(self, namespace: str) -> int:
        salt = self._salts.get(namespace)
        if salt is None:
            if len(self._salts) >= MAX_NAMESPACES:
                self._salts.clear()  # ids stay apart: the salt is the same when recomputed
            h = hashlib.blake2b(namespace.encode(), digest_size=8, key=self._secret)
            salt = self._salts[namespace] = int.from_bytes(h.digest(), "little", signed=True)
        return salt

    def sampled(self, namespace: str, first: bytes | None) -> bool:
        """Whether a request whose first key's id is `first` (None: no keys) is in the
        sample; counts the request as seen. Decided by the first key alone, so a caller can
        leave the other keys' ids uncomputed for a request the log will not keep."""
        self.requests_seen += 1
        if first is None:
            return False
        if self._threshold < _SAMPLE_SPACE:
            salt = self._salt(namespace)
            mixed = hashlib.blake2b((hash(first) ^ salt).to_bytes(8, "little", signed=True))
            if int.from_bytes(mixed.digest()[:4], "little") % _SAMPLE_SPACE >= self._threshold:
                return False
        return True

    def record_request(
        self,
        namespace: str,
        keys: Sequence[bytes],
        hits: Sequence[bool] | int,
        now: float | None = None,
    ) -> bool:
        """Log one request's lookup (its keys in order, and which of them hit, or how many);
        returns whether it was sampled. `now` defaults to the wall clock."""
        if not self.sampled(namespace, keys[0] if keys else None):
            return False
        self.record(namespace, keys, hits, now)
        return True

    def record_digests(self, namespace: str, ds: U64, hits: Sequence[bool]) -> bool:
        """`record_request` for keys named by their index digests, as the agent sees them:
        the ids of the keys after the first are made only for a request the log keeps."""
        raw = ds[: self.max_keys].astype("<u8", copy=False).tobytes()
        if not self.sampled(namespace, raw[:8] or None):
            return False
        self._append(namespace, DigestIds(raw), hits, None)
        return True

    def record(
        self,
        namespace: str,
        keys: Sequence[bytes],
        hits: Sequence[bool] | int,
        now: float | None = None,
    ) -> None:
        """Log a request `sampled` kept."""
        # The interpreter's keyed hash (SipHash) of each key. It never leaves the agent as
        # such: pages mix in the namespace's salt, and exports renumber.
        self._append(namespace, tuple(map(hash, keys[: self.max_keys])), hits, now)

    def _append(
        self, namespace: str, ids: Sequence[int], hits: Sequence[bool] | int, now: float | None
    ) -> None:
        salt = self._salt(namespace)
        count = hits if isinstance(hits, int) else sum(hits)
        when = time.time() if now is None else now
        with self._lock:
            self._seq += 1
            self.requests_sampled += 1
            self._entries.append(Logged(self._seq, when, ids, count, salt))
            self._keys += len(ids)
            while self._keys > self.max_keys and len(self._entries) > 1:
                gone = self._entries.popleft()
                self._keys -= len(gone.ids)
                self.dropped += 1

    def _page(self, after: int, max_keys: int) -> tuple[list[Logged], int, bool]:
        with self._lock:
            out: list[Logged] = []
            total = 0
            for entry in self._entries:
                if entry.seq <= after:
                    continue
                if out and total + len(entry.ids) > max_keys:
                    return out, out[-1].seq, True
                out.append(entry)
                total += len(entry.ids)
            return out, out[-1].seq if out else max(after, 0), False

    def page(self, after: int, max_keys: int = PAGE_KEYS) -> tuple[list[Logged], int, bool]:
        """Requests logged after sequence `after`, oldest first, at most `max_keys` keys in
        all (but at least one request), each key's id mixed with its namespace's salt; the
        sequence to ask after next; whether more wait."""
        raw, next_seq, more = self._page(after, max_keys)
        mixed = [Logged(e.seq, e.time, [h ^ e.salt for h in e.ids], e.hits) for e in raw]
        return mixed, next_seq, more

    def reply(self, after: int) -> p.AccessLogReply:
        """The protocol's answer to `AccessLog(after)`: one page."""
        logged, next_seq, more = self.page(after)
        return p.AccessLogReply(
            [p.LoggedRequest(e.seq, e.time, list(e.ids), e.hits) for e in logged],
            next_seq,
            more,
            self.sample_rate,
            self.dropped,
        )

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "requests": len(self._entries),
                "keys": self._keys,
                "max_keys": self.max_keys,
                "sample_rate": self.sample_rate,
                "requests_seen": self.requests_seen,
                "requests_sampled": self.requests_sampled,
                "dropped": self.dropped,
                "first_seq": self._entries[0].seq if self._entries else 0,
            }


def to_records(
    logged: Sequence[Logged],
    block_size: int,
    ids: dict[int, int] | None = None,
    start: float | None = None,
    extra: dict[str, object] | None = None,
) -> list[dict[str, object]]:
    """Mooncake-format records (`timestamp` ms from `start`, `input_length`, `hash_ids`,
    `block_size`): digests renumbered in order of first appearance through `ids`, which a
    paged export passes from page to page so the numbering stays one."""
    numbering = {} if ids is None else ids
    if start is None:
        start = logged[0].time if logged else 0.0
    records: list[dict[str, object]] = []
    for entry in logged:
        hash_ids = [numbering.setdefault(d, len(numbering)) for d in entry.ids]
        records.append(
            {
                "timestamp": max(0, round((entry.time - start) * 1000)),
                "input_length": len(hash_ids) * block_size,
                "output_length": 0,
                "hash_ids": hash_ids,
                "block_size": block_size,
                "hits": entry.hits,
                **(extra or {}),
            }
        )
    return records
