"""The stream between agents (`kvtier/agent/tiers/peer/stream.py`) over real TCP sockets,
signed (bytes in the clear, a tag per chunk) and sealed (encrypted too): what a process on
the network between two agents sees and can change, what a stranger dialling the stream port
gets, and the fallbacks when a holder has no stream."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.agent.tiers.peer.stream import (
    COUNT,
    MAX_CONNECTIONS,
    UNKNOWN,
    StreamChannel,
    StreamFailed,
    StreamServer,
    new_secret,
)
from kvtier.agent.tiers.peer.wire import write_keys
from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import load_exact, store, wait_for
from tests.helpers import NS, key
from tests.peer_helpers import free_port, node_config, peer_stats

CHUNK = 1 << 20
StartAgent = Callable[[AgentConfig], AgentProcess]


class Tamperer:
    """A TCP relay between the asker and the holder's stream port, as a machine on the path
    would be: it keeps what the holder sent, and can flip one byte of it on the way."""

    def __init__(self, target: int, flip_at: int | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.flip_at = target, flip_at
        self.seen = bytearray()
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        asker, _ = self.listener.accept()
        holder = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(asker, holder, False), daemon=True).start()
        self._pump(holder, asker, True)

    def _pump(self, src: socket.socket, dst: socket.socket, keep: bool) -> None:
        while data := src.recv(1 << 16):
            if keep:
                start = len(self.seen)
                self.seen += data
                if self.flip_at is not None and start <= self.flip_at < len(self.seen):
                    data = bytearray(data)
                    data[self.flip_at - start] ^= 0x01
            dst.sendall(data)
        dst.close()


@pytest.fixture
def holder() -> Iterator[StreamServer]:
    server = StreamServer("127.0.0.1", 0, idle_seconds=5)
    yield server
    server.close()


def offer(server: StreamServer, chunks: list[bytes], sealed: bool = False) -> tuple[bytes, bytes]:
    """Chunks kept for a fresh ticket, as the holder does when answering `Stream`."""
    secret, ticket = new_secret()
    payloads = [(memoryview(c), len(c)) for c in chunks]
    server.expect(ticket, secret, 7, payloads, float("inf"), sealed)
    return secret, ticket


def fetch(
    port: int, ticket: bytes, secret: bytes, n: int, sealed: bool = False
) -> tuple[list[np.ndarray], list[bool]]:
    outs = [np.zeros(CHUNK, np.uint8) for _ in range(n)]
    verdicts: list[bool] = [False] * n

    def opened(i: int, authentic: bool) -> None:
        verdicts[i] = authentic

    channel = StreamChannel("127.0.0.1", timeout=5)
    try:
        channel.receive(port, ticket, secret, sealed, [memoryview(o) for o in outs], opened)
    finally:
        channel.close()
    return outs, verdicts


@pytest.mark.parametrize("sealed", [False, True], ids=["signed", "sealed"])
def test_a_byte_changed_on_the_wire_is_a_miss(holder: StreamServer, sealed: bool) -> None:
    """Through a relay that keeps everything: a byte it flips in the second chunk makes that
    chunk fail its tag (a miss, never its bytes) while the first and third arrive intact.
    Sealed, no 64-byte run of any chunk appears in what crossed the wire; signed, the bytes
    cross in the clear (what `encryptBytes` is for)."""
    chunks = [os.urandom(CHUNK) for _ in range(3)]
    secret, ticket = offer(holder, chunks, sealed)
    # 4 bytes of count, then 8 of length and CHUNK + 16 per chunk: inside the second one
    relay = Tamperer(holder.port, flip_at=4 + (8 + CHUNK + 16) + 8 + 1000)
    outs, verdicts = fetch(relay.port, ticket, secret, 3, sealed)
    assert verdicts == [True, False, True]
    assert bytes(outs[0]) == chunks[0] and bytes(outs[2]) == chunks[2]
    wire = bytes(relay.seen)
    assert len(wire) == 4 + 3 * (8 + CHUNK + 16)
    for chunk in chunks:
        runs = [chunk[i : i + 64] in wire for i in range(0, CHUNK, CHUNK // 8)]
        assert not any(runs) if sealed else all(runs)
    # the lease goes back once the bytes are written (the holder's thread may still be
    # finishing when the last byte has arrived)
    assert wait_for(lambda: holder.finished(0.0) == [7], timeout=5)
    assert holder.lent() == 0


@pytest.mark.parametrize("sealed", [False, True], ids=["signed", "sealed"])
def test_a_recorded_stream_does_not_open_for_another_request(
    holder: StreamServer, sealed: bool
) -> None:
    """Bytes recorded from one request and played back as the answer to another (a fresh
    key and ticket) fail authentication: a node on the path cannot serve stale KV."""
    chunk = os.urandom(CHUNK)
    secret, ticket = offer(holder, [chunk], sealed)
    relay = Tamperer(holder.port)
    assert fetch(relay.port, ticket, secret, 1, sealed)[1] == [True]
    recorded = bytes(relay.seen)
    fake = socket.create_server(("127.0.0.1", 0))

    def replay() -> None:
        conn, _ = fake.accept()
        conn.recv(16)
        conn.sendall(recorded)
        conn.close()

    threading.Thread(target=replay, daemon=True).start()
    secret2, ticket2 = new_secret()
    _, verdicts = fetch(fake.getsockname()[1], ticket2, secret2, 1, sealed)
    assert verdicts == [False]


def test_a_stranger_on_the_stream_port_gets_nothing(holder: StreamServer) -> None:
    """A ticket nobody was given is told `UNKNOWN` and the connection closed; a ticket is
    claimed once; connections past the cap are closed at once; none of it stops the holder
    serving the ticket it did give out."""
    chunk = os.urandom(CHUNK)
    secret, ticket = offer(holder, [chunk])
    with socket.create_connection(("127.0.0.1", holder.port), timeout=5) as stranger:
        stranger.sendall(os.urandom(16))
        assert stranger.recv(4) == COUNT.pack(UNKNOWN)
        assert stranger.recv(1) == b""
    crowd = [socket.create_connection(("127.0.0.1", holder.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection(("127.0.0.1", holder.port), timeout=5)
        assert extra.recv(1) == b""  # closed: the cap is reached
        extra.close()
    finally:
        for conn in crowd:
            conn.close()
    assert wait_for(lambda: holder.refused >= 2)
    outs, verdicts = fetch(holder.port, ticket, secret, 1)
    assert verdicts == [True] and bytes(outs[0]) == chunk
    with pytest.raises(StreamFailed):  # claimed already
        fetch(holder.port, ticket, secret, 1)


def test_an_unclaimed_ticket_expires_with_its_lease(holder: StreamServer) -> None:
    secret, ticket = new_secret()
    holder.expect(ticket, secret, 9, [(memoryview(b"x" * 10), 10)], 5.0, False)
    assert holder.lent() == 1
    assert holder.finished(4.0) == []
    assert holder.lent() == 1
    assert holder.finished(6.0) == [9]
    assert holder.lent() == 0


@pytest.mark.parametrize("sealed", [False, True], ids=["signed", "sealed"])
def test_agents_load_over_the_stream_and_fall_back_without_it(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    scratch: Path,
    sealed: bool,
) -> None:
    """Two agents with the tier's CURVE keys (as the operator deploys them): with `dataPath:
    tcp`, or with `encryptBytes` and `dataPath: auto` (NIXL is installed here, and left out
    because it moves bytes in the clear), chunks arrive over the stream, exact. A stranger
    filling the holder's stream port with junk changes nothing. A holder without a stream
    (`dataPath: zmq`) answers with no port, and its chunks come as ZMQ frames, no stream
    failure counted."""
    keys = scratch / "keys"
    write_keys(keys)
    port = free_port()
    path = {"dataPath": "auto", "encryptBytes": True} if sealed else {"dataPath": "tcp"}
    holder = agent_factory(
        node_config(
            make_config,
            scratch,
            "holder",
            keys,
            timeoutSeconds=1.2,
            streamPort=port,
            **path,
        )
    )
    asker_config = node_config(make_config, scratch, "asker", keys, timeoutSeconds=1.2, **path)
    agent_factory(asker_config)
    with AgentClient(holder.config.endpoint) as producer:
        store(producer, range(6))
    with socket.create_connection(("127.0.0.1", port)) as stranger:
        stranger.sendall(os.urandom(4096))
    with AgentClient(asker_config.endpoint) as asker:
        assert wait_for(lambda: asker.lookup(NS, [key(i) for i in range(6)]).prefix == 6)
        assert load_exact(asker, list(range(6))) == [True] * 6
        counts = peer_stats(asker).peer
        assert counts is not None
        assert counts.stream_reads == 6 and counts.stream_failures == 0
        assert counts.nixl_reads == 0 and counts.nixl_failures == 0
    old = agent_factory(
        node_config(make_config, scratch, "old", keys, timeoutSeconds=1.2, dataPath="zmq")
    )
    with AgentClient(old.config.endpoint) as producer:
        store(producer, range(6, 9))
    with AgentClient(asker_config.endpoint) as asker:

        def loaded() -> bool:
            # a holder that does not answer the stream request within the peer timeout (a
            # loaded machine, a new CURVE connection) is a miss once, and forgotten until
            # a lookup finds it again; its chunks then come as frames as well
            found = asker.lookup(NS, [key(i) for i in range(6, 9)]).prefix == 3
            return found and load_exact(asker, [6, 7, 8]) == [True] * 3

        assert wait_for(loaded)
        counts = peer_stats(asker).peer
        assert counts is not None
        assert counts.zmq_reads == 3 and counts.stream_failures == 0
        assert counts.stream_reads == 6  # none of them over a stream


def test_the_stream_port_is_bound_again_by_the_next_start() -> None:
    """The operator pins the port (`dataPort`): an agent restarted in its pod binds it again
    at once, three times over, though each time the holder closed first while the asker's
    connection was open (the holder's side left in TIME_WAIT), and serves on it."""
    port = free_port()
    verdicts: list[bool] = []
    for _ in range(3):
        server = StreamServer("127.0.0.1", port, idle_seconds=5)
        channel = StreamChannel("127.0.0.1", timeout=5)
        chunk = os.urandom(CHUNK)
        secret, ticket = offer(server, [chunk])
        out = np.zeros(CHUNK, np.uint8)
        verdicts.clear()
        channel.receive(
            port, ticket, secret, False, [memoryview(out)], lambda _, ok: verdicts.append(ok)
        )
        server.close()  # the holder goes first, as a restarted agent does
        channel.close()
        assert verdicts == [True] and bytes(out) == chunk
