"""Finding chunks without broadcast: each key has a home among the live agents, and each
agent keeps the share of the cluster-wide index homed on it."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection

import numpy as np
import numpy.typing as npt
from xxhash import xxh3_64_intdigest

U64 = npt.NDArray[np.uint64]


def _mix(z: U64) -> U64:
    """splitmix64's finalizer, on uint64 arrays (wrapping multiplication)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: U64 = z ^ (z >> np.uint64(31))
    return mixed


def homes(keys: list[bytes], members: list[str]) -> npt.NDArray[np.intp]:
    """Rendezvous (highest random weight) hashing: per key, the position in `members` of the
    one with the highest weight(member, key). A weight mixes a 64-bit digest of the key with
    one of the member, so a batch is one digest per key and a few array operations (a
    thousand keys in well under a millisecond), not a hash per key and member."""
    digests = np.fromiter(map(xxh3_64_intdigest, keys), np.uint64, len(keys))
    seeds = np.fromiter((xxh3_64_intdigest(m.encode()) for m in members), np.uint64)
    with np.errstate(over="ignore"):
        weights = _mix(digests[:, None] ^ seeds[None, :])
    return np.asarray(weights.argmax(axis=1))


def by_home(keys: list[bytes], members: list[str]) -> dict[str, list[int]]:
    """Positions in `keys`, in order, grouped by each key's home among `members` (homes
    without keys left out). Grouped by array operations: a loop over a thousand keys cost
    100 µs of a lookup."""
    home_of = homes(keys, members)
    order = np.argsort(home_of, kind="stable")
    counts = np.bincount(home_of, minlength=len(members)).tolist()
    groups = np.split(order, np.cumsum(counts[:-1]))
    return {members[m]: group.tolist() for m, group in enumerate(groups) if counts[m]}


class Directory:
    """This agent's share of the cluster-wide index: who holds the keys homed here."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._holders: dict[tuple[str, bytes], dict[str, float]] = {}

    def announce(self, namespace: str, keys: list[bytes], holder: str) -> None:
        expiry = time.monotonic() + self.ttl
        with self._lock:
            for key in keys:
                self._holders.setdefault((namespace, key), {})[holder] = expiry

    def withdraw(self, namespace: str, keys: list[bytes], holder: str) -> None:
        with self._lock:
            for key in keys:
                holders = self._holders.get((namespace, key))
                if holders is not None:
                    holders.pop(holder, None)
                    if not holders:
                        del self._holders[(namespace, key)]

    def holders(
        self, namespace: str, keys: list[bytes], members: Collection[str] | None = None
    ) -> list[str]:
        """A holder per key ("" for none) whose announcement has not expired and, given
        `members`, that is among them (an agent gone stale is never reported, even before
        its entries are dropped), chosen at random among several, so the askers of a
        popular chunk spread over the nodes that hold it."""
        now = time.monotonic()
        found = []
        with self._lock:
            get = self._holders.get
            for key in keys:
                entry = get((namespace, key))
                if not entry:  # most keys asked about, in a cold cache
                    found.append("")
                    continue
                live = [
                    h for h, t in entry.items() if t > now and (members is None or h in members)
                ]
                found.append(random.choice(live) if live else "")
        return found

    def forget(self, holder: str) -> None:
        self.retain(lambda h: h != holder)

    def retain(self, keep: Callable[[str], bool]) -> int:
        """Drop every entry of the holders `keep` rejects (agents no longer members);
        returns how many keys lost their last holder."""
        with self._lock:
            emptied = []
            for chunk, holders in self._holders.items():
                for holder in [h for h in holders if not keep(h)]:
                    del holders[holder]
                if not holders:
                    emptied.append(chunk)
            for chunk in emptied:
                del self._holders[chunk]
        return len(emptied)

    def __len__(self) -> int:
        with self._lock:
            return len(self._holders)

    def expire(self) -> int:
        """Drop the entries no live announcement backs; returns how many keys went."""
        now = time.monotonic()
        with self._lock:
            gone = [
                chunk
                for chunk, holders in self._holders.items()
                if all(t <= now for t in holders.values())
            ]
            for chunk in gone:
                del self._holders[chunk]
        return len(gone)
