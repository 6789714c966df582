"""Connections to the other agents of a peer tier: a request/reply channel per peer socket
(authenticated with the tier's CURVE keys), requests to several peers at once, and the few
connections kept per peer, closed when idle or when the peer goes.

Threading: a `Connection` serves one request at a time under its lock and may be shared by
threads; `Connections` guards its pools with a lock of its own, never held during a request.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import msgspec
import zmq

from kvtier.agent.tiers.peer.stream import StreamChannel
from kvtier.agent.tiers.peer.wire import (
    RID,
    Answer,
    Fetch,
    KeyRing,
    context,
    decode_statuses,
    encode,
    secure_client,
)

CONNECTIONS_PER_PEER = 4


class Connection:
    """A request/reply channel to one peer, shared by threads (one request at a time)."""

    def __init__(
        self, endpoint: str, keys: KeyRing | None, server_key: bytes, timeout: float
    ) -> None:
        self.endpoint = endpoint
        self._keys = keys
        self.server_key = server_key
        self._timeout_ms = int(timeout * 1000)
        self.lock = threading.Lock()  # one request at a time
        self._rids = itertools.count(1)
        self._sock: zmq.Socket[bytes] | None = None
        self._stream = StreamChannel(urlsplit(endpoint).hostname or "", timeout)
        self.used = time.monotonic()

    def next_rid(self) -> int:
        return next(self._rids)

    @property
    def open(self) -> bool:
        return self._sock is not None

    def close_if_idle(self, unused_since: float) -> bool:
        """Close the socket when it was last used before `unused_since` (and is not in use
        now): an idle peer costs neither side a connection. It reopens on next use."""
        if self._sock is None or self.used > unused_since or not self.lock.acquire(blocking=False):
            return False
        try:
            if self._sock is None or self.used > unused_since:
                return False
            self.drop()
            return True
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            if self._sock is not None:
                self.drop()

    def socket(self) -> zmq.Socket[bytes]:
        self.used = time.monotonic()
        if self._sock is None:
            sock: zmq.Socket[bytes] = context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self._keys, self.server_key)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def send(self, message: msgspec.Struct) -> None:
        with self.lock, contextlib.suppress(zmq.Again):
            self.socket().send_multipart([b"\0" * 8, encode(message)], flags=zmq.NOBLOCK)

    def call(self, message: msgspec.Struct) -> list[memoryview] | None:
        """Frames of the reply after the request id, as received (not copied); None when
        the peer did not answer."""
        with self.lock:
            sock = self.socket()
            rid = RID.pack(next(self._rids))
            sock.send_multipart([rid, encode(message)])
            while sock.poll(self._timeout_ms):
                frames = sock.recv_multipart(copy=False)
                if frames[0].bytes == rid:
                    return [frame.buffer for frame in frames[1:]]
            self.drop()
            return None

    def fetch_into(
        self, fetch: Fetch, outs: list[memoryview]
    ) -> tuple[list[str], list[bytes]] | None:
        """A fetch whose payload frames are received straight into `outs` (slots reserved
        in this agent's pool): the per-key statuses and the packed headers of the chunks
        sent; None when the peer did not answer."""
        with self.lock:
            sock = self.socket()
            rid = RID.pack(next(self._rids))
            sock.send_multipart([rid, encode(fetch)])
            while sock.poll(self._timeout_ms):
                if sock.recv() != rid:  # a late reply to an abandoned request
                    while sock.rcvmore:
                        sock.recv()
                    continue
                statuses = decode_statuses(sock.recv())
                pages = []
                for status, out in zip(statuses, outs, strict=True):
                    if status == Answer.SENT:
                        pages.append(sock.recv())
                        sock.recv_into(out)  # a longer frame is cut: its checksum fails
                while sock.rcvmore:
                    sock.recv()
                return statuses, pages
            self.drop()
            return None

    @contextlib.contextmanager
    def stream(self) -> Iterator[StreamChannel]:
        """This connection's stream to the peer, held under its lock while used."""
        with self.lock:
            self.used = time.monotonic()
            yield self._stream

    def drop(self) -> None:
        """Close the sockets, so whatever arrives late is dropped with them."""
        assert self._sock is not None
        self._sock.close(linger=0)
        self._sock = None
        self._stream.close()


def call_all(
    calls: list[tuple[Connection, msgspec.Struct]],
    timeout: float,
    meanwhile: Callable[[], object] | None = None,
) -> list[list[memoryview] | None]:
    """Requests to several peers at once: all sent, then `meanwhile` run (work of the
    caller's own, done while the requests are out), then the replies taken as they come, so
    a lookup whose keys have many homes waits about one round trip, not one per home. Each
    reply as `Connection.call` gives it; None for a peer that did not answer in time."""
    if len(calls) == 1 and meanwhile is None:
        connection, message = calls[0]
        return [connection.call(message)]
    ordered = sorted({id(c): c for c, _ in calls}.values(), key=id)  # one lock order for all
    for connection in ordered:
        connection.lock.acquire()
    try:
        poller = zmq.Poller()
        sent: dict[zmq.Socket[bytes], tuple[int, bytes]] = {}
        for i, (connection, message) in enumerate(calls):
            sock = connection.socket()
            rid = RID.pack(connection.next_rid())
            sock.send_multipart([rid, encode(message)])
            sent[sock] = (i, rid)
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        if meanwhile is not None:
            meanwhile()
        results: list[list[memoryview] | None] = [None] * len(calls)
        waiting = len(calls)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                frames = sock.recv_multipart(copy=False)
                i, rid = sent[sock]
                if frames[0].bytes == rid:
                    results[i] = [frame.buffer for frame in frames[1:]]
                    poller.unregister(sock)
                    waiting -= 1
        for (connection, _), result in zip(calls, results, strict=True):
            if result is None:
                connection.drop()  # what arrives late is dropped with the socket
        return results
    finally:
        for connection in ordered:
            connection.lock.release()


class Connections:
    """A few connections to each peer, handed out in turn: promotions of one request run in
    parallel instead of queueing behind one socket."""

    def __init__(
        self, keys: KeyRing | None, server_key: Callable[[str], bytes], timeout: float
    ) -> None:
        """`server_key(endpoint)`: the CURVE key the peer serves with, as membership says."""
        self._keys = keys
        self._server_key = server_key
        self._timeout = timeout
        self._pools: dict[str, list[Connection]] = {}
        self._turn = 0
        self._lock = threading.Lock()

    def to(self, endpoint: str) -> Connection:
        with self._lock:
            pool = self._pools.get(endpoint)
            if pool is None:
                key = self._server_key(endpoint)
                pool = self._pools[endpoint] = [
                    Connection(endpoint, self._keys, key, self._timeout)
                    for _ in range(CONNECTIONS_PER_PEER)
                ]
            self._turn += 1
            return pool[self._turn % len(pool)]

    def drop_unless(self, keep: Callable[[str, bytes], bool]) -> list[str]:
        """Close the connections of peers `keep(endpoint, server_key)` refuses (gone, or
        serving with another key since); their endpoints."""
        with self._lock:
            dropped = [e for e, pool in self._pools.items() if not keep(e, pool[0].server_key)]
            pools = [self._pools.pop(endpoint) for endpoint in dropped]
        for pool in pools:
            for connection in pool:
                connection.close()
        return dropped

    def close_idle(self, unused_since: float) -> int:
        """Close connections last used before `unused_since`; how many were closed."""
        with self._lock:
            pools = list(self._pools.values())
        return sum(c.close_if_idle(unused_since) for pool in pools for c in pool)

    def open_count(self) -> int:
        with self._lock:
            return sum(c.open for pool in self._pools.values() for c in pool)

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            for connection in pool:
                connection.close()
