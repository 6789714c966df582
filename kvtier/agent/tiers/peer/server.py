"""The serving side of the peer tier: directory requests from other agents, and chunks
lent from this agent's pool (NIXL loans, the stream, or ZMQ frames sent from the
slot), at most `maxLentChunks` at once."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.host.tier import LENDER, HostTier
from kvtier.agent.report.registry import Registry
from kvtier.agent.tiers.nixl_path import NixlPath, available
from kvtier.agent.tiers.peer.directory import Directory
from kvtier.agent.tiers.peer.membership import Membership
from kvtier.agent.tiers.peer.stream import TICKET, StreamServer
from kvtier.agent.tiers.peer.wire import (
    Announce,
    Answer,
    Damaged,
    Fetch,
    Holds,
    Lend,
    Lent,
    Loan,
    NixlHello,
    PeerRequest,
    Return,
    Stream,
    Streamed,
    TrustedKeys,
    WhoHas,
    Withdraw,
    bind_on_pod_address,
    context,
    decode,
    encode,
    load_keys,
)
from kvtier.api.config import PeerTierConfig

log = logging.getLogger("kvtier.agent.peers")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class PeerServer:
    """Serves other agents: directory requests and chunks from this agent's pool."""

    def __init__(
        self, config: PeerTierConfig, host: HostTier, registry: Registry, stale_after: float
    ) -> None:
        """`registry`: where the tier's members are listed; `stale_after`: seconds without a
        heartbeat after which a member counts as gone."""
        self.config = config
        self.host = host
        self.directory = Directory(config.announce_ttl_seconds)
        self.nixl: NixlPath | None = None
        # NIXL moves bytes in the clear: a tier that encrypts them never registers it.
        wanted = config.data_path == "nixl" or (config.data_path == "auto" and available())
        if wanted and not config.encrypt_bytes:
            name = f"kvtier-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
            self.nixl = NixlPath(name, host.pool)
        self._ctx = context()
        self._auth: ThreadAuthenticator | None = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.keys = load_keys(config.curve_key_dir) if config.curve_key_dir else None
        self._trusted: TrustedKeys | None = None
        if self.keys is not None:
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            # Only clients presenting a trusted public key (and holding its secret key, or
            # the handshake fails) are let in.
            self._trusted = TrustedKeys(self.keys.trusted)
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._trusted)
            self._sock.curve_server = True
            self._sock.curve_publickey = self.keys.public
            self._sock.curve_secretkey = self.keys.secret
        # bound whatever is advertised: `advertise` only changes what peers are told to dial
        bound_endpoint = bind_on_pod_address(self._sock, config.bind)
        self.endpoint = config.advertise or bound_endpoint
        self.stream: StreamServer | None = None
        if config.data_path != "zmq":
            # on the address the peer socket bound (the pod's, where POD_IP names it)
            bound = urlsplit(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
            listen = bound.hostname if bound.hostname not in (None, "*") else "0.0.0.0"
            self.stream = StreamServer(listen, config.stream_port or 0, config.idle_seconds)
        # Slots lent out: NIXL loans until returned (or expired), ZMQ sends until sent.
        self._loans: dict[int, tuple[float, int, Any]] = {}  # lease -> (deadline, slots, reg)
        self._sending: list[tuple[zmq.MessageTracker, int, int]] = []  # (tracker, lease, slots)
        self.refused = 0
        self.refused_requests = 0  # naming a non-member, or a non-member's request
        # Who may ask and be named here: the tier's members, which the peer tier follows too.
        self.membership = Membership(
            self.endpoint, registry, self.keys, stale_after, config.membership_seconds
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-peers", daemon=True)
        self._thread.start()

    @property
    def curve_key(self) -> str | None:
        """The public key this endpoint serves with, published so peers know what to dial
        (they do only when they trust it)."""
        return self.keys.public.decode() if self.keys is not None else None

    @property
    def refused_handshakes(self) -> int:
        """Peers that presented an untrusted key."""
        return self._trusted.refused if self._trusted is not None else 0

    def lent(self) -> int:
        """Slots lent to peers right now (also read by the metrics thread: copies only)."""
        loans = list(self._loans.values())
        streams = self.stream.lent() if self.stream is not None else 0
        return sum(n for _, n, _ in loans) + sum(n for _, _, n in list(self._sending)) + streams

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            # While NIXL loans are out the backend is progressed without pause: over UCX's
            # TCP transport the holder's side serves the READs in software, and a pause
            # here is a stall of the transfer (over RDMA or shared memory it costs nothing).
            busy = self._sending or self.nixl or (self.stream and self.stream.lent())
            wait = 1 if self._loans else 5 if busy else 200
            ready = poller.poll(wait)
            self._settle()
            if self.nixl is not None:
                self.nixl.progress()
            if not ready:
                continue
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) != 3:
                continue
            identity, rid, body = (frame.bytes for frame in frames)
            try:
                request = decode(body)
            except msgspec.DecodeError:
                continue
            if isinstance(request, Fetch):
                self._send_chunks(identity, rid, request)
                continue
            if isinstance(request, NixlHello) and not self._from_member(
                request.asker, str(frames[2].get("Peer-Address"))
            ):
                self._refuse(f"NIXL metadata asked for by {request.asker[:200]!r}")
                self._sock.send_multipart([identity, rid, b"", Answer.REFUSED.encode()])
                continue
            reply = self._handle(request)
            if reply is not None:
                self._sock.send_multipart([identity, rid, reply])

    def _from_member(self, endpoint: str, address: str) -> bool:
        """Whether `endpoint` is a live member of the tier and the request came from its
        host (the connection's address), so a keyed process cannot pass as another agent."""
        if not self.membership.is_member(endpoint):
            return False
        host = urlsplit(endpoint).hostname if endpoint.startswith("tcp://") else None
        return host is None or host == address or not _is_ip(host)

    def _refuse(self, what: str) -> None:
        self.refused_requests += 1
        log.warning("peer request refused: %s", what)

    def _handle(self, request: PeerRequest) -> bytes | None:
        """The reply to a request; None for one-way messages. Entries naming a holder that is
        not a live member are refused (nobody is sent to an address outside the tier)."""
        members = self.membership
        if isinstance(request, Announce | Withdraw) and not members.is_member(request.holder):
            self._refuse(f"holder {request.holder[:200]!r} is not a member")
        elif isinstance(request, Announce):
            self.directory.announce(request.namespace, request.keys, request.holder)
        elif isinstance(request, Withdraw):
            self.directory.withdraw(request.namespace, request.keys, request.holder)
        elif isinstance(request, WhoHas):
            return encode(
                self.directory.holders(request.namespace, request.keys, members.member_set)
            )
        elif isinstance(request, Holds):
            missing = set(self.host.missing(request.namespace, request.keys))
            return encode([key not in missing for key in request.keys])
        elif isinstance(request, NixlHello):
            return self.nixl.metadata if self.nixl is not None else b""
        elif isinstance(request, Return):
            if (loan := self._loans.pop(request.lease, None)) is not None:
                self._end_loan(request.lease, loan[2])
        elif isinstance(request, Damaged):
            self.host.reverify(request.namespace, request.keys)
        elif isinstance(request, Lend):
            return encode(self._lend(request.namespace, request.keys))
        elif isinstance(request, Stream):
            return encode(self._stream(request))
        return None

    def _stream(self, request: Stream) -> Streamed:
        """Lease the chunks and keep them for the ticket's claim on the stream port."""
        if self.stream is None or not len(request.secret) == len(request.ticket) == TICKET:
            return Streamed(0, [], [])
        lease, chunks = self._lease(request.namespace, request.keys)
        sent = [c for c in chunks if not isinstance(c, str)]
        if lease:
            deadline = time.monotonic() + 2 * self.config.timeout_seconds
            payloads = [(self.host.pool.payload(slot, h.length).data, h.length) for slot, h in sent]
            self.stream.expect(
                request.ticket, request.secret, lease, payloads, deadline, request.sealed
            )
        statuses = [c if isinstance(c, str) else Answer.SENT for c in chunks]
        return Streamed(self.stream.port, statuses, [header.pack() for _, header in sent])

    def _lend(self, namespace: str, keys: list[bytes]) -> Loan:
        if self.nixl is None:
            return Loan(0, "", [Answer.ABSENT] * len(keys))
        lease, chunks = self._lease(namespace, keys)
        base, geometry = self.nixl.base, self.host.pool.geometry
        lent: list[Lent | str] = [
            c if isinstance(c, str) else Lent(base + geometry.payload_offset(c[0]), c[1].pack())
            for c in chunks
        ]
        regions = [
            (item.address, chunk[1].length)
            for item, chunk in zip(lent, chunks, strict=True)
            if isinstance(item, Lent) and not isinstance(chunk, str)
        ]
        sections = b""
        if lease:
            registration = None
            if regions:
                registration, sections = self.nixl.lend(regions)
            deadline = time.monotonic() + 2 * self.config.timeout_seconds
            self._loans[lease] = (deadline, len(regions), registration)
        return Loan(lease, self.nixl.name, lent, sections)

    def _end_loan(self, lease: int, registration: Any) -> None:
        """The lent bytes are deregistered before the slots can be reused."""
        if registration is not None and self.nixl is not None:
            self.nixl.unlend(registration)
        self.host.end_load(lease, LENDER)

    def _send_chunks(self, identity: bytes, rid: bytes, request: Fetch) -> None:
        lease, chunks = self._lease(request.namespace, request.keys)
        frames: list[bytes | memoryview] = [identity, rid, b""]
        statuses = []
        for chunk in chunks:
            if isinstance(chunk, str):
                statuses.append(chunk)
                continue
            slot, header = chunk
            statuses.append(Answer.SENT)
            # Sent from the slot itself; the lease ends once ZMQ is done with the bytes.
            frames += [header.pack(), self.host.pool.payload(slot, header.length).data]
        frames[2] = encode(statuses)
        tracker = self._sock.send_multipart(frames, copy=False, track=True)
        if lease:
            assert tracker is not None
            self._sending.append((tracker, lease, statuses.count(Answer.SENT)))

    def _lease(
        self, namespace: str, keys: list[bytes]
    ) -> tuple[int, list[tuple[int, ChunkHeader] | str]]:
        """Lease the slots of the held chunks among `keys`, up to the lending cap: the lease
        (0 for none) and per key (slot, header), Answer.ABSENT or Answer.BUSY. A chunk not
        sealed yet has no checksum to send and counts as absent."""
        room = max(0, self.config.max_lent_chunks - self.lent())
        asked, refused = keys[:room], len(keys) - min(room, len(keys))
        self.refused += refused
        chunks: list[tuple[int, ChunkHeader] | str] = []
        lease = 0
        if asked:
            host = self.host
            lease, slots, _, _ = host.begin_load(LENDER, namespace, asked)
            headers = host.sealed_headers(namespace, asked, slots)
            for slot, header in zip(slots, headers, strict=True):
                chunks.append((slot, header) if header is not None else Answer.ABSENT)
        return lease, chunks + [Answer.BUSY] * refused

    def _settle(self) -> None:
        """End the leases of finished sends and of loans not returned in time."""
        still = []
        for tracker, lease, slots in self._sending:
            if tracker.done:
                self.host.end_load(lease, LENDER)
            else:
                still.append((tracker, lease, slots))
        self._sending = still
        now = time.monotonic()
        if self.stream is not None:
            for lease in self.stream.finished(now):
                self.host.end_load(lease, LENDER)
        for lease in [lease for lease, (deadline, _, _) in self._loans.items() if deadline < now]:
            self._end_loan(lease, self._loans.pop(lease)[2])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self.stream is not None:
            self.stream.close()
        if self.nixl is not None:
            self.nixl.close()
