"""The peer tier: chunks held in other nodes' pools, found without broadcast.

Each key has a home among the live agents (rendezvous hashing over the members the registry
lists, so membership changes move only the keys of the agents that came or went). A write
to this tier is an announcement to the key's home that this agent holds it (soft state that
expires); a lookup asks each home once for a batch of keys; a read fetches the chunk from a
holder, which leases its pool slot while the bytes move. They move over NIXL when both agents
have it (the requester READs the holder's slot into its own; `nixl_path`), else over ZMQ
frames sent from the slot without a copy; every chunk is verified on arrival. A holder lends
at most `maxLentChunks` slots at once and refuses more (a miss for the asker), so an
overloaded node sheds load instead of queueing it. With a CURVE key directory, both ends
authenticate with the cluster's key pair and a peer without it is refused.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.config import PeerTierConfig
from kvtier.agent.host_tier import HostTier
from kvtier.agent.report import Member, Registry
from kvtier.agent.tiers.base import SecondaryTier, TierUsage, check_blob, check_payload
from kvtier.agent.tiers.nixl_path import NixlPath, available

log = logging.getLogger("kvtier.agent.peers")
_RID = struct.Struct("<Q")
HOLDER_CACHE = 65536
CONNECTIONS_PER_PEER = 4
BUSY = b"busy"  # the holder lends too many slots already


class _NixlFailed(Exception):
    """The NIXL transfer did not complete; the chunk is fetched over ZMQ instead."""


class Announce(msgspec.Struct, tag="announce"):
    namespace: str
    keys: list[bytes]
    holder: str  # the holder's peer endpoint


class WhoHas(msgspec.Struct, tag="who_has"):
    namespace: str
    keys: list[bytes]


class Fetch(msgspec.Struct, tag="fetch"):
    namespace: str
    key: bytes


class Holds(msgspec.Struct, tag="holds"):
    """Direct mode: which of these keys does your pool hold?"""

    namespace: str
    keys: list[bytes]


class NixlHello(msgspec.Struct, tag="nixl_hello"):
    """Your NIXL agent metadata, please (empty when you have none)."""


class Lend(msgspec.Struct, tag="lend"):
    """Lease the chunk's slot for a NIXL READ; answered with `Lent`."""

    namespace: str
    key: bytes


class Return(msgspec.Struct, tag="return"):
    lease: int


class Lent(msgspec.Struct):
    lease: int
    address: int
    header: bytes
    agent: str  # the holder's NIXL agent: a restarted holder has a new one


PeerRequest = Announce | WhoHas | Fetch | Holds | NixlHello | Lend | Return
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(PeerRequest).decode
_decode_lent = msgspec.msgpack.Decoder(Lent).decode


def home_of(key: bytes, members: list[str]) -> str:
    """Rendezvous (highest random weight) hashing: the member with the highest
    hash(member, key) is the key's home."""
    return max(members, key=lambda m: hashlib.blake2b(m.encode() + key, digest_size=8).digest())


def load_keys(directory: Path) -> tuple[bytes, bytes]:
    public = (directory / "public.key").read_bytes().strip()
    secret = (directory / "secret.key").read_bytes().strip()
    return public, secret


def write_keys(directory: Path) -> None:
    """A new cluster key pair (what the operator's Secret holds)."""
    public, secret = zmq.curve_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "public.key").write_bytes(public)
    (directory / "secret.key").write_bytes(secret)


def _secure_client(sock: zmq.Socket[bytes], keys: tuple[bytes, bytes] | None) -> None:
    if keys is not None:
        public, secret = keys
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, public


class _OnlyKey:
    def __init__(self, public: bytes) -> None:
        self.public = public  # Z85, as the authenticator hands client keys over

    def callback(self, domain: str, key: bytes) -> bool:
        return bool(key == self.public)


class Directory:
    """This agent's share of the cluster-wide index: who holds the keys homed here."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._holders: dict[tuple[str, bytes], dict[str, float]] = {}

    def announce(self, namespace: str, keys: list[bytes], holder: str) -> None:
        expiry = time.monotonic() + self.ttl
        with self._lock:
            for key in keys:
                self._holders.setdefault((namespace, key), {})[holder] = expiry

    def holders(self, namespace: str, keys: list[bytes]) -> list[str]:
        now = time.monotonic()
        found = []
        with self._lock:
            for key in keys:
                live = {h: t for h, t in self._holders.get((namespace, key), {}).items() if t > now}
                found.append(next(iter(live), ""))
        return found

    def forget(self, holder: str) -> None:
        with self._lock:
            for holders in self._holders.values():
                holders.pop(holder, None)


class PeerServer:
    """Serves other agents: directory requests and chunks from this agent's pool."""

    def __init__(self, config: PeerTierConfig, host: HostTier) -> None:
        self.config = config
        self.host = host
        self.directory = Directory(config.announce_ttl_seconds)
        self.nixl: NixlPath | None = None
        if config.data_path == "nixl" or (config.data_path == "auto" and available()):
            name = f"kvtier-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
            self.nixl = NixlPath(name, host.pool)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._auth: ThreadAuthenticator | None = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if config.curve_key_dir is not None:
            public, secret = load_keys(config.curve_key_dir)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            # Only clients presenting the cluster's own public key (so holding its secret
            # key, or the handshake fails) are let in.
            self._auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(public))
            self._sock.curve_server = True
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
        self._sock.bind(config.bind)
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if "0.0.0.0" in bound:  # listening everywhere: advertise the pod's (or host's) address
            bound = bound.replace("0.0.0.0", os.environ.get("POD_IP") or socket.gethostname())
        self.endpoint = config.advertise or bound
        # Slots lent out: NIXL leases until returned (or expired), ZMQ sends until sent.
        self._lent: dict[int, float] = {}
        self._sending: list[tuple[zmq.MessageTracker, int]] = []
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-peers", daemon=True)
        self._thread.start()

    def lent(self) -> int:
        return len(self._lent) + len(self._sending)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            ready = poller.poll(200 if not self.lent() else 5)
            self._settle()
            if not ready:
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            identity, rid, body = frames
            try:
                request = _decode(body)
            except msgspec.DecodeError:
                continue
            reply = self._handle(request)
            if reply:
                self._sock.send_multipart([identity, rid, *reply])
            elif reply is None and isinstance(request, Fetch):
                self._send_chunk(identity, rid, request)

    def _handle(self, request: PeerRequest) -> list[bytes] | None:
        """The reply frames to a request (an empty list for one-way messages); None for a
        fetch, which `_send_chunk` answers from the slot."""
        if isinstance(request, Announce):
            self.directory.announce(request.namespace, request.keys, request.holder)
            return []
        if isinstance(request, WhoHas):
            return [_encode(self.directory.holders(request.namespace, request.keys))]
        if isinstance(request, Holds):
            missing = set(self.host.missing(request.namespace, request.keys))
            return [_encode([key not in missing for key in request.keys])]
        if isinstance(request, NixlHello):
            return [self.nixl.metadata if self.nixl is not None else b""]
        if isinstance(request, Return):
            if self._lent.pop(request.lease, None) is not None:
                self.host.end_load(request.lease)
            return []
        if isinstance(request, Lend):
            return [self._lend(request.namespace, request.key)]
        return None

    def _busy(self) -> bool:
        if self.lent() < self.config.max_lent_chunks:
            return False
        self.refused += 1
        return True

    def _lend(self, namespace: str, key: bytes) -> bytes:
        if self.nixl is None:
            return b""
        if self._busy():
            return BUSY
        chunk = self._lease_chunk(namespace, key)
        if chunk is None:
            return b""
        lease, slot, header = chunk
        self._lent[lease] = time.monotonic() + 2 * self.config.timeout_seconds
        address = self.nixl.base + self.host.pool.geometry.payload_offset(slot)
        return _encode(Lent(lease, address, header.page(), self.nixl.name))

    def _send_chunk(self, identity: bytes, rid: bytes, request: Fetch) -> None:
        if self._busy():
            self._sock.send_multipart([identity, rid, BUSY])
            return
        chunk = self._lease_chunk(request.namespace, request.key)
        if chunk is None:
            self._sock.send_multipart([identity, rid, b""])
            return
        lease, slot, header = chunk
        payload = self.host.pool.payload(slot, header.length).data
        # Sent from the slot itself; the lease ends once ZMQ is done with the bytes.
        tracker = self._sock.send_multipart(
            [identity, rid, header.page(), payload], copy=False, track=True
        )
        assert tracker is not None
        self._sending.append((tracker, lease))

    def _lease_chunk(self, namespace: str, key: bytes) -> tuple[int, int, ChunkHeader] | None:
        """Lease a chunk's slot: (lease, slot, header). A chunk not sealed yet has no
        checksum to send and is not served."""
        host = self.host
        lease, slots = host.begin_load("kvtier-peer", namespace, [key])
        if slots[0] < 0:
            return None
        with host.lock:
            entry = host.index.get(namespace, key)
            header = entry.header() if entry is not None and entry.checksum is not None else None
        if header is None:
            host.end_load(lease)
            return None
        return lease, slots[0], header

    def _settle(self) -> None:
        """End the leases of finished sends and of loans not returned in time."""
        still = []
        for tracker, lease in self._sending:
            if tracker.done:
                self.host.end_load(lease)
            else:
                still.append((tracker, lease))
        self._sending = still
        now = time.monotonic()
        for lease in [lease for lease, deadline in self._lent.items() if deadline < now]:
            del self._lent[lease]
            self.host.end_load(lease)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self.nixl is not None:
            self.nixl.close()


class _Connection:
    """A request/reply channel to one peer, shared by threads (one request at a time)."""

    def __init__(self, endpoint: str, keys: tuple[bytes, bytes] | None, timeout: float) -> None:
        self.endpoint = endpoint
        self._keys = keys
        self._timeout_ms = int(timeout * 1000)
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._sock: zmq.Socket[bytes] | None = None

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            _secure_client(sock, self._keys)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def send(self, message: msgspec.Struct) -> None:
        with self._lock, contextlib.suppress(zmq.Again):
            self._socket().send_multipart([b"\0" * 8, _encode(message)], flags=zmq.NOBLOCK)

    def call(self, message: msgspec.Struct) -> list[memoryview] | None:
        """Frames of the reply after the request id, as received (not copied); None when
        the peer did not answer."""
        with self._lock:
            sock = self._socket()
            rid = _RID.pack(next(self._rids))
            sock.send_multipart([rid, _encode(message)])
            while sock.poll(self._timeout_ms):
                frames = sock.recv_multipart(copy=False)
                if frames[0].bytes == rid:
                    return [frame.buffer for frame in frames[1:]]
            sock.close(linger=0)  # drop whatever arrives late
            self._sock = None
            return None


class PeerTier(SecondaryTier):
    kind = "peer"

    def __init__(
        self, name: str, config: PeerTierConfig, registry: Registry, server: PeerServer
    ) -> None:
        super().__init__(name)
        self.config = config
        self.registry = registry
        self.server = server
        self.me = server.endpoint
        self._keys = load_keys(config.curve_key_dir) if config.curve_key_dir else None
        self._connections: dict[str, list[_Connection]] = {}
        self._turn = 0
        self._lock = threading.Lock()
        # Where recently found keys live, bounded: only the next read needs it.
        self._holder: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._members: list[str] = [self.me]
        self._members_at = 0.0
        self._advertised: dict[str, bytes] = {}  # peer endpoint -> its NIXL metadata
        self._nixl_names: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    def _peer(self, endpoint: str) -> _Connection:
        """One of a few connections to the peer, in turn: promotions of one request run in
        parallel instead of queueing behind one socket."""
        with self._lock:
            pool = self._connections.get(endpoint)
            if pool is None:
                pool = self._connections[endpoint] = [
                    _Connection(endpoint, self._keys, self.config.timeout_seconds)
                    for _ in range(CONNECTIONS_PER_PEER)
                ]
            self._turn += 1
            return pool[self._turn % len(pool)]

    def live_members(self) -> list[str]:
        """Agents with a fresh heartbeat (re-read every `membershipSeconds`: with the
        Kubernetes registry that is one LIST per agent per period)."""
        now = time.monotonic()
        if now - self._members_at > self.config.membership_seconds:
            cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=3 * 10)
            found: list[Member] = self.registry.members()
            fresh = [m for m in found if m.heartbeat is None or m.heartbeat > cutoff]
            live = {m.endpoint for m in fresh}
            self._advertised.update({m.endpoint: m.nixl for m in fresh if m.nixl})
            self._members = sorted(live | {self.me})
            self._members_at = now
        return self._members

    def peers(self) -> list[str]:
        """The other live agents' peer endpoints (as last read)."""
        return [m for m in self._members if m != self.me]

    # --- SecondaryTier ----------------------------------------------------------------------

    def write(self, header: ChunkHeader, payload: memoryview) -> None:
        """Tell the key's home that this agent holds the chunk; no bytes move."""
        home = home_of(header.key, self.live_members())
        if home == self.me:
            self.server.directory.announce(header.namespace, [header.key], self.me)
        else:
            self._peer(home).send(Announce(header.namespace, [header.key], self.me))

    def ask_source(self, source: str, namespace: str, keys: list[bytes]) -> None:
        """Direct mode: remember `source` as the holder of the keys it says it holds, so
        lookups and reads go straight to it (no directory involved)."""
        if source == self.me:
            return
        reply = self._peer(source).call(Holds(namespace, keys))
        if reply:
            for key, held in zip(keys, msgspec.msgpack.decode(reply[0]), strict=True):
                if held:
                    self._holder[(namespace, key)] = source

    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        found = [(namespace, key) in self._holder for key in keys]  # known holders first
        members = self.live_members()
        by_home: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            if not found[i]:
                by_home.setdefault(home_of(key, members), []).append(i)
        for home, indexes in by_home.items():
            batch = [keys[i] for i in indexes]
            if home == self.me:
                holders = self.server.directory.holders(namespace, batch)
            else:
                reply = self._peer(home).call(WhoHas(namespace, batch))
                holders = msgspec.msgpack.decode(reply[0]) if reply else [""] * len(batch)
            for i, holder in zip(indexes, holders, strict=True):
                if holder and holder != self.me:
                    self._holder[(namespace, keys[i])] = holder
                    found[i] = True
        while len(self._holder) > HOLDER_CACHE:
            self._holder.popitem(last=False)
        return found

    def read_into(self, namespace: str, key: bytes, out: memoryview) -> ChunkHeader | None:
        holder = self._holder.get((namespace, key))
        if holder is None:
            if not self.exists(namespace, [key])[0]:
                return None
            holder = self._holder[(namespace, key)]
        remote = self._nixl_agent(holder)
        if remote:
            try:
                return self._read_nixl(holder, remote, namespace, key, out)
            except _NixlFailed:
                self._count("nixl_failures")
        return self._read_zmq(holder, namespace, key, out)

    def _nixl_agent(self, endpoint: str) -> str:
        """The holder's NIXL agent name ("" when either side has no NIXL), learnt from its
        registry record or, failing that, by asking it once."""
        nixl = self.server.nixl
        if nixl is None:
            return ""
        known = self._nixl_names.get(endpoint)
        if known is None:
            metadata = self._advertised.get(endpoint)
            if metadata is None:
                reply = self._peer(endpoint).call(NixlHello())
                if reply is None:
                    return ""
                metadata = bytes(reply[0])
            known = self._nixl_names[endpoint] = nixl.add_remote(metadata) if metadata else ""
        return known

    def _read_nixl(
        self, holder: str, remote: str, namespace: str, key: bytes, out: memoryview
    ) -> ChunkHeader | None:
        """A READ from the holder's lent slot."""
        assert self.server.nixl is not None
        connection = self._peer(holder)
        reply = connection.call(Lend(namespace, key))
        if not self._answered(reply, namespace, key):
            return None
        assert reply is not None
        lent = _decode_lent(reply[0])
        if lent.agent != remote:  # the holder restarted: learn its new NIXL agent
            self._advertised.pop(holder, None)
            self._forget_nixl(holder)
            remote = self._nixl_agent(holder)
        try:
            if lent.agent != remote:
                raise _NixlFailed
            header = check_blob(lent.header, namespace, key, len(out))
            moved = self.server.nixl.read(
                remote, lent.address, out, header.length, self.config.timeout_seconds
            )
        finally:
            connection.send(Return(lent.lease))
        if not moved:
            raise _NixlFailed
        check_payload(header, out)
        self._count("nixl_reads")
        return header

    def _read_zmq(
        self, holder: str, namespace: str, key: bytes, out: memoryview
    ) -> ChunkHeader | None:
        reply = self._peer(holder).call(Fetch(namespace, key))
        if not self._answered(reply, namespace, key) or reply is None or len(reply) != 2:
            return None
        header = check_blob(reply[0], namespace, key, len(out))
        out[: header.length] = reply[1][: header.length]
        check_payload(header, out)
        self._count("zmq_reads")
        return header

    def _answered(self, reply: list[memoryview] | None, namespace: str, key: bytes) -> bool:
        """Whether the holder sent the chunk; a busy holder keeps its place, one that did
        not answer or no longer holds the key is forgotten as this key's holder."""
        if reply and reply[0] == BUSY:
            self._count("busy")
            return False
        if not reply or not reply[0]:
            self._holder.pop((namespace, key), None)
            return False
        return True

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + 1

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "lent": self.server.lent(), "refused": self.server.refused}

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, len(self._holder))

    def _forget_nixl(self, endpoint: str) -> None:
        name = self._nixl_names.pop(endpoint, "")
        if name and self.server.nixl is not None:
            self.server.nixl.forget(name)

    def maintain(self) -> int:
        live = set(self.live_members())
        for endpoint in list(self._connections):
            if endpoint not in live:
                self.server.directory.forget(endpoint)
                self._forget_nixl(endpoint)
        return 0
