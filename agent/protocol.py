"""The local control protocol between clients (vLLM plug-ins, tools) and the node agent.

Messages are msgspec structs encoded as msgpack, sent over a ZMQ DEALER/ROUTER pair on an
ipc socket as two frames: an 8-byte request id, so a client that timed out can tell a late
reply from the one it waits for, and the body. Requests whose outcome the client does not
need (Abort, EndLoad) go one-way with the id ONE_WAY and get no reply, so a load costs one
round trip; a store costs two (Allocate, Commit), so that a finished store is visible to
every client at once. Chunk bytes never travel here:
both sides map the same pool file and the messages carry slot numbers. This module imports
only msgspec, because the vLLM plug-in imports it.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
ONE_WAY = b"\0" * 8


class Hello(msgspec.Struct, tag="hello"):
    """First message of a client: `lock` is a file in the agent's `clients/` directory that
    the client holds an flock on for its lifetime; a lock that can be taken means the client
    is gone (this works across PID namespaces, unlike PIDs), so its leases are reclaimed."""

    client: str
    lock: str
    protocol: int = PROTOCOL_VERSION


class Lookup(msgspec.Struct, tag="lookup"):
    """`source`, when set, is the peer endpoint of the agent known to hold the chunks (the
    prefill side in prefill/decode disaggregation): it is asked directly."""

    namespace: str
    keys: list[bytes]
    source: str = ""


class Allocate(msgspec.Struct, tag="allocate"):
    client: str
    namespace: str
    keys: list[bytes]
    nbytes: int


class Commit(msgspec.Struct, tag="commit"):
    lease: int


class Abort(msgspec.Struct, tag="abort"):
    lease: int


class BeginLoad(msgspec.Struct, tag="begin_load"):
    client: str
    namespace: str
    keys: list[bytes]
    source: str = ""  # as in Lookup


class EndLoad(msgspec.Struct, tag="end_load"):
    lease: int


class Stats(msgspec.Struct, tag="stats"):
    pass


class Events(msgspec.Struct, tag="events"):
    """Chunks of a namespace stored into or evicted from the pool since sequence `after`."""

    namespace: str
    after: int


Request = Hello | Lookup | Allocate | Commit | Abort | BeginLoad | EndLoad | Stats | Events


class HelloReply(msgspec.Struct, tag="hello_reply"):
    pool: str
    payload_bytes: int
    slot_count: int
    lease_timeout_seconds: float
    agent_version: str
    tiers: list[str] = []
    protocol: int = PROTOCOL_VERSION


class LookupReply(msgspec.Struct, tag="lookup_reply"):
    """`where[i]`: 0 when key i is in the pool, n when secondary tier n (1-based, in
    HelloReply.tiers order) holds it, -1 when no tier does."""

    hits: list[bool]
    prefix: int
    where: list[int] = []


class LeaseReply(msgspec.Struct, tag="lease_reply"):
    """Answer to Allocate and BeginLoad: a slot per key, or a negative code (see index.py).
    `lease` is 0 when no slot was granted."""

    lease: int
    slots: list[int]
    where: list[int] = []  # BeginLoad: where each granted chunk came from, as in LookupReply


class Ack(msgspec.Struct, tag="ack"):
    pass


class StatsReply(msgspec.Struct, tag="stats_reply"):
    stats: dict[str, object]


class EventsReply(msgspec.Struct, tag="events_reply"):
    seq: int
    stored: list[bytes]
    evicted: list[bytes]
    truncated: bool


class ErrorReply(msgspec.Struct, tag="error"):
    message: str


Reply = HelloReply | LookupReply | LeaseReply | Ack | StatsReply | EventsReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
