"""Reading chunks from the agents that hold them: one request and one transfer per holder
and batch, over NIXL where both sides have it (the requester READs the slots the holder lent
it), else over the stream (TCP, each chunk's tag checked, received straight into this
agent's reserved slots or, encrypted, opened into them), else as ZMQ frames received into
them; every chunk verified on arrival, and a holder that sent a damaged one told so.

Threading: `read` runs the batches of one call on the reader's thread pool; the holder
caches are plain dicts changed by single operations, which the GIL keeps whole.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.tiers.base import CorruptChunk, check_blob, check_payload
from kvtier.agent.tiers.peer.connection import Connection, Connections
from kvtier.agent.tiers.peer.server import PeerServer
from kvtier.agent.tiers.peer.stream import StreamFailed, new_secret
from kvtier.agent.tiers.peer.wire import (
    Answer,
    Damaged,
    Fetch,
    Lend,
    Lent,
    NixlHello,
    Return,
    Stream,
    decode_loan,
    decode_streamed,
)
from kvtier.api.stats import PeerCount

log = logging.getLogger("kvtier.agent.peers")
HOLDER_CACHE = 65536
MAX_BATCH = 64  # chunks asked of one holder in one request (NIXL, the stream)
ZMQ_BATCH = 8
NIXL_RETRY_SECONDS = 60.0
STREAM_RETRY_SECONDS = 60.0  # a holder without a working stream is asked for ZMQ frames
Count = Callable[[PeerCount, int], None]


class _NixlFailed(Exception):
    """The NIXL transfer did not complete; the chunk is fetched over ZMQ instead."""


class Read:
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


class Holders:
    """Where keys live, bounded: holders the homes named for recent lookups (only the next
    read needs them), and the keys direct-mode sources said they hold, which no home knows."""

    def __init__(self) -> None:
        self.found: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self.direct: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    def note(self, namespace: str, key: bytes, holder: str, direct: bool = False) -> None:
        self.found[(namespace, key)] = holder
        if direct:
            self.direct[(namespace, key)] = holder

    def trim(self) -> None:
        for cache in (self.found, self.direct):
            while len(cache) > HOLDER_CACHE:
                cache.popitem(last=False)

    def forget(self, namespace: str, key: bytes) -> None:
        self.found.pop((namespace, key), None)
        self.direct.pop((namespace, key), None)

    def forget_holder(self, endpoint: str) -> None:
        """Keys a source that is gone said it holds are no longer looked for there."""
        for cache in (self.direct, self.found):
            for chunk in [c for c, holder in list(cache.items()) if holder == endpoint]:
                cache.pop(chunk, None)


class Reader:
    def __init__(
        self,
        server: PeerServer,
        connections: Connections,
        holders: Holders,
        timeout: float,
        count: Count,
    ) -> None:
        self.server = server
        self.me = server.endpoint
        self._connections = connections
        self._holders = holders
        self._timeout = timeout
        self._count = count
        self._nixl_names: dict[str, str] = {}
        self._nixl_retry: dict[str, float] = {}  # endpoint -> when to try NIXL again
        self._stream_retry: dict[str, float] = {}  # endpoint -> when to try its stream again
        self._fetchers = ThreadPoolExecutor(8, thread_name_prefix="kvtier-peer-fetch")

    def read(
        self, namespace: str, keys: list[bytes], outs: list[memoryview]
    ) -> list[ChunkHeader | CorruptChunk | None]:
        """One request and one transfer per holder (per batch of chunks), batches in
        parallel; keys without a known holder are not found."""
        reads = [Read(key, out) for key, out in zip(keys, outs, strict=True)]
        batches: list[tuple[str, list[Read]]] = []
        by_holder: dict[str, list[Read]] = {}
        for read in reads:
            holder = self._holders.found.get((namespace, read.key))
            if holder is not None:
                by_holder.setdefault(holder, []).append(read)
        for holder, mine in by_holder.items():
            # One NIXL transfer or stream moves a whole batch (its holder seals a chunk while
            # the kernel sends the one before; parallel streams on a few cores were slower:
            # 0.6-0.9x against 0.8-1.2x a TCP stream between namespaces); ZMQ frames go in
            # smaller batches on parallel connections, overlapping one's CURVE with the next.
            big = self.nixl_agent(holder) or self._streams_to(holder)
            size = MAX_BATCH if big else ZMQ_BATCH
            batches += [(holder, mine[i : i + size]) for i in range(0, len(mine), size)]
        if len(batches) == 1:
            self._read_batch(namespace, *batches[0])
        else:
            jobs = [self._fetchers.submit(self._read_batch, namespace, *b) for b in batches]
            for job in jobs:  # one holder failing leaves the others' chunks usable
                if (error := job.exception()) is not None:
                    self._count("batch_errors", 1)
                    log.warning("peer read failed: %s", error)
        return [read.error or read.header for read in reads]

    def _read_batch(self, namespace: str, holder: str, batch: list[Read]) -> None:
        """NIXL first where both sides have it, then the stream, then ZMQ frames for
        what neither settled. One connection carries the batch's requests, its loan's return
        and the damage report, so the holder sees them in that order (a damaged chunk still
        lent leaves its lookups at once, its slot only once the loan is returned)."""
        remote = self.nixl_agent(holder)
        connection = self._connections.to(holder)
        try:
            if remote:
                try:
                    self._read_nixl(connection, remote, namespace, batch)
                except _NixlFailed:
                    self._count("nixl_failures", 1)
                    self.forget_nixl(holder)  # connect afresh next time
            if self._streams_to(holder) and any(not r.resolved for r in batch):
                self._read_stream(connection, namespace, [r for r in batch if not r.resolved])
            unsettled = [r for r in batch if not r.resolved]
            if unsettled:
                self._read_zmq(connection, namespace, unsettled)
        finally:
            self._report_damaged(connection, namespace, batch)

    def _report_damaged(self, connection: Connection, namespace: str, batch: list[Read]) -> None:
        """Chunks that arrived failing their checksums: not asked of this holder again, and
        the holder told, so it checks its copies and stops serving bad ones."""
        damaged = [r.key for r in batch if r.error is not None]
        if damaged:
            for key in damaged:
                self._holders.forget(namespace, key)
            connection.send(Damaged(namespace, damaged))

    def nixl_agent(self, endpoint: str) -> str:
        """The holder's NIXL agent name ("" when either side has no NIXL or it cannot be
        reached over NIXL), learnt by asking it over the authenticated control channel (its
        NIXL metadata is published nowhere else). An agent NIXL could not connect to is
        retried after `NIXL_RETRY_SECONDS`."""
        nixl = self.server.nixl
        if nixl is None or time.monotonic() < self._nixl_retry.get(endpoint, 0.0):
            return ""
        known = self._nixl_names.get(endpoint)
        if known is None:
            reply = self._connections.to(endpoint).call(NixlHello(self.me))
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
                self._count("nixl_failures", 1)
                self._nixl_retry[endpoint] = time.monotonic() + NIXL_RETRY_SECONDS
                return ""
            self._nixl_names[endpoint] = known
        return known

    def _read_nixl(
        self, connection: Connection, remote: str, namespace: str, batch: list[Read]
    ) -> None:
        """The batch's chunks READ from the holder's lent slots in one NIXL transfer."""
        assert self.server.nixl is not None
        holder = connection.endpoint
        reply = connection.call(Lend(namespace, [r.key for r in batch]))
        if reply is None:
            self._resolve(namespace, batch, [Answer.ABSENT] * len(batch))
            return
        loan = decode_loan(reply[0])
        moving: list[tuple[Read, Lent, ChunkHeader]] = []
        try:
            if loan.agent != remote:  # the holder restarted: learn its new NIXL agent
                self.forget_nixl(holder)
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
                moved = not reads or self.server.nixl.read(remote, reads, self._timeout)
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

    def _read_zmq(self, connection: Connection, namespace: str, batch: list[Read]) -> None:
        fetch = Fetch(namespace, [r.key for r in batch])
        reply = connection.fetch_into(fetch, [r.out for r in batch])
        statuses, pages = reply if reply else ([Answer.ABSENT] * len(batch), [])
        arrived = iter(pages)
        sent = 0
        for read, status in zip(batch, statuses, strict=True):
            if status != Answer.SENT:
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

    def _streams_to(self, holder: str) -> bool:
        return self.server.stream is not None and (
            time.monotonic() >= self._stream_retry.get(holder, 0.0)
        )

    def _read_stream(self, connection: Connection, namespace: str, batch: list[Read]) -> None:
        """The batch over the holder's stream. A holder that does not answer is a
        miss for the batch (and, being perhaps of a release without the stream, is asked
        for ZMQ frames for a while); one whose stream breaks leaves what did not arrive to
        the ZMQ frames."""
        holder = connection.endpoint
        secret, ticket = new_secret()
        sealed = self.server.config.encrypt_bytes
        reply = connection.call(Stream(namespace, [r.key for r in batch], secret, ticket, sealed))
        streamed = decode_streamed(reply[0]) if reply else None
        if streamed is None or not streamed.port:
            self._stream_retry[holder] = time.monotonic() + STREAM_RETRY_SECONDS
            if streamed is None:
                self._resolve(namespace, batch, [Answer.ABSENT] * len(batch))
            return
        coming: list[tuple[Read, ChunkHeader | None]] = []
        pages = iter(streamed.pages)
        for read, status in zip(batch, streamed.statuses, strict=True):
            if status != Answer.SENT:
                self._resolve(namespace, [read], [status])
                continue
            try:
                header = check_blob(next(pages), namespace, read.key, len(read.out))
                coming.append((read, header))
            except CorruptChunk as exc:  # its bytes still come, to be dropped
                read.fail(exc)
                coming.append((read, None))

        def opened(index: int, authentic: bool) -> None:
            read, header = coming[index]
            if header is not None and authentic:
                read.verify(header)
            elif header is not None:
                read.fail(CorruptChunk("chunk failed authentication on the stream"))

        if not coming:
            return
        outs = [read.out if header is not None else None for read, header in coming]
        try:
            with connection.stream() as channel:
                channel.receive(streamed.port, ticket, secret, sealed, outs, opened)
        except StreamFailed as exc:
            log.warning("stream from %s failed, using ZMQ frames: %s", holder, exc)
            self._count("stream_failures", 1)
            self._stream_retry[holder] = time.monotonic() + STREAM_RETRY_SECONDS
        self._count("stream_reads", sum(read.header is not None for read, _ in coming))

    def _resolve(self, namespace: str, reads: list[Read], statuses: list[str]) -> None:
        """Reads that found no chunk: a busy holder keeps its place, one that did not
        answer or no longer holds the key is forgotten as this key's holder."""
        for read, status in zip(reads, statuses, strict=True):
            read.resolved = True
            if status == Answer.BUSY:
                self._count("busy", 1)
            else:
                self._holders.forget(namespace, read.key)

    def forget_nixl(self, endpoint: str) -> None:
        name = self._nixl_names.pop(endpoint, "")
        if name and self.server.nixl is not None:
            self.server.nixl.forget(name)

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)
