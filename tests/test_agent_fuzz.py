"""A live agent under hostile requests: each refused one leaves the index, the leases and the
pool headers exactly as they were, and a stream of them never disturbs a well-behaved client
(KVTIER_FUZZ_MESSAGES sets how many; every one is answered or dropped, and counted)."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient
from kvtier.client.liveness import ClientLock
from kvtier.local.agent import AgentProcess
from kvtier.shm.table import digests
from tests.agent_fuzz import per_message_type, random_hostile, rid, snapshot
from tests.agent_helpers import scrape
from tests.conftest import ROW
from tests.helpers import NS, key, row, wait_settled

MESSAGES = int(os.environ.get("KVTIER_FUZZ_MESSAGES", "100000"))


class RawSession:
    """A connection that speaks the protocol by hand, as a hostile client would."""

    def __init__(self, agent: AgentProcess, hello: bool = True) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(agent.config.endpoint)
        self.lock = ClientLock(agent.config.run_dir / "clients", f"fuzzer-{id(self)}")
        self.sent = 0
        if hello:
            reply = self.ask(p.encode(p.Hello(f"fuzzer-{id(self)}", self.lock.path.name)))
            assert isinstance(reply, p.HelloReply)

    def send(self, body: bytes, one_way: bool = False) -> bytes:
        self.sent += 1
        request_id = p.ONE_WAY if one_way else rid(self.sent)
        self.sock.send_multipart([request_id, body])
        return request_id

    def ask(self, body: bytes) -> p.Reply:
        return p.reply_decoder.decode(self.ask_raw(body))

    def ask_raw(self, body: bytes) -> bytes:
        request_id = self.send(body)
        while self.sock.poll(5000):
            got, answer = self.sock.recv_multipart()
            if got == request_id:
                return answer
        raise TimeoutError("the agent did not answer")

    def barrier(self) -> None:
        """A read-only round trip: everything sent before it has been handled."""
        assert isinstance(self.ask(p.encode(p.Events(NS, 0))), p.EventsReply)

    def drain(self) -> int:
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close()
        self.lock.release()


@pytest.fixture
def session(agent: AgentProcess) -> Iterator[RawSession]:
    raw = RawSession(agent)
    yield raw
    raw.close()


def test_every_refused_request_leaves_the_agent_as_it_was(
    agent: AgentProcess, session: RawSession
) -> None:
    with (
        AgentClient(agent.config.endpoint) as victim,
        AgentClient(agent.config.endpoint) as watcher,
    ):
        victim.store(NS, [key(i) for i in range(10)], [row(i, ROW) for i in range(10)])
        wait_settled(watcher)
        foreign = [
            victim.allocate(NS, [key(100)], ROW).lease,
            victim.begin_load(NS, [key(0)]).lease,
        ]
        own_store = session.ask(p.encode(p.Allocate(NS, [key(200)], ROW)))
        own_load = session.ask(p.encode(p.BeginLoad(NS, [key(1)])))
        assert isinstance(own_store, p.LeaseReply) and isinstance(own_load, p.LeaseReply)
        before = snapshot(watcher, agent.config.pool_path)
        hostile = list(
            per_message_type(NS, watcher.slot_bytes, foreign, own_store.lease, own_load.lease)
        )
        for message in hostile:
            if message.one_way:
                session.send(message.body, one_way=True)
                session.barrier()
            else:
                reply = session.ask(message.body)
                assert isinstance(reply, p.ErrorReply), message.what
            assert snapshot(watcher, agent.config.pool_path) == before, message.what
        unregistered = RawSession(agent, hello=False)
        try:
            reply = unregistered.ask(p.encode(p.Allocate(NS, [key(300)], ROW)))
            assert isinstance(reply, p.ErrorReply) and reply.code == p.NOT_REGISTERED
            unregistered.send(p.encode(p.Commit(foreign[0])), one_way=True)
        finally:
            unregistered.close()
        victim.commit(foreign[0])  # the victim's own leases still work
        victim.end_load(foreign[1])
        assert victim.lookup(NS, [key(100)]).hits == [True]


def test_a_lookup_whose_digests_are_not_its_keys_finds_nothing(
    agent: AgentProcess, session: RawSession
) -> None:
    """A lookup may carry its keys' index digests (the client has them from its own look
    in the published index): with the right ones it finds the chunks, with another key's
    (swapped, or of keys stored nowhere) nothing, as the index confirms candidates by key."""
    keys = [key(i) for i in range(4)]
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, keys, [row(i, ROW) for i in range(4)])
        wait_settled(client)
    right = digests(NS, keys).tobytes()
    reply = session.ask(p.encode(p.Lookup(NS, keys, "", right)))
    assert isinstance(reply, p.LookupReply) and reply.hits == [True] * 4
    for wrong in (digests(NS, keys[::-1]), digests(NS, [key(i) for i in range(10, 14)])):
        reply = session.ask(p.encode(p.Lookup(NS, keys, "", wrong.tobytes())))
        assert isinstance(reply, p.LookupReply) and reply.hits == [False] * 4


class _HelloV1(msgspec.Struct, tag="hello"):
    """The previous release's hello, as its plug-ins send it."""

    client: str
    lock: str
    protocol: int = 1


class _ErrorReplyV1(msgspec.Struct, tag="error"):
    """The previous release's error reply, as its plug-ins decode it."""

    message: str


def test_previous_release_client_is_refused_naming_both_versions(session: RawSession) -> None:
    answer = session.ask_raw(msgspec.msgpack.encode(_HelloV1("old", session.lock.path.name)))
    reply = msgspec.msgpack.Decoder(_ErrorReplyV1).decode(answer)
    assert f"protocol 1, agent {p.PROTOCOL_VERSION}" in reply.message


def test_hostile_stream_never_disturbs_a_well_behaved_client(
    agent: AgentProcess, session: RawSession
) -> None:
    endpoint = agent.config.endpoint
    stop = threading.Event()
    outcome: dict[str, int] = {"rounds": 0, "wrong": 0}

    def well_behaved() -> None:
        with AgentClient(endpoint, timeout=10) as client:
            while not stop.is_set():
                i = outcome["rounds"] % 200
                client.store(NS, [key(i)], [row(i, ROW)])
                out = np.zeros(ROW, np.uint8)
                if client.load_into(NS, [key(i)], [out]) == [True]:
                    outcome["wrong"] += not np.array_equal(out, row(i, ROW))
                outcome["rounds"] += 1

    with AgentClient(endpoint) as victim:
        victim.store(NS, [key(1000)], [row(1000, ROW)])
        leases = [
            victim.allocate(NS, [key(1001)], ROW).lease,
            victim.begin_load(NS, [key(1000)]).lease,
        ]
        worker = threading.Thread(target=well_behaved)
        worker.start()
        rng = random.Random(12)
        try:
            for n in range(MESSAGES):
                message = random_hostile(rng, NS, leases)
                session.send(message.body, one_way=message.one_way)
                if n % 256 == 0:
                    session.drain()
            session.barrier()
        finally:
            stop.set()
            worker.join(60)
        assert outcome["rounds"] > 0 and outcome["wrong"] == 0
        stats = victim.stats()
        assert stats.host.leases == 2  # the victim's, untouched
        refused = scrape(stats.metrics_port)
        total = sum(v for k, v in refused.items() if k.startswith("kvtier_requests_refused_total"))
        assert total == MESSAGES
        victim.commit(leases[0])
        assert victim.lookup(NS, [key(1001)]).hits == [True]
