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
import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.config import PeerTierConfig
from kvtier.agent.report import Member, Registry
from kvtier.agent.tiers.base import (
    CorruptChunk,
    SecondaryTier,
    TierUsage,
    check_blob,
    check_payload,
)
from kvtier.agent.tiers.peer_directory import homes
from kvtier.agent.tiers.peer_server import PeerServer
from kvtier.agent.tiers.peer_wire import (
    ABSENT,
    BUSY,
    RID,
    SENT,
    Announce,
    Damaged,
    Fetch,
    Holds,
    KeyRing,
    Lend,
    Lent,
    NixlHello,
    Return,
    WhoHas,
    Withdraw,
    context,
    decode_holders,
    decode_loan,
    decode_statuses,
    encode,
    secure_client,
)

log = logging.getLogger("kvtier.agent.peers")
HOLDER_CACHE = 65536
CONNECTIONS_PER_PEER = 4
ANNOUNCE_BATCH = 4096  # keys per announcement message (re-announcing a whole pool)
MAX_BATCH = 64  # chunks asked of one holder in one request
ZMQ_BATCH = 8
NIXL_RETRY_SECONDS = 60.0


class _NixlFailed(Exception):
    """The NIXL transfer did not complete; the chunk is fetched over ZMQ instead."""


class _Read:
    """One chunk wanted from a holder, into a reserved slot of this agent's pool."""

    def __init__(self, key: bytes, out: memoryview) -> None:
        self.key = key
        self.out = out
        self.header: ChunkHeader | None = None
        self.error: CorruptChunk | None = None
        self.resolved = False  # answered: arrived, absent, busy or corrupt

    def fail(self, error: CorruptChunk) -> None:
        self.error, self.resolved = error, True

    def verify(self, header: ChunkHeader) -> None:
        try:
            check_payload(header, self.out)
            self.header = header
        except CorruptChunk as exc:
            self.error = exc
        self.resolved = True


class _Connection:
    """A request/reply channel to one peer, shared by threads (one request at a time)."""

    def __init__(
        self, endpoint: str, keys: KeyRing | None, server_key: bytes, timeout: float
    ) -> None:
        self.endpoint = endpoint
        self._keys = keys
        self.server_key = server_key
        self._timeout_ms = int(timeout * 1000)
        self.lock = threading.Lock()  # one request at a time
        self._rids = itertools.count(1)
        self._sock: zmq.Socket[bytes] | None = None
        self.used = time.monotonic()

    def next_rid(self) -> int:
        return next(self._rids)

    @property
    def open(self) -> bool:
        return self._sock is not None

    def close_if_idle(self, unused_since: float) -> bool:
        """Close the socket when it was last used before `unused_since` (and is not in use
        now): an idle peer costs neither side a connection. It reopens on next use."""
        if self._sock is None or self.used > unused_since or not self.lock.acquire(blocking=False):
            return False
        try:
            if self._sock is None or self.used > unused_since:
                return False
            self.drop()
            return True
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            if self._sock is not None:
                self.drop()

    def socket(self) -> zmq.Socket[bytes]:
        self.used = time.monotonic()
        if self._sock is None:
            sock: zmq.Socket[bytes] = context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self._keys, self.server_key)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def send(self, message: msgspec.Struct) -> None:
        with self.lock, contextlib.suppress(zmq.Again):
            self.socket().send_multipart([b"\0" * 8, encode(message)], flags=zmq.NOBLOCK)

    def call(self, message: msgspec.Struct) -> list[memoryview] | None:
        """Frames of the reply after the request id, as received (not copied); None when
        the peer did not answer."""
        with self.lock:
            sock = self.socket()
            rid = RID.pack(next(self._rids))
            sock.send_multipart([rid, encode(message)])
            while sock.poll(self._timeout_ms):
                frames = sock.recv_multipart(copy=False)
                if frames[0].bytes == rid:
                    return [frame.buffer for frame in frames[1:]]
            self.drop()
            return None

    def fetch_into(
        self, fetch: Fetch, outs: list[memoryview]
    ) -> tuple[list[str], list[bytes]] | None:
        """A fetch whose payload frames are received straight into `outs` (slots reserved
        in this agent's pool): the per-key statuses and the header pages of the chunks
        sent; None when the peer did not answer."""
        with self.lock:
            sock = self.socket()
            rid = RID.pack(next(self._rids))
            sock.send_multipart([rid, encode(fetch)])
            while sock.poll(self._timeout_ms):
                if sock.recv() != rid:  # a late reply to an abandoned request
                    while sock.rcvmore:
                        sock.recv()
                    continue
                statuses = decode_statuses(sock.recv())
                pages = []
                for status, out in zip(statuses, outs, strict=True):
                    if status == SENT:
                        pages.append(sock.recv())
                        sock.recv_into(out)  # a longer frame is cut: its checksum fails
                while sock.rcvmore:
                    sock.recv()
                return statuses, pages
            self.drop()
            return None

    def drop(self) -> None:
        """Close the socket, so whatever arrives late is dropped with it."""
        assert self._sock is not None
        self._sock.close(linger=0)
        self._sock = None


def call_all(
    calls: list[tuple[_Connection, msgspec.Struct]], timeout: float
) -> list[list[memoryview] | None]:
    """Requests to several peers at once: all sent, then the replies taken as they come, so
    a lookup whose keys have many homes waits about one round trip, not one per home. Each
    reply as `_Connection.call` gives it; None for a peer that did not answer in time."""
    if len(calls) == 1:
        connection, message = calls[0]
        return [connection.call(message)]
    ordered = sorted({id(c): c for c, _ in calls}.values(), key=id)  # one lock order for all
    for connection in ordered:
        connection.lock.acquire()
    try:
        poller = zmq.Poller()
        sent: dict[zmq.Socket[bytes], tuple[int, bytes]] = {}
        for i, (connection, message) in enumerate(calls):
            sock = connection.socket()
            rid = RID.pack(connection.next_rid())
            sock.send_multipart([rid, encode(message)])
            sent[sock] = (i, rid)
            poller.register(sock, zmq.POLLIN)
        results: list[list[memoryview] | None] = [None] * len(calls)
        deadline = time.monotonic() + timeout
        waiting = len(calls)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                frames = sock.recv_multipart(copy=False)
                i, rid = sent[sock]
                if frames[0].bytes == rid:
                    results[i] = [frame.buffer for frame in frames[1:]]
                    poller.unregister(sock)
                    waiting -= 1
        for (connection, _), result in zip(calls, results, strict=True):
            if result is None:
                connection.drop()  # what arrives late is dropped with the socket
        return results
    finally:
        for connection in ordered:
            connection.lock.release()


class PeerTier(SecondaryTier):
    kind = "peer"

    def __init__(
        self,
        name: str,
        config: PeerTierConfig,
        registry: Registry,
        server: PeerServer,
        stale_after: float,
    ) -> None:
        """`stale_after`: seconds without a heartbeat after which an agent counts as gone."""
        super().__init__(name)
        self.config = config
        self.registry = registry
        self.stale_after = stale_after
        self.server = server
        self.me = server.endpoint
        server.is_member = self.is_member
        server.members = lambda: self._member_set
        self._keys = server.keys
        self._server_keys: dict[str, bytes] = {}  # member endpoint -> the key it serves with
        self._connections: dict[str, list[_Connection]] = {}
        self._turn = 0
        self._lock = threading.Lock()
        # Where recently found keys live, bounded: only the next read needs it; and the keys
        # direct-mode sources said they hold, which no home knows about.
        self._holder: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._direct: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._members: list[str] = [self.me]
        self._member_set: frozenset[str] = frozenset(self._members)
        self._members_at = -float("inf")
        # What this agent announced it holds (stored here, or found in its pool at start),
        # re-announced before the homes' entries expire and whenever the homes move.
        self._held: dict[str, set[bytes]] = {}
        self._seeded = False
        self._announced_at = -float("inf")
        self._announced_to: list[str] = []  # the membership the last announcement used
        self._retained_for: set[str] = set()  # the membership the directory was pruned to
        self._nixl_names: dict[str, str] = {}
        self._nixl_retry: dict[str, float] = {}  # endpoint -> when to try NIXL again
        self._counts: dict[str, int] = {}
        self._fetchers = ThreadPoolExecutor(8, thread_name_prefix="kvtier-peer-fetch")
        self._evictions_seen: dict[str, int] = {}  # namespace -> event seq withdrawn up to
        self._expired_at = time.monotonic()

    def _peer(self, endpoint: str) -> _Connection:
        """One of a few connections to the peer, in turn: promotions of one request run in
        parallel instead of queueing behind one socket."""
        with self._lock:
            pool = self._connections.get(endpoint)
            if pool is None:
                server_key = self._server_keys.get(endpoint, b"")
                pool = self._connections[endpoint] = [
                    _Connection(endpoint, self._keys, server_key, self.config.timeout_seconds)
                    for _ in range(CONNECTIONS_PER_PEER)
                ]
            self._turn += 1
            return pool[self._turn % len(pool)]

    def live_members(self, fresh_within: float | None = None) -> list[str]:
        """Agents with a fresh heartbeat, re-read from the registry every
        `membershipSeconds` (or when older than `fresh_within`; the Kubernetes registry
        answers from its watch, the file registry reads the directory)."""
        now = time.monotonic()
        limit = self.config.membership_seconds if fresh_within is None else fresh_within
        if now - self._members_at > limit:
            cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=self.stale_after)
            found: list[Member] = self.registry.members()
            fresh = [
                m
                for m in found
                if (m.heartbeat is None or m.heartbeat > cutoff) and self._reachable(m)
            ]
            live = {m.endpoint for m in fresh}
            self._server_keys = {m.endpoint: (m.curve_key or "").encode() for m in fresh}
            self._members = sorted(live | {self.me})
            self._member_set = frozenset(self._members)
            self._members_at = now
        return self._members

    def _reachable(self, member: Member) -> bool:
        """Whether this agent can talk to `member`: both authenticated, with a key this
        agent trusts, or both not (during the rolling upgrade from an unauthenticated tier
        the two kinds form separate groups, each with its own directory, and miss the other's
        chunks until the roll-out ends)."""
        if self._keys is None:
            return not member.curve_key
        return member.curve_key is not None and member.curve_key.encode() in self._keys.trusted

    def is_member(self, endpoint: str) -> bool:
        """Whether `endpoint` is a live agent of this tier; one not known yet makes the
        membership be re-read (at most twenty times a second), so a node that just joined is
        not refused for long."""
        if endpoint in self._member_set:
            return True
        self.live_members(fresh_within=min(0.05, self.config.membership_seconds))
        return endpoint in self._member_set

    def peers(self) -> list[str]:
        """The other live agents' peer endpoints (as last read)."""
        return [m for m in self._members if m != self.me]

    # --- SecondaryTier ----------------------------------------------------------------------

    def write(self, header: ChunkHeader, payload: memoryview) -> None:
        """Tell the key's home that this agent holds the chunk; no bytes move."""
        self._evictions_seen.setdefault(header.namespace, 0)
        with self._lock:
            self._held.setdefault(header.namespace, set()).add(header.key)
        self._tell_homes(header.namespace, [header.key], Announce)

    def _tell_homes(
        self, namespace: str, keys: list[bytes], what: type[Announce] | type[Withdraw]
    ) -> None:
        """Announce (or withdraw) this agent as a holder of `keys`: a message per home and
        per `ANNOUNCE_BATCH` keys."""
        for home, indexes in self._by_home(keys).items():
            for start in range(0, len(indexes), ANNOUNCE_BATCH):
                batch = [keys[i] for i in indexes[start : start + ANNOUNCE_BATCH]]
                if home != self.me:
                    self._peer(home).send(what(namespace, batch, self.me))
                elif what is Announce:
                    self.server.directory.announce(namespace, batch, self.me)
                else:
                    self.server.directory.withdraw(namespace, batch, self.me)

    def reannounce_seconds(self) -> float:
        """Holders re-announce at a third of the homes' TTL: an entry outlives two lost
        announcements."""
        return self.config.announce_ttl_seconds / 3

    def _reannounce(self) -> None:
        """Announce everything held again, to the homes the current membership gives: before
        the entries expire, and at once when membership changed (keys whose home moved are
        unknown to their new home until then)."""
        members = self.live_members()
        now = time.monotonic()
        if members == self._announced_to and now - self._announced_at < self.reannounce_seconds():
            return
        self._announced_to, self._announced_at = list(members), now
        with self._lock:
            held = {namespace: list(keys) for namespace, keys in self._held.items() if keys}
        for namespace, keys in held.items():
            self._tell_homes(namespace, keys, Announce)
        self._count("reannounced", sum(len(keys) for keys in held.values()))

    def _seed(self) -> None:
        """A restarted agent re-indexed a warm pool: what it holds is announced like what is
        stored after the start."""
        host = self.server.host
        with host.lock:
            ready = {ns: set(keys) for ns, keys in host.index._ready.items() if keys}
        with self._lock:
            for namespace, keys in ready.items():
                self._held.setdefault(namespace, set()).update(keys)
                self._evictions_seen.setdefault(namespace, 0)
        self._seeded = True

    def _by_home(self, keys: list[bytes]) -> dict[str, list[int]]:
        """Positions in `keys`, grouped by the live member each key's home is."""
        members = self.live_members()
        if not keys:
            return {}
        if len(members) == 1:
            return {members[0]: list(range(len(keys)))}
        by_home: dict[str, list[int]] = {}
        for i, home in enumerate(homes(keys, members).tolist()):
            by_home.setdefault(members[home], []).append(i)
        return by_home

    def _withdraw_evicted(self) -> None:
        """Tell the homes about chunks the pool evicted since last time, so lookups stop
        sending askers here for them (the entries would expire anyway, later)."""
        host = self.server.host
        for namespace, seen in list(self._evictions_seen.items()):
            with host.lock:
                batch = host.index.events.since(namespace, seen)
            self._evictions_seen[namespace] = batch.seq
            if batch.evicted:
                gone = host.missing(namespace, batch.evicted)  # not stored again since
                if gone:
                    with self._lock:
                        self._held.get(namespace, set()).difference_update(gone)
                    self._tell_homes(namespace, gone, Withdraw)

    def ask_source(self, source: str, namespace: str, keys: list[bytes]) -> None:
        """Direct mode: remember `source` as the holder of the keys it says it holds, so
        lookups and reads go straight to it (no directory involved). Only a live member of
        this tier is asked: a request naming anything else (an end user can set the source
        through vLLM's API) is refused and counted, and no connection is made."""
        if source == self.me:
            return
        if not self.is_member(source):
            self._count("refused_sources")
            self.server.host.metrics.peer_refused.inc(len(keys))
            log.warning("refused a request naming %r as its source: not a member", source[:200])
            return
        reply = self._peer(source).call(Holds(namespace, keys))
        if reply:
            for key, held in zip(keys, msgspec.msgpack.decode(reply[0]), strict=True):
                if held:
                    self._holder[(namespace, key)] = self._direct[(namespace, key)] = source
            while len(self._direct) > HOLDER_CACHE:
                self._direct.popitem(last=False)

    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Keys a direct-mode source holds, then the homes asked for the others (always: a
        holder that evicted a chunk has withdrawn it there)."""
        direct = self._direct
        found = [(namespace, key) in direct for key in keys] if direct else [False] * len(keys)
        asked = [i for i, known in enumerate(found) if not known]
        answers: list[tuple[list[int], list[str]]] = []
        remote: list[tuple[list[int], _Connection, WhoHas]] = []
        for home, positions in self._by_home([keys[i] for i in asked]).items():
            indexes = [asked[j] for j in positions]
            batch = [keys[i] for i in indexes]
            if home == self.me:
                holders = self.server.directory.holders(namespace, batch, self._member_set)
                answers.append((indexes, holders))
            else:
                remote.append((indexes, self._peer(home), WhoHas(namespace, batch)))
        replies = call_all([(c, m) for _, c, m in remote], self.config.timeout_seconds)
        for (indexes, _, _), reply in zip(remote, replies, strict=True):
            holders = decode_holders(reply[0]) if reply else [""] * len(indexes)
            answers.append((indexes, holders))
        for indexes, holders in answers:
            for i, holder in zip(indexes, holders, strict=True):
                if holder and holder != self.me:
                    self._holder[(namespace, keys[i])] = holder
                    found[i] = True
                else:
                    self._holder.pop((namespace, keys[i]), None)
        while len(self._holder) > HOLDER_CACHE:
            self._holder.popitem(last=False)
        return found

    reads_in_batches = True

    def read_into(self, namespace: str, key: bytes, out: memoryview) -> ChunkHeader | None:
        result = self.read_many(namespace, [key], [out])[0]
        if isinstance(result, CorruptChunk):
            raise result
        return result

    def read_many(
        self, namespace: str, keys: list[bytes], outs: list[memoryview]
    ) -> list[ChunkHeader | CorruptChunk | None]:
        """One request and one transfer per holder (per batch of chunks), batches in
        parallel; keys whose holder is not known yet are asked of their homes first."""
        unknown = [key for key in keys if (namespace, key) not in self._holder]
        if unknown:
            self.exists(namespace, unknown)
        reads = [_Read(key, out) for key, out in zip(keys, outs, strict=True)]
        batches: list[tuple[str, list[_Read]]] = []
        by_holder: dict[str, list[_Read]] = {}
        for read in reads:
            holder = self._holder.get((namespace, read.key))
            if holder is not None:
                by_holder.setdefault(holder, []).append(read)
        for holder, mine in by_holder.items():
            # One NIXL transfer moves a whole batch; over ZMQ, smaller batches on parallel
            # connections overlap one's copy and checksum with the next one's bytes.
            size = MAX_BATCH if self._nixl_agent(holder) else ZMQ_BATCH
            batches += [(holder, mine[i : i + size]) for i in range(0, len(mine), size)]
        if len(batches) == 1:
            self._read_batch(namespace, *batches[0])
        else:
            jobs = [self._fetchers.submit(self._read_batch, namespace, *b) for b in batches]
            for job in jobs:  # one holder failing leaves the others' chunks usable
                if (error := job.exception()) is not None:
                    self._count("batch_errors")
                    log.warning("peer read failed: %s", error)
        return [read.error or read.header for read in reads]

    def _read_batch(self, namespace: str, holder: str, batch: list[_Read]) -> None:
        """NIXL first where both sides have it; ZMQ for what it did not settle."""
        remote = self._nixl_agent(holder)
        try:
            if remote:
                try:
                    self._read_nixl(holder, remote, namespace, batch)
                except _NixlFailed:
                    self._count("nixl_failures")
                    self._forget_nixl(holder)  # connect afresh next time
            unsettled = [r for r in batch if not r.resolved]
            if unsettled:
                self._read_zmq(holder, namespace, unsettled)
        finally:
            self._report_damaged(holder, namespace, batch)

    def _report_damaged(self, holder: str, namespace: str, batch: list[_Read]) -> None:
        """Chunks that arrived failing their checksums: not asked of this holder again, and
        the holder told, so it checks its copies and stops serving bad ones."""
        damaged = [r.key for r in batch if r.error is not None]
        if damaged:
            for key in damaged:
                self._holder.pop((namespace, key), None)
                self._direct.pop((namespace, key), None)
            self._peer(holder).send(Damaged(namespace, damaged))

    def _nixl_agent(self, endpoint: str) -> str:
        """The holder's NIXL agent name ("" when either side has no NIXL or it cannot be
        reached over NIXL), learnt by asking it over the authenticated control channel (its
        NIXL metadata is published nowhere else). An agent NIXL could not connect to is
        retried after `NIXL_RETRY_SECONDS`."""
        nixl = self.server.nixl
        if nixl is None or time.monotonic() < self._nixl_retry.get(endpoint, 0.0):
            return ""
        known = self._nixl_names.get(endpoint)
        if known is None:
            reply = self._peer(endpoint).call(NixlHello(self.me))
            if reply is None:
                return ""
            if len(reply) > 1:  # refused: it does not know this agent as a member yet
                self._nixl_retry[endpoint] = time.monotonic() + 0.2
                return ""
            metadata = bytes(reply[0])
            try:
                known = nixl.add_remote(metadata) if metadata else ""
            except Exception as exc:  # NIXL's backend cannot reach it: ZMQ it is
                log.warning("peer %s unreachable over NIXL, using ZMQ: %s", endpoint, exc)
                self._count("nixl_failures")
                self._nixl_retry[endpoint] = time.monotonic() + NIXL_RETRY_SECONDS
                return ""
            self._nixl_names[endpoint] = known
        return known

    def _read_nixl(self, holder: str, remote: str, namespace: str, batch: list[_Read]) -> None:
        """The batch's chunks READ from the holder's lent slots in one NIXL transfer."""
        assert self.server.nixl is not None
        connection = self._peer(holder)
        reply = connection.call(Lend(namespace, [r.key for r in batch]))
        if reply is None:
            self._resolve(namespace, batch, [ABSENT] * len(batch))
            return
        loan = decode_loan(reply[0])
        moving: list[tuple[_Read, Lent, ChunkHeader]] = []
        try:
            if loan.agent != remote:  # the holder restarted: learn its new NIXL agent
                self._forget_nixl(holder)
                raise _NixlFailed
            for read, chunk in zip(batch, loan.chunks, strict=True):
                if isinstance(chunk, str):
                    self._resolve(namespace, [read], [chunk])
                    continue
                try:
                    header = check_blob(chunk.header, namespace, read.key, len(read.out))
                except CorruptChunk as exc:
                    read.fail(exc)
                    continue
                moving.append((read, chunk, header))
            reads = [(chunk.address, read.out, header.length) for read, chunk, header in moving]
            try:
                if reads:
                    self.server.nixl.load_sections(loan.sections)
                moved = not reads or self.server.nixl.read(
                    remote, reads, self.config.timeout_seconds
                )
            except Exception as exc:  # NIXL refused the transfer (its backend lost the peer)
                log.warning("NIXL transfer from %s failed: %s", holder, exc)
                moved = False
            if not moved:
                raise _NixlFailed
        finally:
            if loan.lease:
                connection.send(Return(loan.lease))
        for read, _, header in moving:
            read.verify(header)
        self._count("nixl_reads", sum(read.header is not None for read, _, _ in moving))

    def _read_zmq(self, holder: str, namespace: str, batch: list[_Read]) -> None:
        fetch = Fetch(namespace, [r.key for r in batch])
        reply = self._peer(holder).fetch_into(fetch, [r.out for r in batch])
        statuses, pages = reply if reply else ([ABSENT] * len(batch), [])
        arrived = iter(pages)
        sent = 0
        for read, status in zip(batch, statuses, strict=True):
            if status != SENT:
                self._resolve(namespace, [read], [status])
                continue
            try:
                header = check_blob(next(arrived), namespace, read.key, len(read.out))
            except CorruptChunk as exc:
                read.fail(exc)
                continue
            read.verify(header)
            sent += read.header is not None
        self._count("zmq_reads", sent)

    def _resolve(self, namespace: str, reads: list[_Read], statuses: list[str]) -> None:
        """Reads that found no chunk: a busy holder keeps its place, one that did not
        answer or no longer holds the key is forgotten as this key's holder."""
        for read, status in zip(reads, statuses, strict=True):
            read.resolved = True
            if status == BUSY:
                self._count("busy")
            else:
                self._holder.pop((namespace, read.key), None)
                self._direct.pop((namespace, read.key), None)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + n
        metrics = self.server.host.metrics
        if what.endswith("_reads"):
            metrics.peer_chunks.labels(what.removesuffix("_reads")).inc(n)
        elif what == "nixl_failures":
            metrics.peer_nixl_failures.inc(n)
        elif what == "busy":
            metrics.peer_busy.inc(n)

    def counters(self) -> dict[str, int]:
        with self._lock:
            counts = {**self._counts, "lent": self.server.lent(), "refused": self.server.refused}
        return {
            **counts,
            "refused_requests": self.server.refused_requests,
            "refused_handshakes": self.server.refused_handshakes,
            "connections": self.open_connections(),
            "directory_keys": len(self.server.directory),
        }

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, len(self._holder))

    def _forget_nixl(self, endpoint: str) -> None:
        name = self._nixl_names.pop(endpoint, "")
        if name and self.server.nixl is not None:
            self.server.nixl.forget(name)

    def maintain(self) -> int:
        """Membership re-read; entries and connections of agents gone dropped, idle
        connections closed; evictions withdrawn; held chunks re-announced when due."""
        live = set(self.live_members())
        if self._retained_for - live:  # someone left: a pass over the directory, only then
            self.server.directory.retain(live.__contains__)
        self._retained_for = live
        with self._lock:
            # gone, or serving with another key since (restarted during a key rotation)
            dropped = [
                endpoint
                for endpoint, pool in self._connections.items()
                if endpoint not in live
                or pool[0].server_key != self._server_keys.get(endpoint, b"")
            ]
        for endpoint in dropped:
            self._forget_nixl(endpoint)
            self._direct_forget(endpoint)
            with self._lock:
                pool = self._connections.pop(endpoint, [])
            for connection in pool:
                connection.close()
        unused_since = time.monotonic() - self.config.idle_seconds
        with self._lock:
            pools = list(self._connections.values())
        closed = sum(c.close_if_idle(unused_since) for pool in pools for c in pool)
        if closed:
            self._count("idle_closed", closed)
        if not self._seeded:
            self._seed()
        self._withdraw_evicted()
        self._reannounce()
        now = time.monotonic()
        if now - self._expired_at > self.config.announce_ttl_seconds / 4:
            self.server.directory.expire()
            self._expired_at = now
        return 0

    def _direct_forget(self, endpoint: str) -> None:
        """Keys a source that is gone said it holds are no longer looked for there."""
        for cache in (self._direct, self._holder):
            for chunk in [c for c, holder in list(cache.items()) if holder == endpoint]:
                cache.pop(chunk, None)

    def open_connections(self) -> int:
        with self._lock:
            return sum(c.open for pool in self._connections.values() for c in pool)

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pools = list(self._connections.values())
            self._connections.clear()
        for pool in pools:
            for connection in pool:
                connection.close()
