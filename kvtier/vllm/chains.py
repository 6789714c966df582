"""Each stored chunk's predecessor in its request, for the agent's prefix-aware eviction.

A chained block hash does not reveal its parent, but vLLM knows each offload key's end-token
position in its request: the key of the same request and KV group at the nearest earlier
position is the parent.

Threading: vLLM's scheduler thread notes positions while copy threads ask for parents; one
lock guards the per-request maps.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any


class _Chain:
    """One request's chunk keys of one KV group, by end-token position, positions sorted."""

    def __init__(self) -> None:
        self.keys: dict[int, bytes] = {}
        self.positions: list[int] = []

    def add(self, position: int, key: bytes) -> None:
        if position not in self.keys:
            bisect.insort(self.positions, position)
        self.keys[position] = key

    def before(self, position: int) -> bytes | None:
        i = bisect.bisect_left(self.positions, position)
        return self.keys[self.positions[i - 1]] if i else None


class PrefixChains:
    def __init__(self) -> None:
        self._chains: dict[str, dict[bytes, _Chain]] = {}  # per request and KV group
        self._lock = threading.Lock()

    def _positions(self, keys: list[bytes], req_context: Any) -> list[int | None] | None:
        position_of = getattr(req_context, "get_offload_key_position", None)
        if position_of is None or getattr(req_context, "req_id", None) is None:
            return None
        return [position_of(key) for key in keys]

    def note(self, keys: list[bytes], req_context: Any) -> None:
        positions = self._positions(keys, req_context)
        if positions is not None:
            with self._lock:
                self._note(req_context.req_id, keys, positions)

    def _note(self, req_id: str, keys: list[bytes], positions: list[int | None]) -> None:
        groups = self._chains.setdefault(req_id, {})
        for key, position in zip(keys, positions, strict=True):
            if position is not None:
                groups.setdefault(key[-4:], _Chain()).add(position, key)

    def parents(self, keys: list[bytes], req_context: Any) -> list[bytes | None] | None:
        """Each key's predecessor where vLLM recorded an earlier position; None when none
        is known for any key. The keys are noted too, in the same pass."""
        positions = self._positions(keys, req_context)
        if positions is None:
            return None
        with self._lock:
            self._note(req_context.req_id, keys, positions)
            groups = self._chains[req_context.req_id]
            parents = [
                groups[key[-4:]].before(position) if position is not None else None
                for key, position in zip(keys, positions, strict=True)
            ]
        return parents if any(p is not None for p in parents) else None

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._chains.pop(req_id, None)
