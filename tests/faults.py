"""Fault injection for the tiers' backends: a TCP proxy in front of a server whose link the
test can cut (connections refused or reset) or hang (accepted, never answered), as a failing
or stalled S3 endpoint behaves."""

from __future__ import annotations

import contextlib
import enum
import select
import socket
import threading


class Link(enum.Enum):
    UP = "up"
    DOWN = "down"  # new connections are reset, open ones are cut
    HUNG = "hung"  # connections are accepted and never answered


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target` (host, port) while the link is UP."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.link = Link.UP
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, link: Link) -> None:
        self.link = link
        if link is not Link.UP:
            with self._lock:
                sockets, self._open = list(self._open), set()
            for s in sockets:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                    s.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self.set(Link.DOWN)

    def _track(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._open.update(sockets)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self.link is Link.DOWN:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                    conn.close()
                continue
            self._track(conn)
            if self.link is Link.HUNG:
                continue  # held open, never answered, until the link changes
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        self._track(upstream)
        pair = {client: upstream, upstream: client}
        try:
            while not self._stop.is_set() and self.link is Link.UP:
                readable, _, _ = select.select(list(pair), [], [], 0.2)
                for s in readable:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if self.link is Link.HUNG:
                        break  # swallowed: the other side waits for ever
                    pair[s].sendall(data)
        except OSError:
            return
        finally:
            if self.link is not Link.HUNG:
                for s in pair:
                    with contextlib.suppress(OSError):
                        s.close()
