"""The peer tier's NIXL data path: a chunk is READ by the requester straight from the
holder's pool slot into its own reserved slot, with no copy through either agent's Python.

Both agents register their whole pool (one DRAM region) with NIXL's UCX backend once; the
holder lends a slot (a lease on it, its address and the NIXL agent name) over the ZMQ control
channel, and the requester reads it, verifies the checksum and gives the lease back. NIXL is
optional: without the package (or with `dataPath: zmq`) chunks move over ZMQ.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from kvtier.agent.pool import PoolMap

log = logging.getLogger("kvtier.agent.nixl")


def _load_nixl() -> Any | None:
    """NIXL's Python API, if installed. The cu12 build runs DRAM-to-DRAM over UCX without a
    GPU; its `_api` module is imported directly because the package root imports torch."""
    try:
        return importlib.import_module("nixl_cu12._api")
    except ImportError:
        return None


_nixl = _load_nixl()


def available() -> bool:
    return _nixl is not None


def _connecting(error: Exception) -> bool:
    """NIXL answers NOT_FOUND (when posting or checking a transfer) until the connection to
    a newly added remote agent is set up; progressing the backend moves that along."""
    return "NOT_FOUND" in str(error)


def view_address(view: memoryview) -> int:
    """Address of the first byte of a writable buffer (a slot of the pool)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlPath:
    """One NIXL agent for this kvtier agent, with its pool registered."""

    def __init__(self, name: str, pool: PoolMap) -> None:
        if _nixl is None:  # check_runtime refuses `dataPath: nixl` without NIXL first
            raise RuntimeError("NIXL is not installed")
        os.environ.setdefault("UCX_LOG_LEVEL", "error")
        self.name = name
        # No progress thread: NIXL's spins without pause (a core per agent, all the time).
        # Transfers progress as their state is polled; the rest (connections being set up
        # by peers) as the peer server calls `progress` between requests.
        config = _nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent: Any = _nixl.nixl_agent(name, config)
        self.base = int(pool.array.ctypes.data)
        self.size = int(pool.array.nbytes)
        self._registered = self._agent.register_memory([(self.base, self.size, 0, "")], "DRAM")
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._lock = threading.Lock()
        self._known: set[str] = set()  # remote agents added

    def progress(self) -> None:
        """Let the backend handle what peers sent (connection set-up, notifications)."""
        with self._lock:
            self._agent.get_new_notifs()

    def add_remote(self, metadata: bytes) -> str:
        """Make a remote agent reachable; returns its NIXL name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._known.add(name)
            return name

    def forget(self, remote: str) -> None:
        with self._lock:
            if remote in self._known:
                self._known.discard(remote)
                try:
                    self._agent.remove_remote_agent(remote)
                except Exception as exc:  # already gone from NIXL's view
                    log.debug("removing NIXL agent %s: %s", remote, exc)

    def read(self, remote: str, reads: list[tuple[int, memoryview, int]], timeout: float) -> bool:
        """One transfer READing each (remote address, destination, bytes); False on failure
        or timeout.

        Never returns while the transfer may still write into a destination: one that cannot
        be released in time is waited for, since the destinations go back to the pool."""
        local, far = [], []
        for remote_address, out, nbytes in reads:
            address = view_address(out)
            if not self.base <= address <= self.base + self.size - nbytes:
                raise ValueError("a destination is not inside the registered pool")
            local.append((address, nbytes, 0))
            far.append((remote_address, nbytes, 0))
        deadline = time.monotonic() + timeout
        while True:
            handle, state = self._start(remote, local, far, deadline)
            pause = 0.00002
            try:
                while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                    time.sleep(pause)
                    pause = min(pause * 2, 0.0005)
                    with self._lock:
                        state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                self._release(handle)
                if not _connecting(exc) or time.monotonic() > deadline:
                    raise
                self.progress()
                continue
            self._release(handle)
            return bool(state == "DONE")

    def _release(self, handle: Any) -> None:
        """Release a transfer; one still in flight and not abortable is waited for."""
        while True:
            try:
                with self._lock:
                    self._agent.release_xfer_handle(handle)
                return
            except Exception:
                time.sleep(0.01)
                with self._lock, contextlib.suppress(Exception):
                    self._agent.check_xfer_state(handle)  # which also moves it along

    def _start(
        self,
        remote: str,
        local: list[tuple[int, int, int]],
        far: list[tuple[int, int, int]],
        deadline: float,
    ) -> tuple[Any, str]:
        """The posted transfer's handle and first state, retried until the deadline while
        the connection to the remote agent is still being set up."""
        while True:
            handle = None
            try:
                with self._lock:
                    handle = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(local, "DRAM"),
                        self._agent.get_xfer_descs(far, "DRAM"),
                        remote,
                    )
                    return handle, str(self._agent.transfer(handle))
            except Exception as exc:
                if handle is not None:
                    self._release(handle)
                if not _connecting(exc) or time.monotonic() > deadline:
                    raise
            self.progress()
            time.sleep(0.001)

    def close(self) -> None:
        for remote in list(self._known):
            self.forget(remote)
        with self._lock:
            self._agent.deregister_memory(self._registered)
