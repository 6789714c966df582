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

This module holds the directory traffic (announcements, withdrawals, lookups); membership,
connections and reads have modules of their own (`membership`, `connection`, `reads`), and
the serving side is `server`.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.tiers.base import CorruptChunk, SecondaryTier, TierUsage
from kvtier.agent.tiers.factory import TierContext
from kvtier.agent.tiers.peer.connection import Connection, Connections, call_all
from kvtier.agent.tiers.peer.directory import by_home
from kvtier.agent.tiers.peer.reads import Holders, Reader
from kvtier.agent.tiers.peer.server import PeerServer
from kvtier.agent.tiers.peer.wire import Announce, Holds, WhoHas, Withdraw, decode_holders
from kvtier.api.config import PeerTierConfig
from kvtier.api.stats import PeerCount, PeerCounts, Tally, TierStats

log = logging.getLogger("kvtier.agent.peers")
ANNOUNCE_BATCH = 4096  # keys per announcement message (re-announcing a whole pool)


class PeerTier(SecondaryTier):
    kind = "peer"

    def __init__(self, name: str, config: PeerTierConfig, server: PeerServer) -> None:
        """`server`: what answers other agents from this agent's pool, and follows the
        tier's membership, which this side uses too."""
        super().__init__(name)
        self.config = config
        self.exists_seconds = config.timeout_seconds  # each home's call has this timeout
        self.server = server
        self.me = server.endpoint
        self.membership = server.membership
        self._connections = Connections(
            server.keys, self.membership.server_key, config.timeout_seconds
        )
        self._holders = Holders()
        self._reader = Reader(
            server, self._connections, self._holders, config.timeout_seconds, self._count
        )
        self._lock = threading.Lock()
        # What this agent announced it holds (stored here, or found in its pool at start),
        # re-announced before the homes' entries expire and whenever the homes move.
        self._held: dict[str, set[bytes]] = {}
        self._seeded = False
        self._announced_at = -float("inf")
        self._announced_to: list[str] = []  # the membership the last announcement used
        self._retained_for: set[str] = set()  # the membership the directory was pruned to
        self._counts: Tally[PeerCounts] = Tally(PeerCounts())
        self._evictions_seen: dict[str, int] = {}  # namespace -> event seq withdrawn up to
        self._expired_at = time.monotonic()

    def peers(self) -> list[str]:
        """The other live agents' peer endpoints (as last read)."""
        return self.membership.peers()

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
                    self._connections.to(home).send(what(namespace, batch, self.me))
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
        members = self.membership.live()
        now = time.monotonic()
        if members == self._announced_to and now - self._announced_at < self.reannounce_seconds():
            return
        self._announced_to, self._announced_at = list(members), now
        with self._lock:
            held = {namespace: list(keys) for namespace, keys in self._held.items() if keys}
        for namespace, keys in held.items():
            # only what the pool still holds: a chunk dropped without an eviction event (found
            # damaged) must not be announced again
            gone = set(self.server.host.missing(namespace, keys))
            if gone:
                with self._lock:
                    self._held[namespace].difference_update(gone)
                held[namespace] = keys = [key for key in keys if key not in gone]
            self._tell_homes(namespace, keys, Announce)
        self._count("reannounced", sum(len(keys) for keys in held.values()))

    def _seed(self) -> None:
        """A restarted agent re-indexed a warm pool: what it holds is announced like what is
        stored after the start."""
        ready = self.server.host.held()
        with self._lock:
            for namespace, keys in ready.items():
                self._held.setdefault(namespace, set()).update(keys)
                self._evictions_seen.setdefault(namespace, 0)
        self._seeded = True

    def _by_home(self, keys: list[bytes]) -> dict[str, list[int]]:
        """Positions in `keys`, grouped by the live member each key's home is."""
        members = self.membership.live()
        if not keys:
            return {}
        if len(members) == 1:
            return {members[0]: list(range(len(keys)))}
        return by_home(keys, members)

    def _withdraw_evicted(self) -> None:
        """Tell the homes about chunks the pool evicted since last time, so lookups stop
        sending askers here for them (the entries would expire anyway, later)."""
        host = self.server.host
        for namespace, seen in list(self._evictions_seen.items()):
            batch = host.events_since(namespace, seen)
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
        if not self.membership.is_member(source):
            self._count("refused_sources")
            log.warning("refused a request naming %r as its source: not a member", source[:200])
            return
        reply = self._connections.to(source).call(Holds(namespace, keys))
        if reply:
            for key, held in zip(keys, msgspec.msgpack.decode(reply[0]), strict=True):
                if held:
                    self._holders.note(namespace, key, source, direct=True)
            self._holders.trim()

    def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Keys a direct-mode source holds, then the homes asked for the others (always: a
        holder that evicted a chunk has withdrawn it there)."""
        direct = self._holders.direct
        if direct:
            found = [(namespace, key) in direct for key in keys]
            asked = [i for i, known in enumerate(found) if not known]
            groups = {
                home: [asked[j] for j in positions]
                for home, positions in self._by_home([keys[i] for i in asked]).items()
            }
        else:  # the usual case: no direct-mode source named, every key asked of its home
            found = [False] * len(keys)
            groups = self._by_home(keys)
        answers: list[tuple[list[int], list[str]]] = []
        remote: list[tuple[list[int], Connection, WhoHas]] = []
        local: list[int] = []
        for home, indexes in groups.items():
            if home == self.me:
                local = indexes
            else:
                batch = [keys[i] for i in indexes]
                remote.append((indexes, self._connections.to(home), WhoHas(namespace, batch)))

        def here() -> None:  # the keys homed here, while the other homes are asked
            if local:
                batch = [keys[i] for i in local]
                members = self.membership.member_set
                answers.append((local, self.server.directory.holders(namespace, batch, members)))

        replies = call_all(
            [(c, m) for _, c, m in remote], self.config.timeout_seconds, meanwhile=here
        )
        for (indexes, _, _), reply in zip(remote, replies, strict=True):
            holders = decode_holders(reply[0]) if reply else [""] * len(indexes)
            answers.append((indexes, holders))
        known = self._holders.found
        for indexes, holders in answers:
            for i, holder in zip(indexes, holders, strict=True):
                if holder and holder != self.me:
                    self._holders.note(namespace, keys[i], holder)
                    found[i] = True
                elif known:  # a holder it knew of no longer holds the key
                    known.pop((namespace, keys[i]), None)
        self._holders.trim()
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
        """Keys whose holder is not known yet are asked of their homes first; then one
        request and one transfer per holder and batch (`peer_reads`)."""
        unknown = [key for key in keys if (namespace, key) not in self._holders.found]
        if unknown:
            self.exists(namespace, unknown)
        return self._reader.read(namespace, keys, outs)

    def _count(self, what: PeerCount, n: int = 1) -> None:
        self._counts.add(what, n)

    def stats(self, common: TierStats) -> TierStats:
        """What every tier reports, with the peer traffic counters."""
        return msgspec.structs.replace(common, peer=self.counters())

    def counters(self) -> PeerCounts:
        """The traffic since the agent started, and the state now (loans, connections)."""
        counts = self._counts.read()
        counts.lent = self.server.lent()
        counts.refused = self.server.refused
        counts.refused_requests = self.server.refused_requests
        counts.refused_handshakes = self.server.refused_handshakes
        counts.connections = self.open_connections()
        counts.directory_keys = len(self.server.directory)
        return counts

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, len(self._holders.found))

    def maintain(self) -> int:
        """Membership re-read; entries and connections of agents gone dropped, idle
        connections closed; evictions withdrawn; held chunks re-announced when due."""
        live = set(self.membership.live())
        if self._retained_for - live:  # someone left: a pass over the directory, only then
            self.server.directory.retain(live.__contains__)
        self._retained_for = live
        # gone, or serving with another key since (restarted during a key rotation)
        dropped = self._connections.drop_unless(
            lambda endpoint, key: endpoint in live and key == self.membership.server_key(endpoint)
        )
        for endpoint in dropped:
            self._reader.forget_nixl(endpoint)
            self._holders.forget_holder(endpoint)
        closed = self._connections.close_idle(time.monotonic() - self.config.idle_seconds)
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

    def open_connections(self) -> int:
        return self._connections.open_count()

    def close(self) -> None:
        self._reader.close()
        self._connections.close()
        self.server.close()


def build_peer_tier(name: str, config: PeerTierConfig, context: TierContext) -> PeerTier:
    """The peer tier with the server that answers other agents from this agent's pool; only
    its control endpoint and CURVE key are published (NIXL metadata goes to members over the
    authenticated channel, never into a resource)."""
    registry = context.registry
    assert registry is not None  # the config model requires a report target for peers
    # three missed heartbeats, and never under the floor: heartbeats are stamped by other
    # nodes' clocks, in whole seconds
    stale_after = max(config.stale_floor_seconds, 3 * context.report_interval)
    server = PeerServer(config, context.host, registry, stale_after)
    registry.advertise(server.endpoint, server.curve_key)
    return PeerTier(name, config, server)
