"""The socket exchange with the node agent, and the errors a call to it raises.

One ZMQ DEALER socket on the agent's ipc endpoint; each request goes out as two frames, an
8-byte request id and the body (protocol.py), and its reply is awaited until a deadline.
Replies to requests sent ahead of their wait (a store's Commit) that arrive meanwhile are
kept for their own wait; a reply to a request that timed out earlier is dropped, and a
timeout rebuilds the socket, so a late reply can never be taken for a later request's.
Imports only pyzmq and msgspec, which vLLM has.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvtier.client import protocol as p

_RID = struct.Struct("<Q")


class AgentError(Exception):
    """A call to the agent failed: either of the two below, for callers that handle both
    alike."""


class AgentUnavailable(AgentError, ConnectionError):
    """The agent did not answer in time, or its socket or pool cannot be reached; the
    caller treats it as a miss."""


class AgentRefused(AgentError):
    """The agent answered with an error: the request itself was wrong (or this client's
    configuration is), so asking again will not help."""


class LeaseLost(AgentUnavailable):
    """The lease a call names is void (it expired, or the agent restarted since it was
    granted): the store or load it covered did not happen."""


class NotRegistered(Exception):
    """The agent does not know this connection: say hello again."""


class Transport:
    """Requests to the agent and their replies. `lock` allows one request at a time on the
    socket: `send` takes it, the other calls expect it held. `lost` is called when the
    agent did not answer in time (it may have restarted: the client says hello again)."""

    def __init__(self, endpoint: str, timeout_ms: int, lost: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.lock = threading.Lock()
        self._lost = lost
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._rids = itertools.count(1)
        self._ahead: set[bytes] = set()  # ids of requests sent ahead of their reply
        self._stash: dict[bytes, bytes] = {}  # their replies, come while awaiting others

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def send(self, request: p.Request) -> None:
        """Send a one-way request. If the agent is gone it is dropped: the agent releases the
        lease by itself (timeout or dead client), so nothing waits on it."""
        with self.lock:
            self.post(request)

    def post(self, request: p.Request) -> None:
        """`send`, with the lock held."""
        with contextlib.suppress(zmq.Again):
            self._socket().send_multipart([p.ONE_WAY, p.encode(request)], flags=zmq.NOBLOCK)

    def exchange(self, request: p.Request, expect: type[Any], deadline: float) -> Any:
        """Send a request and await its reply (lock held)."""
        rid = self.send_ahead(request, keep=False)
        return self.await_reply(rid, type(request).__name__, expect, deadline)

    def send_ahead(self, request: p.Request, keep: bool = True) -> bytes:
        """Send a request whose reply is awaited later (lock held): its request id. With
        `keep`, a reply that arrives while other replies are awaited is kept for it."""
        rid = _RID.pack(next(self._rids))
        self._socket().send_multipart([rid, p.encode(request)])
        if keep:
            self._ahead.add(rid)
        return rid

    def await_reply(self, rid: bytes, what: str, expect: type[Any], deadline: float) -> Any:
        """The reply to request `rid` (lock held); replies to requests sent ahead that
        arrive meanwhile are kept for their own `await_reply`. Raises NotRegistered,
        LeaseLost, AgentRefused for the agent's error codes, AgentUnavailable past the
        deadline."""
        sock = self._socket()
        body = self._stash.pop(rid, None)
        while body is None:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                break
            frames = sock.recv_multipart()
            if len(frames) != 2:
                continue
            if frames[0] == rid:
                body = frames[1]
            elif frames[0] in self._ahead:
                self._stash[frames[0]] = frames[1]
            # else: a late answer to an earlier, timed-out request
        if body is not None:
            self._ahead.discard(rid)
            try:
                reply = p.reply_decoder.decode(body)
            except msgspec.MsgspecError as exc:
                raise AgentRefused(f"undecodable reply to {what}: {exc}") from None
            if isinstance(reply, p.ErrorReply):
                if reply.code == p.NOT_REGISTERED:
                    raise NotRegistered(reply.message)
                error = LeaseLost if reply.code == p.LEASE else AgentRefused
                raise error(f"agent refused {what}: {reply.message}")
            if not isinstance(reply, expect):
                raise AgentRefused(f"unexpected reply {type(reply).__name__}")
            return reply
        self._ahead.clear()
        self._stash.clear()
        self.close()
        self._lost()  # a restarted agent needs a new hello before anything else
        raise AgentUnavailable(
            f"agent at {self.endpoint} did not answer within {self.timeout_ms} ms"
        )

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
