"""The peer tier: chunks held in other nodes' pools, found without broadcast.

Each key has a home among the live agents (rendezvous hashing over the members the registry
lists, so membership changes move only the keys of the agents that came or went). A write
to this tier is an announcement to the key's home that this agent holds it (soft state that
expires); a lookup asks each home once for a batch of keys; a read fetches the chunk from a
holder, which leases its pool slot while sending. Data moves over ZMQ (the NIXL path is not
built yet); every chunk is verified on arrival. With a CURVE key directory, both ends
authenticate with the cluster's key pair and a peer without it is refused.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
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

log = logging.getLogger("kvtier.agent.peers")
_RID = struct.Struct("<Q")
HOLDER_CACHE = 65536
CONNECTIONS_PER_PEER = 4


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


PeerRequest = Announce | WhoHas | Fetch | Holds
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(PeerRequest).decode


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
    """Serves other agents: directory requests and chunk fetches from this agent's pool."""

    def __init__(self, config: PeerTierConfig, host: HostTier) -> None:
        self.config = config
        self.host = host
        self.directory = Directory(config.announce_ttl_seconds)
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-peers", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            identity, rid, body = frames
            try:
                request = _decode(body)
            except msgspec.DecodeError:
                continue
            if isinstance(request, Announce):
                self.directory.announce(request.namespace, request.keys, request.holder)
            elif isinstance(request, WhoHas):
                holders = self.directory.holders(request.namespace, request.keys)
                self._sock.send_multipart([identity, rid, _encode(holders)])
            elif isinstance(request, Holds):
                missing = set(self.host.missing(request.namespace, request.keys))
                held = [key not in missing for key in request.keys]
                self._sock.send_multipart([identity, rid, _encode(held)])
            else:
                chunk = self._read_chunk(request.namespace, request.key)
                if chunk is None:
                    self._sock.send_multipart([identity, rid, b""])
                    continue
                header, payload, release = chunk
                try:
                    self._sock.send_multipart([identity, rid, header, payload])  # copies
                finally:
                    release()

    def _read_chunk(
        self, namespace: str, key: bytes
    ) -> tuple[bytes, memoryview, Callable[[], None]] | None:
        """A fetch: lease the slot, hand out the header page and the bytes, and the release.
        A chunk not sealed yet has no checksum to send and is not served."""
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
        payload = host.pool.payload(slots[0], header.length).data
        return header.page(), payload, lambda: host.end_load(lease)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()


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

    def call(self, message: msgspec.Struct) -> list[bytes] | None:
        """Frames of the reply after the request id; None when the peer did not answer."""
        with self._lock:
            sock = self._socket()
            rid = _RID.pack(next(self._rids))
            sock.send_multipart([rid, _encode(message)])
            while sock.poll(self._timeout_ms):
                frames = sock.recv_multipart()
                if frames[0] == rid:
                    return frames[1:]
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
            live = {m.endpoint for m in found if m.heartbeat is None or m.heartbeat > cutoff}
            self._members = sorted(live | {self.me})
            self._members_at = now
        return self._members

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
        reply = self._peer(holder).call(Fetch(namespace, key))
        if not reply or len(reply) != 2:
            self._holder.pop((namespace, key), None)
            return None
        header = check_blob(reply[0], namespace, key, len(out))
        data = memoryview(reply[1])
        out[: header.length] = data[: header.length]
        check_payload(header, out)
        return header

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, len(self._holder))

    def maintain(self) -> int:
        live = set(self.live_members())
        for endpoint in list(self._connections):
            if endpoint not in live:
                self.server.directory.forget(endpoint)
        return 0
