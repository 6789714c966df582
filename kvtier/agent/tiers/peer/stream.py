"""The stream: chunk bytes between agents over a plain TCP connection, authenticated per
chunk under a key the asker draws for each request and sends over the CURVE channel, and
encrypted too where the tier asks for it. Only the holder it asked can write bytes the asker
accepts.

Two ways, chosen by the asker per request (`Stream.sealed`):
- signed (the default): the bytes travel in the clear, each chunk followed by its GMAC tag
  (AES-GCM over no plaintext, the chunk as associated data). They are sent straight from the
  holder's slot and received straight into the asker's: a pass over each chunk on either
  side, at about the connection's speed between nodes;
- sealed (`peer.encryptBytes`): AES-GCM encrypts each chunk as well, a pass that also writes,
  on both sides, for networks not trusted with the bytes (AES-GCM ran at 2.5-18 GB/s a core
  on the machines this was measured on, GMAC at about twice that; CURVE's own encryption of
  ZMQ frames reached 0.2-0.5x a raw TCP stream).

One request: over CURVE the asker sends `Stream(namespace, keys, secret, ticket, sealed)`;
the holder leases the chunks, answers `Streamed(port, statuses, pages)` (an `Answer` per
key, the packed header of each chunk sent) and keeps the lease under the ticket. The asker
writes the ticket on its stream connection to that port, and the holder writes the count of
chunks, then each chunk sent, in order, as its length (8 bytes), its bytes (ciphertext when
sealed) and its 16-byte tag, with nonce = the chunk's index (and, sealed, associated data =
ticket || index), then lets the lease go. The key is drawn afresh per request, so a stream
recorded for one request fails every tag of another. A ticket is claimed once; one never
claimed expires with its lease. An unknown ticket gets a count of `UNKNOWN` and the
connection closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = logging.getLogger("kvtier.agent.peers")
TICKET = 16  # bytes of a ticket, and of a request's AES-128 key
TAG = 16
COUNT = struct.Struct("<I")
LENGTH = struct.Struct("<Q")
UNKNOWN = 0xFFFFFFFF
MAX_CONNECTIONS = 64  # stream connections a holder serves at once; more are closed
BUFFER = 4 << 20  # socket buffers: a 2 MiB chunk in flight while the next is sealed
MAX_DROPPED = 1 << 30  # the most a chunk whose header failed may take, received to be dropped


def new_secret() -> tuple[bytes, bytes]:
    """A request's (AES key, ticket), both random."""
    return os.urandom(TICKET), os.urandom(TICKET)


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "little")


def _aad(ticket: bytes, index: int) -> bytes:
    return ticket + index.to_bytes(8, "little")


@dataclass
class _Pending:
    """Chunks leased for a ticket, waiting for the asker to claim them."""

    deadline: float
    lease: int
    secret: bytes
    chunks: list[tuple[memoryview, int]]  # (the slot's payload, the chunk's length)
    sealed: bool


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("stream closed")
        got += n


class StreamServer:
    """The holder's end: a TCP listener whose connections claim tickets and get their
    chunks sealed, one thread a connection (at most `MAX_CONNECTIONS`). It counts the slots
    of its leases until they are handed back through `finished()` (bytes written, or the
    ticket expired) to the thread that owns the leases."""

    def __init__(self, host: str, port: int, idle_seconds: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._idle = idle_seconds
        self._pending: dict[bytes, _Pending] = {}
        self._leases: dict[int, int] = {}  # lease -> slots, until handed back
        self._done: deque[int] = deque()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: set[socket.socket] = set()
        self.refused = 0  # connections over the cap, and unknown tickets
        self._thread = threading.Thread(target=self._accept, name="kvtier-stream", daemon=True)
        self._thread.start()

    def expect(
        self,
        ticket: bytes,
        secret: bytes,
        lease: int,
        chunks: list[tuple[memoryview, int]],
        deadline: float,
        sealed: bool,
    ) -> None:
        with self._lock:
            self._pending[ticket] = _Pending(deadline, lease, secret, chunks, sealed)
            self._leases[lease] = len(chunks)

    def lent(self) -> int:
        """Slots leased for tickets and not handed back yet (read by other threads)."""
        return sum(list(self._leases.values()))

    def finished(self, now: float) -> list[int]:
        """Leases to end: bytes written, or the ticket expired unclaimed."""
        with self._lock:
            late = [t for t, p in self._pending.items() if p.deadline < now]
            leases = [self._pending.pop(t).lease for t in late]
            while self._done:
                leases.append(self._done.popleft())
            for lease in leases:
                self._leases.pop(lease, None)
        return leases

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Tickets claimed one after another until the asker closes or goes idle; anything
        unexpected closes the connection (the asker gets misses), never the agent."""
        with self._lock:
            self._open.add(conn)
        try:
            conn.settimeout(self._idle)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ticket = bytearray(TICKET)
            sealed = bytearray()
            while True:
                _recv_exactly(conn, memoryview(ticket))
                with self._lock:
                    pending = self._pending.pop(bytes(ticket), None)
                if pending is None:
                    self.refused += 1
                    conn.sendall(COUNT.pack(UNKNOWN))
                    return
                try:
                    sealed = self._send(conn, bytes(ticket), pending, sealed)
                finally:
                    self._done.append(pending.lease)
        except (OSError, ConnectionError):
            pass
        except Exception:  # a bug here must not take the agent down: the asker gets misses
            log.exception("stream failed")
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()
            self._slots.release()

    @staticmethod
    def _send(
        conn: socket.socket, ticket: bytes, pending: _Pending, sealed: bytearray
    ) -> bytearray:
        aead = AESGCM(pending.secret)
        conn.sendall(COUNT.pack(len(pending.chunks)))
        for index, (payload, length) in enumerate(pending.chunks):
            conn.sendall(LENGTH.pack(length))
            if not pending.sealed:  # straight from the slot, its tag after it
                body = payload[:length]
                tag = aead.encrypt(_nonce(index), b"", body)
                conn.sendall(body)
                conn.sendall(tag)
                continue
            if len(sealed) < length + TAG:
                sealed = bytearray(length + TAG)
            out = memoryview(sealed)[: length + TAG]
            aead.encrypt_into(_nonce(index), payload[:length], _aad(ticket, index), out)
            conn.sendall(out)
        return sealed

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)


class StreamFailed(Exception):
    """The stream broke or said something unexpected; the chunks not received are to be
    fetched another way (or missed)."""


class StreamChannel:
    """The asker's end: one connection to a holder's stream port, kept across requests and
    used under its `Connection`'s lock (one request at a time)."""

    def __init__(self, host: str, timeout: float) -> None:
        self.host = host
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._port = 0
        self._sealed = bytearray()

    def _socket(self, port: int) -> socket.socket:
        if self._sock is None or self._port != port:
            self.close()
            sock = socket.create_connection((self.host, port), timeout=self._timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock, self._port = sock, port
        return self._sock

    def _claim(self, port: int, ticket: bytes) -> tuple[socket.socket, int]:
        """Write the ticket; the connection and how many chunks follow. A kept connection
        the holder has since dropped (it restarted, or closed it idle) fails before the
        count arrives: the ticket is then written once more on a fresh one."""
        head = bytearray(COUNT.size)
        kept = self._sock is not None and self._port == port
        while True:
            try:
                sock = self._socket(port)
                sock.sendall(ticket)
                _recv_exactly(sock, memoryview(head))
                return sock, int(COUNT.unpack(head)[0])
            except (OSError, ConnectionError):
                if not kept:
                    raise
                kept = False
                self.close()

    def receive(
        self,
        port: int,
        ticket: bytes,
        secret: bytes,
        sealed: bool,
        outs: list[memoryview | None],
        opened: Callable[[int, bool], None],
    ) -> None:
        """Claim `ticket` and take each chunk into its `out` (None: received and dropped,
        its header having failed), checking its tag; `opened(i, authentic)` after each.
        Raises StreamFailed."""
        try:
            sock, count = self._claim(port, ticket)
            if count != len(outs):
                raise StreamFailed(f"holder streams {count} chunks, {len(outs)} expected")
            head = bytearray(LENGTH.size)
            tag = bytearray(TAG)
            aead = AESGCM(secret)
            for index, out in enumerate(outs):
                _recv_exactly(sock, memoryview(head))
                (size,) = LENGTH.unpack(head)
                if size > (len(out) if out is not None else MAX_DROPPED):
                    raise StreamFailed(f"chunk of {size} bytes does not fit its slot")
                check: Callable[[], object]  # raises InvalidTag for bytes not the holder's
                if out is not None and not sealed:  # straight into the slot
                    body = out[:size]
                    _recv_exactly(sock, body)
                    _recv_exactly(sock, memoryview(tag))
                    check = partial(aead.decrypt, _nonce(index), bytes(tag), body)
                else:
                    if len(self._sealed) < size + TAG:
                        self._sealed = bytearray(size + TAG)
                    wire = memoryview(self._sealed)[: size + TAG]
                    _recv_exactly(sock, wire)
                    if out is None:
                        continue
                    aad = _aad(ticket, index)
                    check = partial(aead.decrypt_into, _nonce(index), wire, aad, out[:size])
                try:
                    check()
                    opened(index, True)
                except InvalidTag:
                    opened(index, False)
        except (OSError, ConnectionError) as exc:
            self.close()
            raise StreamFailed(str(exc)) from exc
        except StreamFailed:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
