"""The node's KV event stream as a router reads it: a subscriber written from vLLM's wire
format alone (ZMQ frames topic / sequence / msgpack KVEventBatch, a replay ROUTER socket)
rebuilds exactly what every tier of the node holds through stores, evictions on the pool
and the filesystem, dropped messages (replayed from the buffer, or past it the node's
holdings), and an agent restart (AllBlocksCleared, then the warm pool and the tiers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvtier.agent.host.events import STORAGE
from kvtier.agent.report.event_stream import KVEventBatch, split_key, to_kv_events
from kvtier.agent.tiers.peer.wire import load_keys, write_keys
from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import store, store_written, tier_stats, wait_for
from tests.conftest import ROW, free_port
from tests.helpers import NS, key

Chunk = tuple[str, int, int]  # namespace, KV group, block hash
Holdings = dict[tuple[str, str], set[Chunk]]  # (medium, locality) -> chunks
END = -1


class Router:
    """What a cache-aware router keeps of one node: its holdings from the stream, with
    gap detection by sequence number and replay; no kvtier code involved."""

    def __init__(
        self, endpoint: str, replay: str, curve: tuple[bytes, bytes, bytes] | None = None
    ) -> None:
        self.ctx = zmq.Context()
        self.curve = curve
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_at = replay
        self.held: Holdings = {}
        self.last: int | None = None
        self.gaps = self.replays_past_buffer = 0
        self.heard = 0  # batches read off the SUB socket (not replayed)

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.curve
        return sock

    def apply(self, topic: bytes, payload: bytes) -> None:
        namespace = topic.decode().split("@", 2)[2]
        ts, events, *_ = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float)
        for event in events:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                assert namespace == ""
                self.held = {}
                continue
            assert event["ownership"] == "node-a"
            where = self.held.setdefault((event["medium"], event["locality"]), set())
            for block in event["block_hashes"]:
                chunk = (namespace, event["group_idx"], block)
                if kind == "BlockStored":
                    where.add(chunk)
                else:
                    assert kind == "BlockRemoved" and chunk in where, "removal of a chunk not held"
                    where.discard(chunk)

    def read(self, seconds: float = 0.2) -> None:
        if self.last is None:  # joining: the node's holdings first
            self.replay(0)
        while self.sub.poll(int(seconds * 1000)):
            topic, raw, payload = self.sub.recv_multipart()
            seq = int.from_bytes(raw, "big", signed=True)
            if self.last is not None and seq <= self.last:
                continue  # already had it (from a replay)
            elif self.last is None or seq > self.last + 1:
                # joined late (what came before it was missed) or messages were dropped
                self.gaps += self.last is not None
                self.replay(0 if self.last is None else self.last + 1)
                if self.last is not None and seq <= self.last:
                    continue
            self.apply(topic, payload)
            self.last = seq
            self.heard += 1

    def replay(self, start: int) -> None:
        dealer = self._socket(zmq.DEALER)
        dealer.connect(self.replay_at)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not dealer.poll(2000):  # no answer (refused, or no agent): nothing replayed
                break
            _, topic, raw, payload = dealer.recv_multipart()
            seq = int.from_bytes(raw, "big", signed=True)
            if seq == END:
                break
            if topic.endswith(b"@"):  # AllBlocksCleared: the node's holdings follow
                self.replays_past_buffer += 1
            self.apply(topic, payload)
            self.last = seq
        dealer.close()

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def truth(client: AgentClient, fs_root: Path, ids: range) -> Holdings:
    """What the node holds: the pool's chunks (found there by lookups), and the files."""
    where = client.lookup(NS, [key(i) for i in ids]).where
    files = {bytes.fromhex(p.name) for p in fs_root.glob(f"{NS}/*/*/*") if len(p.name) > 20}

    def chunks(keys: set[bytes]) -> set[Chunk]:
        return {(NS, split_key(k)[1], int(split_key(k)[0])) for k in keys}

    out: Holdings = {}
    pool = {key(i) for i, w in zip(ids, where, strict=True) if w == 0}
    if pool:
        out[("CPU", "LOCAL")] = chunks(pool)
    if files:
        out[STORAGE] = chunks(files)
    return out


def nonempty(held: Holdings) -> Holdings:
    return {where: chunks for where, chunks in held.items() if chunks}


@pytest.fixture
def stream_config(make_config: Callable[..., AgentConfig], scratch: Path) -> AgentConfig:
    return make_config(
        {
            "tiers": [
                {
                    "name": "fs",
                    "filesystem": {
                        "path": str(scratch / "fs"),
                        "capacity": 24 * (ROW + 4096),
                        "fsync": False,
                        "scanIntervalSeconds": 0.2,
                    },
                }
            ],
            "report": {"node": "node-a"},
            "events": {
                "enabled": True,
                "bind": f"tcp://127.0.0.1:{free_port()}",
                "replayBind": f"tcp://127.0.0.1:{free_port()}",
                "bufferSteps": 8,
            },
        },
        capacity=16 * (ROW + 4096) + 4096,
    )


def test_a_router_rebuilds_the_nodes_holdings_from_the_stream(
    stream_config: AgentConfig,
    agent_factory: Callable[[AgentConfig], AgentProcess],
    scratch: Path,
) -> None:
    fs_root = scratch / "fs"
    ids = range(400)
    events = stream_config.events
    router = Router(events.bind, events.replay_bind)
    agent = agent_factory(stream_config)
    try:
        with AgentClient(stream_config.endpoint) as client:

            def rebuilt() -> bool:
                router.read()
                return nonempty(router.held) == truth(client, fs_root, ids)

            # the filesystem writes behind the pool: the router matches the node once the
            # writes are done; what was written (not dropped) is what it must hold
            store_written(client, range(10), "fs")
            wait_for(rebuilt)
            fs = tier_stats(client, "fs").counts
            assert len(router.held[STORAGE]) == fs.writebacks > 0, fs
            store(client, range(10, 60))  # the pool evicts; the filesystem passes its watermark
            wait_for(lambda: rebuilt() and len(router.held[STORAGE]) < 24)

            joined = router.replays_past_buffer  # joining read the node's holdings
            router.sub.setsockopt(zmq.UNSUBSCRIBE, b"")  # messages dropped: a gap
            store(client, range(60, 64))
            wait_for(lambda: client.lookup(NS, [key(63)]).where == [0])
            router.read(0.5)
            router.sub.setsockopt(zmq.SUBSCRIBE, b"")
            router.read(0.3)
            store(client, range(64, 66))
            wait_for(lambda: rebuilt() and router.gaps == 1)
            assert router.replays_past_buffer == joined  # the buffer still had them

            router.sub.setsockopt(zmq.UNSUBSCRIBE, b"")  # a gap longer than the buffer
            for start in range(66, 266, 10):  # each a batch of its own: more than it keeps
                store(client, range(start, start + 10))
                time.sleep(0.08)
            router.read(0.5)
            router.sub.setsockopt(zmq.SUBSCRIBE, b"")
            router.read(0.3)
            store(client, range(266, 268))
            wait_for(lambda: rebuilt() and router.gaps == 2)
            assert router.replays_past_buffer > joined  # answered with the node's holdings

        agent.stop()  # a restart: the warm pool and the files are announced again
        restarted = agent_factory(stream_config)
        with AgentClient(restarted.config.endpoint) as client:
            # what it announced at its start went out before the router was back: the next
            # batch shows a gap past the new process's buffer, answered with the holdings
            past = router.replays_past_buffer
            more = iter(range(300, 340))

            def caught_up() -> bool:
                if router.replays_past_buffer == past:  # until the router is back
                    store(client, [next(more)])
                return rebuilt() and router.replays_past_buffer > past

            wait_for(caught_up)
            assert router.held[("CPU", "LOCAL")] and router.held[STORAGE]
            store(client, range(340, 360))
            wait_for(rebuilt)
    finally:
        router.close()


def test_the_stream_admits_only_subscribers_with_the_tiers_key_pair(
    stream_config: AgentConfig,
    agent_factory: Callable[[AgentConfig], AgentProcess],
    scratch: Path,
) -> None:
    keys_dir = scratch / "curve"
    write_keys(keys_dir)
    keys = load_keys(keys_dir)
    config = stream_config.model_copy(
        update={"events": stream_config.events.model_copy(update={"curve_key_dir": keys_dir})}
    )
    events = config.events
    trusted = Router(events.bind, events.replay_bind, (keys.public, keys.secret, keys.public))
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = Router(
        events.bind, events.replay_bind, (stranger_public, stranger_secret, keys.public)
    )
    agent_factory(config)
    try:
        with AgentClient(config.endpoint) as client:
            store_written(client, range(3), "fs")
            # joining replays the holdings; a batch published before its SUB socket is
            # connected is missed until the next shows the gap, so store until one arrives
            more = iter(range(3, 16))

            def heard() -> bool:
                trusted.read()
                if not trusted.heard and (one := next(more, None)) is not None:
                    store(client, [one])  # thirteen at most, then the wait times out
                return trusted.heard > 0 and len(trusted.held.get(STORAGE, ())) >= 3

            wait_for(heard)
            stranger.read(0.5)
            assert stranger.held == {} and stranger.last is None
    finally:
        trusted.close()
        stranger.close()


def test_batches_decode_as_vllms_kv_events() -> None:
    """The same bytes vLLM's own KVEventBatch decodes (its classes mirrored field for field;
    tests/vllm checks against vLLM's)."""
    k = (7).to_bytes(32, "big") + (1).to_bytes(4, "big")
    events = to_kv_events([(STORAGE, False, [k]), (STORAGE, True, [k])], "node-a")
    payload = msgspec.msgpack.encode(KVEventBatch(1.0, events, 0))
    ts, decoded, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (1.0, 0)
    stored: dict[str, Any] = decoded[0]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [7]
    assert (stored["medium"], stored["locality"], stored["group_idx"]) == ("STORAGE", "LOCAL", 1)
    assert decoded[1] == {
        "type": "BlockRemoved",
        "block_hashes": [7],
        "medium": "STORAGE",
        "group_idx": 1,
        "locality": "LOCAL",
        "ownership": "node-a",
    }
