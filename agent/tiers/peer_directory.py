"""Finding chunks without broadcast: each key has a home among the live agents, and each
agent keeps the share of the cluster-wide index homed on it."""

from __future__ import annotations

import hashlib
import random
import threading
import time


def home_of(key: bytes, members: list[str]) -> str:
    """Rendezvous (highest random weight) hashing: the member with the highest
    hash(member, key) is the key's home."""
    return max(members, key=lambda m: hashlib.blake2b(m.encode() + key, digest_size=8).digest())


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

    def holders(self, namespace: str, keys: list[bytes]) -> list[str]:
        """A live holder per key ("" for none), chosen at random among several, so the
        askers of a popular chunk spread over the nodes that hold it."""
        now = time.monotonic()
        found = []
        with self._lock:
            for key in keys:
                live = [h for h, t in self._holders.get((namespace, key), {}).items() if t > now]
                found.append(random.choice(live) if live else "")
        return found

    def forget(self, holder: str) -> None:
        with self._lock:
            for holders in self._holders.values():
                holders.pop(holder, None)

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
