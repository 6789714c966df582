"""The node's KV events on one ZMQ stream, in the wire format of vLLM's KV-event publisher
(`vllm/distributed/kv_events.py`, `--kv-events-config '{"publisher": "zmq", ...}'`), for
routers that do not sit inside an engine (llm-d's precise prefix scorer, Dynamo's KV router,
vLLM's router): every tier's stores and removals (events.NodeEvents), one stream per node.

Messages on the PUB socket are three frames, as vLLM sends them: topic, the sequence number
(8 bytes, big-endian) and a msgpack `KVEventBatch` `[ts, [event, ...], data_parallel_rank]`,
each event a map tagged `type`: `BlockStored` / `BlockRemoved` with `block_hashes` (the
offload key's block hash, a 64-bit integer as vLLM publishes by default), `group_idx`,
`medium` (CPU, STORAGE), `locality` (LOCAL, REMOTE) and `ownership` (the node), or
`AllBlocksCleared`. One batch is one namespace's, its topic `topic` with `{node}` and
`{namespace}` filled in; AllBlocksCleared comes on the topic of the empty namespace and means
the node holds nothing, in any namespace. Subscribe to the node's prefix (or everything):
sequence numbers count every batch of the stream.

The ROUTER socket replays, as vLLM's does: a request `[b"", start_seq]` (a DEALER/REQ's
frames) is answered with each buffered batch from `start_seq` on, `(b"", topic, seq,
payload)`, then the end marker `(b"", b"", -1, b"")`. Where `start_seq` is older than the
buffer, the answer is the node's holdings instead: AllBlocksCleared then what every tier
holds, stamped with the last sequence number sent. A new agent process starts its sequence
where the clock is (microseconds since the epoch, so it never goes back across restarts)
with AllBlocksCleared, then announces its warm pool and what its tiers hold: a subscriber
that missed the start sees a gap, asks for it, and gets the holdings.

With `curveKeyDir` both sockets are CURVE servers with the tier's peer key pair and admit
only subscribers dialling with a trusted key pair (the same Secret), as peers are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvtier.agent.host.events import NodeEvent, NodeEvents, Residency
from kvtier.agent.tiers.peer.wire import TrustedKeys, bind_on_pod_address, load_keys
from kvtier.api.config import EventStreamConfig
from kvtier.api.stats import EventStreamStats

log = logging.getLogger("kvtier.agent.host.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HASH_MASK = (1 << 64) - 1


# vLLM's classes (kv_events.py), field for field: the same msgpack on the wire.
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def split_key(key: bytes, int_hashes: bool = True) -> tuple[int | bytes, int]:
    """An offload key (block hash + 4-byte KV group, vLLM's `make_offload_key`) as the
    block hash and group index vLLM's events carry."""
    block, group = key[:-4], int.from_bytes(key[-4:], "big")
    return (int.from_bytes(block, "big") & _HASH_MASK if int_hashes else block), group


def to_kv_events(
    events: list[tuple[Residency, bool, list[bytes]]], owner: str, int_hashes: bool = True
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """Runs of one namespace's events as vLLM events, one per residency, direction and KV
    group."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for residency, removed, keys in events:
        groups: dict[int, list[int | bytes]] = {}
        for key in keys:
            block, group = split_key(key, int_hashes)
            groups.setdefault(group, []).append(block)
        for group, hashes in groups.items():
            if removed:
                out.append(BlockRemoved(hashes, residency.medium, group, residency.locality, owner))
            else:
                out.append(
                    BlockStored(
                        hashes,
                        None,
                        [],
                        0,
                        None,
                        residency.medium,
                        None,
                        group_idx=group,
                        locality=residency.locality,
                        ownership=owner,
                    )
                )
    return out


def _runs(events: list[NodeEvent]) -> list[tuple[str, list[tuple[Residency, bool, list[bytes]]]]]:
    """Events as consecutive runs per namespace, then per residency and direction."""
    out: list[tuple[str, list[tuple[Residency, bool, list[bytes]]]]] = []
    for event in events:
        if not out or out[-1][0] != event.namespace:
            out.append((event.namespace, []))
        runs = out[-1][1]
        if not runs or runs[-1][:2] != (event.residency, event.removed):
            runs.append((event.residency, event.removed, []))
        runs[-1][2].append(event.key)
    return out


class EventStream:
    """Publishes `events` (pumping the pool's in with `pump`) until closed."""

    def __init__(
        self, config: EventStreamConfig, events: NodeEvents, pump: Callable[[], None]
    ) -> None:
        self.config = config
        self.events = events
        self._pump = pump
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.curve_key: str | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
        if config.curve_key_dir is not None:
            keys = load_keys(config.curve_key_dir)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self.trusted = TrustedKeys(keys.trusted)
            self._auth.configure_curve_callback(domain="*", credentials_provider=self.trusted)
            for sock in (self._pub, self._replay):
                sock.curve_server = True
                sock.curve_publickey = keys.public
                sock.curve_secretkey = keys.secret
            self.curve_key = keys.public.decode()
        for sock in (self._pub, self._replay):
            sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind_on_pod_address(self._pub, config.bind)
        self.replay_endpoint = bind_on_pod_address(self._replay, config.replay_bind)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = time.time_ns() // 1000 - 1  # the last sequence number sent
        self._after = 0  # the node's events published up to
        self._encode = msgspec.msgpack.Encoder().encode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-events", daemon=True)

    def stats(self) -> EventStreamStats:
        """The addresses a router dials, for the node's report (KVCacheNode status.events)."""
        return EventStreamStats(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=self.config.topic.format(node=self.events.owner, namespace="{namespace}"),
            curve_key=self.curve_key,
        )

    def topic(self, namespace: str) -> bytes:
        return self.config.topic.format(node=self.events.owner, namespace=namespace).encode()

    def start(self) -> EventStream:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pub.close(0)
        self._replay.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # --- the publisher thread (owns both sockets) -------------------------------------------

    def _loop(self) -> None:
        self._send(self.topic(""), [AllBlocksCleared()])
        interval_ms = int(self.config.interval_seconds * 1000)
        while not self._stop.is_set():
            if self._replay.poll(interval_ms):
                self._publish_pending()  # a replay then covers everything up to now
                self._serve_replay()
            self._publish_pending()

    def _publish_pending(self) -> None:
        try:
            self._pump()
        except Exception as exc:  # the pool closing under a stopping agent
            log.debug("events pump failed: %s", exc)
        events, truncated = self.events.tail(self._after)
        if truncated:  # the node's log overran the stream: its holdings again, whole
            log.warning("KV event stream fell behind the node's events; re-announcing")
            seq, _ = self.events.snapshot()
            for topic, batch in self._holdings():
                self._send(topic, batch)
            self._after = seq
            return
        if not events:
            return
        for namespace, runs in _runs(events):
            self._send(
                self.topic(namespace),
                list(to_kv_events(runs, self.events.owner, self.config.int_block_hashes)),
            )
        self._after = events[-1].seq

    def _holdings(self) -> list[tuple[bytes, list[Any]]]:
        """The node's holdings as batches: AllBlocksCleared, then one per namespace."""
        _, held = self.events.snapshot()
        by_namespace: dict[str, list[tuple[Residency, bool, list[bytes]]]] = {}
        for residency, namespaces in held.items():
            for namespace, keys in namespaces.items():
                if keys:
                    by_namespace.setdefault(namespace, []).append((residency, False, sorted(keys)))
        batches: list[tuple[bytes, list[Any]]] = [(self.topic(""), [AllBlocksCleared()])]
        for namespace, runs in sorted(by_namespace.items()):
            batches.append(
                (
                    self.topic(namespace),
                    list(to_kv_events(runs, self.events.owner, self.config.int_block_hashes)),
                )
            )
        return batches

    def _send(self, topic: bytes, events: list[Any]) -> None:
        self._seq += 1
        payload = self._encode(KVEventBatch(time.time(), events, 0))
        self._pub.send_multipart((topic, self._seq.to_bytes(8, "big"), payload))
        self._buffer.append((self._seq, topic, payload))

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            oldest = self._buffer[0][0] if self._buffer else self._seq + 1
            if first < oldest:  # older than the buffer keeps: the holdings instead
                stamp = self._seq.to_bytes(8, "big")
                for topic, batch in self._holdings():
                    payload = self._encode(KVEventBatch(time.time(), batch, 0))
                    self._replay.send_multipart((client, b"", topic, stamp, payload))
            else:
                for seq, topic, payload in self._buffer:
                    if seq >= first:
                        self._replay.send_multipart(
                            (client, b"", topic, seq.to_bytes(8, "big"), payload)
                        )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
