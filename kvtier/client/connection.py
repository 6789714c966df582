"""The client side of the node agent: what the vLLM plug-in and tools use.

Control messages go over the agent's ipc socket; chunk bytes are copied by this process
from its own buffers into the agent's staging area (the agent copies them into the pool at
commit, publishing only what matches the sum this process made of each row as it staged
it) and straight out of the pool, which it maps read-only (numpy copies release the GIL, so
several threads copy in parallel). Imports only numpy, pyzmq and msgspec, which vLLM has.

Every call either answers within `timeout` or raises AgentUnavailable, which the caller
turns into a cache miss (or AgentRefused, when the agent answered with an error). After a
timeout the socket is rebuilt, so a late reply from a stalled agent can never be taken for
the answer to a later request. Every OS error of connecting or
mapping the pool is an AgentUnavailable too: a client that cannot reach the pool gets misses.

Lookups of the host pool are answered in this process from the index the agent publishes
beside the pool (see shm/table.py), with no round trip; what was looked up goes to the agent
afterwards in batched one-way Looked messages (reports.py: at most REPORT_SECONDS late, or
before the next request that waits for the agent), so its hit counts, the eviction order's
recency and its access log see every lookup. A hit is a hint: the chunk may be
evicted before it is leased, and the lease then says MISS. Lookups that may need the
secondary tiers (some key missed the pool, the agent has tiers) or name a source still ask
the agent.

A client says hello before anything else, and again whenever the agent answers that its
connection is not registered (the agent restarted, or the socket was rebuilt): lookups and
new leases then go through, while a commit of a lease granted before fails with LeaseLost,
as that lease is void. A load checks each slot's generation after copying it and reports a
chunk whose slot changed hands meanwhile as not loaded.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from kvtier.api.stats import AgentStats
from kvtier.client import protocol as p
from kvtier.client.gil import GilWatch
from kvtier.client.liveness import ClientLock
from kvtier.client.reports import Reports
from kvtier.client.transport import (
    AgentError,
    AgentRefused,
    AgentUnavailable,
    LeaseLost,
    NotRegistered,
    Transport,
)
from kvtier.shm.files import foreign
from kvtier.shm.pool import (
    SUM_CRC32,
    SUM_LANES,
    Bytes,
    PoolMap,
    copy_held,
    copy_summed,
    staging_path,
)
from kvtier.shm.table import TableReader, digests, index_path

ALIVE_SECONDS = 0.01  # per-key lookups test the agent's liveness at most this often


def _agent_only(key_digest: int) -> None:
    """`AgentClient.finder` where no live index answers: only the agent can say."""
    return None


@dataclass(frozen=True)
class LookupResult:
    """`where[i]` names where key i is: 0 the pool, n the n-th secondary tier (see
    `AgentClient.tiers`), -1 nowhere."""

    hits: list[bool]
    prefix: int
    where: list[int]


# Slots granted for a store or a load, as the agent answered them: `slots[i]` is a slot
# number, or negative when key i is not to be copied (a store's `status[i]` says why);
# `generations[i]` the stamp slot i keeps while the grant holds, `staging[i]` where a
# store writes key i.
Grant = p.LeaseReply


@dataclass(frozen=True)
class StoreResult:
    stored: int
    skipped: int


@dataclass(frozen=True)
class Staged:
    """What `stage` made of a grant's rows, for its Commit: a staging sum per row staged,
    and each one's kind (one byte per sum; empty: all lane sums)."""

    sums: list[int]
    kinds: bytes


def _commit_message(lease: int, staged: Staged | Sequence[int] | None) -> p.Commit:
    """A Commit of `stage`'s sums (a plain sequence: lane sums, as `stage` once returned)."""
    if staged is None:
        return p.Commit(lease)
    if isinstance(staged, Staged):
        return p.Commit(lease, staged.sums, staged.kinds)
    return p.Commit(lease, [int(s) for s in staged])


def _equal_rows(keys: Sequence[bytes], rows: Sequence[Any]) -> tuple[list[Bytes], int]:
    """The rows as byte views, and their common size: one row per key, all of one size."""
    views = [_as_bytes(r) for r in rows]
    if len(views) != len(keys):
        raise ValueError("store needs one row per key")
    nbytes = views[0].nbytes if views else 0
    if any(v.nbytes != nbytes for v in views):
        raise ValueError("store needs rows of equal size")
    return views, nbytes


def _as_bytes(row: Any) -> Bytes:
    array = np.asarray(row)
    if not array.flags.c_contiguous:
        raise ValueError("rows must be C-contiguous to be copied into the pool")
    return array.reshape(-1).view(np.uint8)


def _intact(pool: PoolMap | None) -> PoolMap:
    """`pool`, once it is known to back every mapped byte: a copy out of a truncated file
    would end the process with SIGBUS. Checked once per call, not per row: the check is a
    system call, which lets go of the GIL (`shm.pool.copy_held`)."""
    if pool is None:
        raise AgentUnavailable("not connected: connect() first")
    if not pool.intact():
        raise AgentUnavailable(f"pool {pool.path} was truncated under this client")
    return pool


def _slot_view(pool: PoolMap, slot: int, nbytes: int | None) -> Bytes:
    geometry = pool.geometry
    if not 0 <= slot < geometry.slot_count:
        raise ValueError(f"slot {slot} is not a slot of this pool ({geometry.slot_count})")
    if nbytes is not None and not 0 <= nbytes <= geometry.payload_bytes:
        raise ValueError(f"{nbytes} bytes do not fit a slot of {geometry.payload_bytes}")
    return pool.payload(slot, nbytes)


def _agents_own(mapped: PoolMap, group_writes: bool) -> PoolMap:
    """`mapped`, checked before anyone uses it: only the agent's own files are, and a file
    another pod of the tier put in their place (or a directory it may change) gives misses,
    never its bytes."""
    why = foreign(mapped.fd, mapped.path, group_writes)
    if why is not None:
        mapped.close()
        raise AgentUnavailable(f"not the agent's pool: {why}")
    return mapped


def _void(lease: int) -> LeaseLost:
    """A commit on a connection the agent no longer knows: it restarted, or dropped this
    session (another connection said hello as this client, or past its cap of sessions)."""
    return LeaseLost(
        f"lease {lease} is void: the agent no longer knows this connection (it restarted, or "
        "another connection said hello as this client)"
    )


class AgentClient:
    def __init__(self, endpoint: str, timeout: float = 5.0, client_id: str | None = None) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"agent endpoint must be ipc://PATH, got {endpoint!r}")
        self.endpoint = endpoint
        self.run_dir = Path(endpoint.removeprefix("ipc://")).parent
        self.timeout = timeout
        self.timeout_ms = int(timeout * 1000)
        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._transport = Transport(endpoint, self.timeout_ms, self.disconnected)
        self._lock: ClientLock | None = None
        self.pool: PoolMap | None = None  # read-only: only the agent writes the pool
        self.staging: PoolMap | None = None  # where stores are written, for the agent to seal
        self._boot = 0  # the agent process the staging map was made for
        self.gil = GilWatch()  # whether rows are CRC-summed (see `stage`)
        self.index: TableReader | None = None
        self.hello: p.HelloReply | None = None
        # lookups answered from the published index, and bytes loaded without a lease
        self.reports = Reports(self._report_tick)

    # --- connection ----------------------------------------------------------------------

    def connect(self) -> AgentClient:
        """Say hello and map the pool. A pool file that was recreated (another geometry) is
        mapped anew."""
        with self._transport.lock:
            self._connect_locked(time.monotonic() + self.timeout)
        return self

    def _connect_locked(self, deadline: float) -> None:
        try:
            if self._lock is None:
                self._lock = ClientLock(self.run_dir / "clients", self.client_id)
            reply = self._transport.exchange(
                p.Hello(self.client_id, self._lock.path.name), p.HelloReply, deadline
            )
            path = Path(reply.pool)
            pool = self.pool
            # A restarted agent may have made a new file, or resized this one in place (its
            # tier's capacity changed): either is mapped anew, and so is the staging area,
            # which every agent process sizes for itself.
            announced = (reply.payload_bytes, reply.slot_count)
            if (
                pool is None
                or pool.path != path
                or pool.inode != path.stat().st_ino
                or (pool.geometry.payload_bytes, pool.geometry.slot_count) != announced
            ):
                if pool is not None:
                    self.pool = None
                    pool.close()
                pool = self.pool = _agents_own(PoolMap.open(path, writable=False), False)
            staged = staging_path(path)
            staging = self.staging
            if staging is None or staging.inode != staged.stat().st_ino or self._boot != reply.boot:
                if staging is not None:
                    self.staging = None
                    staging.close()
                self.staging = _agents_own(PoolMap.open(staged), True)
                self._boot = reply.boot
        except (AgentError, NotRegistered):
            raise
        except (OSError, ValueError) as exc:
            raise AgentUnavailable(
                f"cannot use the agent at {self.endpoint} or its pool: {exc}; the pod needs "
                "the tier's volume and its group"
            ) from exc
        geometry = pool.geometry
        if (geometry.payload_bytes, geometry.slot_count) != (reply.payload_bytes, reply.slot_count):
            raise AgentUnavailable(f"pool {path} does not have the geometry the agent announced")
        self.hello = reply
        self._open_index(path, reply.boot)

    def _open_index(self, pool_path: Path, boot: int) -> None:
        """Map the agent's published index, if this agent process publishes one; without it
        (an older agent, a file this client cannot read) lookups ask the agent."""
        index = self.index
        if index is not None and index.boot == boot and not index.retired:
            return
        self.index = None
        if index is not None:
            index.close()
        try:
            fresh = TableReader(index_path(pool_path))
        except (OSError, ValueError):
            return
        if fresh.boot != boot or fresh.retired or foreign(fresh.fd, fresh.path, False):
            fresh.close()
            return
        self.index = fresh

    def disconnected(self) -> None:
        """The agent stopped answering: the next call says hello again (a restarted agent
        has a new pool and index)."""
        self.hello = None

    def close(self) -> None:
        self.reports.stop(self.timeout)
        self.flush_reports()
        if self.index is not None:
            self.index.close()
            self.index = None
        self._transport.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> AgentClient:
        return self.connect()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def tiers(self) -> list[str]:
        """Names of the agent's tiers in `where` order: index 0 is the host pool."""
        assert self.hello is not None, "connect() first"
        return ["host", *self.hello.tiers]

    @property
    def slot_bytes(self) -> int:
        assert self.hello is not None, "connect() first"
        return self.hello.payload_bytes

    # --- control calls -------------------------------------------------------------------

    def pool_answers(self, all_held: bool) -> bool:
        """Whether the published index answers a lookup or a load alone, the agent unasked:
        when the pool holds every key asked (`all_held`), or the agent has no secondary
        tier to look in."""
        hello = self.hello
        return all_held or (hello is not None and not hello.tiers)

    def lookup(
        self,
        namespace: str,
        keys: Sequence[bytes],
        source: str = "",
        key_digests: npt.NDArray[np.uint64] | None = None,
    ) -> LookupResult:
        """Which keys a tier holds. The pool's chunks are found in the published index
        without a round trip; the agent is asked unless the index answers alone
        (`pool_answers`), and when `source` names the peer endpoint of an agent known to
        hold the chunks (direct mode). `key_digests`: the keys' index digests
        (`shm.table.digests`), where the caller has them already."""
        keys = list(keys)
        index = self._live_index()
        sent = b""
        if index is not None and not source and keys:
            ds = digests(namespace, keys) if key_digests is None else key_digests
            if len(ds) != len(keys):
                raise ValueError("lookup needs one digest per key")
            held = index.held(ds)
            all_held = bool(held.all())
            if self.pool_answers(all_held):
                self.reports.request(namespace, ds)
                prefix = len(keys) if all_held else int(held.argmin())
                return LookupResult(held.tolist(), prefix, np.where(held, 0, -1).tolist())
            sent = ds.astype("<u8", copy=False).tobytes()
        reply = self._call(p.Lookup(namespace, keys, source, sent), p.LookupReply)
        return LookupResult(reply.hits, reply.prefix, reply.where)

    def find(self, key_digest: int) -> bool | None:
        """Whether the pool holds the key of index digest `key_digest` (`shm.table.digest`),
        from the published index, without ever blocking. None when only the agent can say:
        there is no live index to ask (not connected, the agent gone or restarted), or the
        index does not answer alone (`pool_answers`). Not reported: see `reports`. One key's
        question: keys asked together (the plug-in's, on vLLM's scheduler thread) use one
        `finder`, which makes these checks once."""
        return self.finder()(key_digest)

    def finder(self) -> Callable[[int], bool | None]:
        """`find` for a run of keys asked together (a scheduler step's): whether the agent
        process still runs (a system call, at most once per ALIVE_SECONDS) and whether the
        index answers alone are decided once, here. Each key then costs a probe and two
        reads: whether this connection still holds the hello the finder was made under,
        and whether a restarted agent retired the index (`TableReader.holds_live`); either
        makes every later key None, as `find` answers."""
        index, hello = self.index, self.hello
        if hello is None or index is None or not index.usable_within(ALIVE_SECONDS):
            return _agent_only
        holds = index.holds_live
        alone = not hello.tiers  # `pool_answers`: a key the pool lacks is a miss

        def find(key_digest: int) -> bool | None:
            if self.hello is not hello:
                return None
            held = holds(key_digest)
            return held if alone or held else None

        return find

    def _report_tick(self) -> None:
        """On the reporting thread: send what waits; an idle engine too lets go of a
        retired index, so its volume can free the file."""
        with contextlib.suppress(AgentUnavailable, zmq.ZMQError):
            self.flush_reports()
        self._drop_retired_index()

    def flush_reports(self, block: bool = True) -> None:
        """Send the reports that wait (`reports`), one way. With `block` false (on vLLM's
        scheduler thread) they wait for a later flush if another thread is in the middle
        of a round trip."""
        transport = self._transport
        if not transport.lock.acquire(blocking=block):
            return
        try:
            for message in self.reports.take():
                transport.post(message)
        finally:
            transport.lock.release()

    def _live_index(self) -> TableReader | None:
        """The published index while it is this agent process's; a retired one (the agent
        restarted) is dropped and the next call says hello again, which maps the new one."""
        index = self.index
        if index is not None and not index.alive():
            return None  # the agent is gone: only a new one can say what the pool holds
        if self._drop_retired_index():
            with contextlib.suppress(AgentError):
                self.connect()
            index = self.index
        return index

    def _drop_retired_index(self) -> bool:
        """Unmap a retired index (its agent restarted: the next call says hello again and
        maps the new one); returns whether it did. The tier's volume has room for two
        indexes, so a client must not hold on to an old one."""
        index = self.index
        if index is None or not index.retired:
            return False
        with self._transport.lock:
            if self.index is index:
                self.index = None
                self.hello = None
                index.close()
        return True

    def allocate(
        self,
        namespace: str,
        keys: Sequence[bytes],
        nbytes: int,
        parents: Sequence[bytes | None] | None = None,
    ) -> Grant:
        """`parents`: each key's predecessor in its request, where known (None otherwise).
        Each key's outcome is in the grant's `status` (`protocol.StoreStatus`), and a key
        given no slot has a negative one, whichever way the agent answered."""
        request = p.Allocate(
            namespace, list(keys), nbytes, None if parents is None else list(parents), True
        )
        grant: Grant = self._call(request, p.LeaseReply)
        if len(grant.status) != len(grant.slots):  # an agent that answers in band
            grant.status = p.store_status(grant.slots)
            grant.slots = p.granted_slots(grant.slots)
        return grant

    def commit(self, lease: int, staged: Staged | Sequence[int] | None = None) -> None:
        """A round trip: once it returns, every client of the agent sees the chunks (a
        one-way commit could still be queued behind another client's lookup). `staged`:
        what `stage` returned, so that the agent publishes only the bytes this client
        staged. Raises LeaseLost when the lease is void."""
        self._call(_commit_message(lease, staged), p.Ack)

    def _commit_ahead(self, lease: int, staged: Staged) -> bytes:
        """Send a Commit without waiting for its reply (see `store`): its request id."""
        if self.reports.pending:
            self.flush_reports()
        with self._transport.lock:
            if self.hello is None:
                self._connect_locked(time.monotonic() + self.timeout)
            return self._transport.send_ahead(_commit_message(lease, staged))

    def _commit_done(self, rid: bytes, lease: int) -> None:
        """Wait for the reply to a Commit sent ahead; raises as `commit` does."""
        with self._transport.lock:
            try:
                self._transport.await_reply(rid, "Commit", p.Ack, time.monotonic() + self.timeout)
            except NotRegistered:
                self.hello = None
                raise _void(lease) from None

    def abort(self, lease: int) -> None:
        self._transport.send(p.Abort(lease))

    def begin_load(self, namespace: str, keys: Sequence[bytes], source: str = "") -> Grant:
        grant: Grant = self._call(p.BeginLoad(namespace, list(keys), source), p.LeaseReply)
        return grant

    def end_load(self, lease: int) -> None:
        self._transport.send(p.EndLoad(lease))

    def events(self, namespace: str, after: int = 0) -> p.EventsReply:
        """Chunks of `namespace` stored into or evicted from the pool since `after`."""
        reply: p.EventsReply = self._call(p.Events(namespace, after), p.EventsReply)
        return reply

    def stats(self) -> AgentStats:
        reply: p.StatsReply = self._call(p.Stats(), p.StatsReply)
        return reply.stats

    # --- whole operations ----------------------------------------------------------------

    def slot(self, slot: int, nbytes: int | None = None) -> Bytes:
        """A read-only uint8 view of a slot's payload in the shared pool, to load from.
        Raises AgentUnavailable when the pool file no longer backs the mapping (a copy would
        end the process with SIGBUS) and ValueError for a slot or size out of the pool."""
        return self._view(self.pool, slot, nbytes)

    def staging_slot(self, slot: int, nbytes: int | None = None) -> Bytes:
        """A writable uint8 view of a staging slot (`Grant.staging`), to store into; raises
        as `slot` does."""
        return self._view(self.staging, slot, nbytes)

    @property
    def staging_capacity(self) -> int:
        """How many chunks one store round can stage (the agent's staging slots)."""
        if self.staging is None:
            self.connect()
        assert self.staging is not None
        return self.staging.geometry.slot_count

    def _view(self, pool: PoolMap | None, slot: int, nbytes: int | None) -> Bytes:
        return _slot_view(_intact(pool), slot, nbytes)

    def still_granted(self, grant: Grant, i: int) -> bool:
        """Whether slot `grant.slots[i]` still holds the chunk it was granted for: checked
        after copying, it tells whether the copy read (or wrote) only that chunk's bytes."""
        pool = self.pool
        return pool is not None and pool.generation(grant.slots[i]) == grant.generations[i]

    def store(
        self,
        namespace: str,
        keys: Sequence[bytes],
        rows: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
    ) -> StoreResult:
        """Store rows (buffers of equal size) under keys: allocate, copy into the staging
        area, commit (the agent copies them into the pool and seals them), as many rounds as
        the staging area needs. `parents` as for `allocate`.

        Keys the agent already holds are skipped without copying; keys it has no staging slot
        for right now are stored in a later round, or skipped once the timeout passed. Each
        slot's generation is checked before its copy: a lease that expired meanwhile raises
        LeaseLost.
        """
        views, nbytes = _equal_rows(keys, rows)
        if not views:
            return StoreResult(0, 0)
        stored = skipped = 0
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.timeout
        # Two rounds overlap: while the agent copies one round's staged chunks into the pool
        # (its Commit sent ahead), this thread stages the next; each may hold half the area.
        size = max(1, self.staging_capacity // 2)
        ahead: tuple[bytes, int] | None = None
        try:
            while pending:
                batch, pending = pending[:size], pending[size:]
                grant = self.allocate(
                    namespace,
                    [keys[i] for i in batch],
                    nbytes,
                    None if parents is None else [parents[i] for i in batch],
                )
                staged = (
                    self.stage(grant, [views[i] for i in batch], nbytes)
                    if grant.lease
                    else Staged([], b"")
                )
                if ahead is not None:
                    self._commit_done(*ahead)
                    ahead = None
                if grant.lease:
                    ahead = (self._commit_ahead(grant.lease, staged), grant.lease)
                granted = sum(1 for s in grant.slots if s >= 0)
                later = [
                    i
                    for i, status in zip(batch, grant.status, strict=True)
                    if status == p.StoreStatus.STAGING_FULL
                ]
                stored += granted
                skipped += len(batch) - granted - len(later)
                if later and not granted and ahead is None:  # others hold every staging slot
                    if time.monotonic() > deadline:
                        skipped += len(later) + len(pending)
                        break
                    time.sleep(0.001)
                pending = later + pending
            if ahead is not None:
                self._commit_done(*ahead)
                ahead = None
        finally:
            if ahead is not None:  # leave no reply behind; the store failed anyway
                with contextlib.suppress(AgentError):
                    self._commit_done(*ahead)
        return StoreResult(stored, skipped)

    def stage(self, grant: Grant, views: Sequence[Bytes], nbytes: int) -> Staged:
        """Copy rows (one per key of the grant) into their granted staging slots and return
        the staging sums of the rows staged, for `commit`: each made of this client's own
        row while it is copied, so bytes another process writes into the slot before the
        agent copies it are caught there. On any failure the lease is aborted.

        A row is summed by lanes (numpy: several times memcpy's speed, letting go of the
        GIL) unless the GIL was lately found contended, then by CRC-32 holding it, where the
        agent checks those (shm/pool.py: copy_summed): lane-summed rows slower than the GIL
        alone explains had to wait for it (client/gil.py)."""
        sums: list[int] = []
        kinds = bytearray()
        crc = self.hello is not None and "crc32" in self.hello.sums
        try:
            staging = _intact(self.staging)
            for i, (view, slot) in enumerate(zip(views, grant.slots, strict=True)):
                if slot >= 0:
                    if not self.still_granted(grant, i):
                        raise LeaseLost(f"lease {grant.lease} expired before its copy")
                    into = _slot_view(staging, grant.staging[i], nbytes)
                    began = time.monotonic()
                    kind = SUM_CRC32 if crc and self.gil.contended(began) else SUM_LANES
                    sums.append(copy_summed(into, view, of_source=True, kind=kind))
                    kinds.append(kind)
                    if kind == SUM_LANES:
                        self.gil.lane_row(nbytes, began, time.monotonic())
        except BaseException:
            self.abort(grant.lease)
            raise
        return Staged(sums, bytes(kinds) if any(kinds) else b"")

    def load_into(
        self,
        namespace: str,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        source: str = "",
        key_digests: Sequence[int] | None = None,
    ) -> list[bool]:
        """Copy the held chunks among keys into `outs`; returns which keys were copied whole
        from their own chunk. Buffers larger than a slot are refused (ValueError).
        `key_digests`: the keys' index digests, where the caller has them already.

        The published index is probed key by key in plain integers (`find_one`): in vLLM's
        scheduler process numpy's gathers let go of the GIL and wait to take it back
        (`shm.pool.copy_held`), which made 512 keys take 26 ms there instead of 0.5 ms."""
        views = [_as_bytes(o) for o in outs]
        if len(views) != len(keys):
            raise ValueError("load needs one output buffer per key")
        if self.hello is None:
            self.connect()
        too_big = [v.nbytes for v in views if v.nbytes > self.slot_bytes]
        if too_big:
            raise ValueError(
                f"a buffer of {too_big[0]} bytes is larger than a slot ({self.slot_bytes} bytes)"
            )
        index = self._live_index()
        if index is not None and not source and self.pool is not None:
            if key_digests is None:
                key_digests = digests(namespace, keys).tolist()
            elif len(key_digests) != len(keys):
                raise ValueError("load needs one index digest per key")
            found = [index.find_one(d) for d in key_digests]
            if self.pool_answers(all(slot >= 0 for slot, _ in found)):
                return self._load_unleased(views, found)
        grant = self.begin_load(namespace, keys, source)
        if grant.lease == 0:
            return [False] * len(keys)
        loaded = [False] * len(keys)
        try:
            pool = _intact(self.pool)
            for i, (view, slot) in enumerate(zip(views, grant.slots, strict=True)):
                if slot >= 0:
                    copy_held(view, _slot_view(pool, slot, view.nbytes))
                    loaded[i] = self.still_granted(grant, i)
        finally:
            self.end_load(grant.lease)
        return loaded

    def _load_unleased(self, views: list[Bytes], found: list[tuple[int, int]]) -> list[bool]:
        """Copy chunks the published index names straight out of the pool, without a
        lease: a slot's stamp is its generation before and after the copy, or the copy is
        not counted (the agent changes a slot's stamp before it writes any of its bytes, so
        a copy that saw one new byte sees the new stamp after). Only the agent writes the
        pool, so the bytes are the sealed ones. The bytes are reported with the lookups."""
        pool = _intact(self.pool)
        loaded = [False] * len(views)
        nbytes = 0
        for i, (view, (slot, gen)) in enumerate(zip(views, found, strict=True)):
            if slot >= 0 and pool.generation(slot) == gen:
                copy_held(view, pool.payload(slot, view.nbytes))
                if pool.generation(slot) == gen:
                    loaded[i] = True
                    nbytes += view.nbytes
        self.reports.loaded(nbytes)
        return loaded

    # --- requests ------------------------------------------------------------------------

    def _call(self, request: p.Request, expect: type[Any]) -> Any:
        """One request within one timeout, hello included: say hello first when this client
        has not (or not since a timeout), and again once if the agent does not know this
        connection. Threads may share a client: one request at a time on the socket, while
        copies of chunk bytes happen outside this lock."""
        if self.reports.pending:
            self.flush_reports()  # what was looked up here reaches the agent before it answers
        deadline = time.monotonic() + self.timeout
        with self._transport.lock:
            try:
                if self.hello is None:
                    self._connect_locked(deadline)
                return self._transport.exchange(request, expect, deadline)
            except NotRegistered:
                self.hello = None
                if isinstance(request, p.Commit):
                    raise _void(request.lease) from None
            try:
                self._connect_locked(deadline)
                return self._transport.exchange(request, expect, deadline)
            except NotRegistered as exc:
                raise AgentRefused(f"agent refused the hello of this client: {exc}") from None


__all__ = [
    "AgentClient",
    "AgentError",
    "AgentRefused",
    "AgentUnavailable",
    "Grant",
    "LeaseLost",
    "LookupResult",
    "Staged",
    "StoreResult",
]
