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


class PrefixChains:
    def __init__(self) -> None:
        # per request and KV group: the chunk key seen at each end-token position
        self._chains: dict[str, dict[bytes, dict[int, bytes]]] = {}
        self._lock = threading.Lock()

    def note(self, keys: list[bytes], req_context: Any) -> None:
        position_of = getattr(req_context, "get_offload_key_position", None)
        req_id = getattr(req_context, "req_id", None)
        if position_of is None or req_id is None:
            return
        with self._lock:
            groups = self._chains.setdefault(req_id, {})
            for key in keys:
                position = position_of(key)
                if position is not None:
                    groups.setdefault(key[-4:], {})[position] = key

    def parents(self, keys: list[bytes], req_context: Any) -> list[bytes | None] | None:
        """Each key's predecessor where vLLM recorded an earlier position; None when none
        is known for any key."""
        self.note(keys, req_context)
        position_of = getattr(req_context, "get_offload_key_position", None)
        req_id = getattr(req_context, "req_id", None)
        if position_of is None or req_id is None:
            return None
        parents: list[bytes | None] = []
        with self._lock:
            groups = self._chains.get(req_id, {})
            ordered = {g: sorted(chain) for g, chain in groups.items()}
            for key in keys:
                position = position_of(key)
                known = ordered.get(key[-4:])
                if position is None or not known:
                    parents.append(None)
                    continue
                i = bisect.bisect_left(known, position)
                parents.append(groups[key[-4:]][known[i - 1]] if i else None)
        return parents if any(p is not None for p in parents) else None

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._chains.pop(req_id, None)
