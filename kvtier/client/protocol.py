"""The local control protocol between clients (vLLM plug-ins, tools) and the node agent.

Messages are msgspec structs encoded as msgpack, sent over a ZMQ DEALER/ROUTER pair on an
ipc socket as two frames: an 8-byte request id, so a client that timed out can tell a late
reply from the one it waits for, and the body. Requests whose outcome the client does not
need (Abort, EndLoad, Looked) go one-way with the id ONE_WAY and get no reply, so a load costs one
round trip; a store costs two (Allocate, Commit), so that a finished store is visible to
every client at once. Chunk bytes never travel here: both sides map the same files (the
pool, read-only to clients, and the staging area clients write stores into) and the
messages carry slot numbers. This module imports
only msgspec, because the vLLM plug-in imports it.

A client is bound to its connection: its first message is Hello, and the agent refuses
anything else from a connection that has not said hello to this agent process (code
NOT_REGISTERED), so a client whose socket silently reconnected to a restarted agent learns
it before its stale leases can do harm. Every field is bounded here, and decoding checks
the bounds, so a malformed or oversized request is refused before it touches any state.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated

import msgspec

from kvtier.api.pool_layout import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES
from kvtier.api.stats import AgentStats

# 2: connection-bound clients, lease generations, error codes
# 3: the published index (clients answer pool lookups themselves) and Looked reports; the
#    pool read-only to clients, stores written into a staging area (LeaseReply.staging)
# 4: the stats reply typed (stats.AgentStats) instead of a free-form mapping
# A field added with a default keeps the version (the agent refuses a Hello of another
# one, so a bump parts every deployed plug-in from every new agent): a peer that predates
# the field ignores it, and the other side reads its absence as the old behaviour. So
# Allocate.parents, and Allocate.status with LeaseReply.status (a store's outcome per key
# out of band; an agent that predates them answers with StoreCode in `slots`).
PROTOCOL_VERSION = 4
ONE_WAY = b"\0" * 8
MAX_MESSAGE_BYTES = 16 << 20
MAX_KEYS = 65536


class StoreStatus(IntEnum):
    """Allocate's outcome for each key (LeaseReply.status)."""

    GRANTED = 0  # a slot to store it into
    EXISTS = 1  # already held: the store is a duplicate and is skipped
    BUSY = 2  # another client is writing it right now
    FULL = 3  # every slot is pinned; nothing could be evicted
    STAGING_FULL = 4  # no staging slot free right now: store it again once earlier stores end


class StoreCode(IntEnum):
    """The same outcomes in band, as negative slot numbers: how the host index answers,
    and what a client that does not ask for LeaseReply.status reads in `slots`."""

    EXISTS = -StoreStatus.EXISTS
    BUSY = -StoreStatus.BUSY
    FULL = -StoreStatus.FULL
    STAGING_FULL = -StoreStatus.STAGING_FULL


NO_SLOT = -1  # LeaseReply.slots of a key given none, where the reply carries `status`


def store_status(slots: list[int]) -> list[int]:
    """In-band answers (a slot, or a StoreCode) as each key's StoreStatus."""
    return [StoreStatus.GRANTED if slot >= 0 else StoreStatus(-slot) for slot in slots]


def granted_slots(slots: list[int]) -> list[int]:
    """In-band answers with every code replaced by NO_SLOT."""
    return [slot if slot >= 0 else NO_SLOT for slot in slots]


class Where(IntEnum):
    """Where a lookup or a load found a key, when not in a tier (0 is the host pool, 1.. the
    secondary tiers in order; a load's slot is >= 0)."""

    MISS = -1


# Error codes of ErrorReply.
NOT_REGISTERED = "not_registered"  # say Hello on this connection first
LEASE = "lease"  # the lease is unknown, expired, of another client, or of the wrong kind
INVALID = "invalid"  # the request itself is malformed or out of bounds

ClientId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
LockName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.lock$")]
Namespace = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAMESPACE_BYTES)]
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Source = Annotated[str, msgspec.Meta(max_length=512)]
LeaseId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
U64Int = Annotated[int, msgspec.Meta(ge=0)]  # bounds stop at int64; msgpack holds uint64


class Hello(msgspec.Struct, tag="hello"):
    """First message of a client on a connection: `lock` is a file in the agent's `clients/`
    directory that the client holds an flock on for its lifetime; a lock that can be taken
    means the client is gone (this works across PID namespaces, unlike PIDs), so its leases
    are reclaimed."""

    client: ClientId
    lock: LockName
    protocol: int = PROTOCOL_VERSION


class Lookup(msgspec.Struct, tag="lookup"):
    """`source`, when set, is the peer endpoint of the agent known to hold the chunks (the
    prefill side in prefill/decode disaggregation): it is asked directly. `digests`, where
    the client has them from its own look in the published index: the keys' index digests
    (u64 little-endian, one per key), so the agent does not compute them again. A digest
    that is not its key's finds nothing: the index confirms every candidate by its key."""

    namespace: Namespace
    keys: Keys
    source: Source = ""
    digests: bytes = b""


class Looked(msgspec.Struct, tag="looked"):
    """One-way: lookups a client answered itself from the published index (shm/table.py).
    `digests` holds the looked-up keys' index digests (u64 little-endian), request after
    request, `sizes` how many keys each request had, in the order it asked for them. The
    agent counts hits and misses, refreshes the recency of the hits and logs each request,
    as if it had answered them. Digests, not keys: 8 bytes a key to encode and send, and
    the agent finds the hits by digest in its own copy of the table."""

    namespace: Namespace
    digests: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_KEYS * 16)]
    sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_KEYS)]
    # bytes the client loaded straight from the pool, found in the published index, since
    # its last report (such loads take no lease: see AgentClient.load_into)
    loaded_bytes: Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)] = 0


class Allocate(msgspec.Struct, tag="allocate"):
    namespace: Namespace
    keys: Keys
    nbytes: Annotated[int, msgspec.Meta(ge=1, lt=1 << 62)]
    # Each key's predecessor in its request where the client knows it (for the `prefix`
    # policy); an agent that predates the field ignores it, and its absence means none.
    parents: Annotated[list[Key | None], msgspec.Meta(max_length=MAX_KEYS)] | None = None
    # Answer each key's outcome in LeaseReply.status (and NO_SLOT in `slots` where there is
    # no slot) instead of StoreCode in `slots`; an agent that predates the field ignores it.
    status: bool = False


class Commit(msgspec.Struct, tag="commit"):
    lease: LeaseId
    # The staging sum (shm/pool.py: copy_summed) of each granted key's row as the client
    # staged it, in the grant's order: the agent publishes only copies with the same sum.
    # An agent that predates the field ignores it; without it the agent publishes what it
    # finds staged.
    sums: Annotated[list[U64Int], msgspec.Meta(max_length=MAX_KEYS)] | None = None
    # Each sum's kind, one byte per sum (shm/pool.py: SUM_LANES, SUM_CRC32), sent only to an
    # agent whose HelloReply.sums names "crc32"; empty: every sum is a lane sum.
    kinds: Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS)] = b""


class Abort(msgspec.Struct, tag="abort"):
    lease: LeaseId


class BeginLoad(msgspec.Struct, tag="begin_load"):
    namespace: Namespace
    keys: Keys
    source: Source = ""  # as in Lookup


class EndLoad(msgspec.Struct, tag="end_load"):
    lease: LeaseId


class Stats(msgspec.Struct, tag="stats"):
    pass


class Events(msgspec.Struct, tag="events"):
    """Chunks of a namespace stored into or evicted from the pool since sequence `after`."""

    namespace: Namespace
    after: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class AccessLog(msgspec.Struct, tag="access_log"):
    """A page of the agent's access log: requests logged after sequence `after`
    (access_log.py; `kvtier trace` pages through it)."""

    after: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


Request = (
    Hello
    | Lookup
    | Looked
    | Allocate
    | Commit
    | Abort
    | BeginLoad
    | EndLoad
    | Stats
    | Events
    | AccessLog
)


class HelloReply(msgspec.Struct, tag="hello_reply"):
    """`boot` identifies this agent process: lease ids and slot generations carry it, so
    none granted by an earlier process can match one of this one's."""

    pool: str
    payload_bytes: int
    slot_count: int
    lease_timeout_seconds: float
    agent_version: str
    tiers: list[str] = []
    protocol: int = PROTOCOL_VERSION
    boot: int = 0
    # staging sums it checks besides lane sums (Commit.kinds); an agent that predates the
    # field checks lane sums only
    sums: list[str] = []


class LookupReply(msgspec.Struct, tag="lookup_reply"):
    """`where[i]`: 0 when key i is in the pool, n when secondary tier n (1-based, in
    HelloReply.tiers order) holds it, -1 when no tier does."""

    hits: list[bool]
    prefix: int
    where: list[int] = []


class LeaseReply(msgspec.Struct, tag="lease_reply"):
    """Answer to Allocate and BeginLoad: a slot per key, or a negative number where there is
    none (a load's: Where.MISS; a store's: see `status`). `lease` is 0 when no slot was
    granted. `generations[i]` is the stamp slot i carries while the grant holds (see
    shm/pool.py): a reader whose copy ends with another stamp in the slot copied bytes
    that were no longer its chunk's."""

    lease: int
    slots: list[int]
    where: list[int] = []  # BeginLoad: where each granted chunk came from, as in LookupReply
    generations: list[int] = []
    # Allocate: the staging slot to write key i into (-1 for none); the pool is read-only
    # to clients, and Commit copies the staged chunks into their pool slots.
    staging: list[int] = []
    # Allocate asked with `status`: each key's StoreStatus, and `slots[i]` NO_SLOT where
    # it is not GRANTED; asked without, a key given no slot has its StoreCode in `slots`.
    status: list[int] = []


class Ack(msgspec.Struct, tag="ack"):
    pass


class StatsReply(msgspec.Struct, tag="stats_reply"):
    stats: AgentStats


class EventRun(msgspec.Struct, array_like=True):
    """Consecutive events of one residency: vLLM's medium (CPU, STORAGE) and locality
    (LOCAL, REMOTE), stored or removed."""

    medium: str
    locality: str
    removed: bool
    keys: list[bytes]


class EventsReply(msgspec.Struct, tag="events_reply"):
    seq: int
    stored: list[bytes]  # the pool's alone, for plug-ins that read no runs
    evicted: list[bytes]
    truncated: bool
    # every tier's events in order (agents that send none: read stored/evicted)
    runs: list[EventRun] = []
    owner: str = ""  # the node: every engine on it shares what it holds
    boot: int = 0  # the agent process; a new one numbers its events afresh


class LoggedRequest(msgspec.Struct, array_like=True):
    seq: int
    time: float  # seconds since the epoch
    ids: list[int]  # the keys' 64-bit digests, in request order
    hits: int


class AccessLogReply(msgspec.Struct, tag="access_log_reply"):
    """`next`: the sequence to ask after for the following page; `dropped`: sampled requests
    the bounded log has let go since the agent started."""

    requests: list[LoggedRequest]
    next: int
    more: bool
    sample_rate: float
    dropped: int


class ErrorReply(msgspec.Struct, tag="error"):
    message: str
    code: str = INVALID


def check(request: Request) -> None:
    """Bounds msgspec cannot state (namespaces are limited in encoded bytes, as the chunk
    header stores them); raises ValueError."""
    namespace = getattr(request, "namespace", None)
    if namespace is not None and len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"namespace is longer than {MAX_NAMESPACE_BYTES} bytes")
    if isinstance(request, Looked) and 8 * sum(request.sizes) != len(request.digests):
        raise ValueError("a Looked report's sizes do not add up to its digests")
    if (
        isinstance(request, Lookup)
        and request.digests
        and 8 * len(request.keys) != len(request.digests)
    ):
        raise ValueError("a Lookup's digests must be 8 bytes a key, or none")


Reply = (
    HelloReply
    | LookupReply
    | LeaseReply
    | Ack
    | StatsReply
    | EventsReply
    | AccessLogReply
    | ErrorReply
)

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
