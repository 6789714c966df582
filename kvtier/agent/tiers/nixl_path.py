"""The peer tier's NIXL data path: a chunk is READ by the requester straight from the
holder's pool slot into its own reserved slot, with no copy through either agent's Python.

Each agent registers its whole pool with NIXL's UCX backend once, as the destination of its
own reads, but never hands that registration to anyone: the metadata a member gets (over the
authenticated control channel) carries only how to connect. The holder lends slots per
transfer: it leases them, registers exactly the lent bytes and sends that registration's
metadata with the loan, and deregisters them when the loan is returned or expires; NIXL
refuses a READ of anything else. Registering costs about 0.1 ms per loan (measured here with
2 MiB slots), less than the transfer of one chunk. The requester reads the lent slots into
its own reserved slots, verifies the checksums and gives the lease back. NIXL is optional:
without the package (or with `dataPath: zmq`) chunks move over ZMQ.

How far a returned loan is revoked depends on the transport: RDMA invalidates the keys of
deregistered memory, UCX's TCP transport does not check them, so over TCP a requester that
bypasses NIXL could re-read a slot lent to it earlier. Over TCP the channel between agents
is not encrypted either: run the peer port on a network only the tier's nodes reach.
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

from kvtier.shm.pool import PoolMap

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
        # How to connect, and no registered memory: what members are given.
        nothing = _nixl.nixlBind.nixlRegDList(self._agent.nixl_mems["DRAM"], [])
        self.metadata: bytes = self._agent.get_partial_agent_metadata(nothing, True, ["UCX"])
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

    def lend(self, regions: list[tuple[int, int]]) -> tuple[Any, bytes]:
        """Register exactly these (address, bytes) of the pool for one loan: the handle to
        `unlend` with, and the metadata the requester loads to read them."""
        with self._lock:
            handle = self._agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
            sections = self._agent.get_partial_agent_metadata(handle, False, ["UCX"])
        return handle, bytes(sections)

    def unlend(self, handle: Any) -> None:
        with self._lock:
            self._agent.deregister_memory(handle)

    def load_sections(self, sections: bytes) -> None:
        """Make a loan's registered slots readable from here."""
        with self._lock:
            self._agent.add_remote_agent(sections)

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
                    pause = min(pause * 2, 0.0001)  # progressing is what moves TCP data
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
