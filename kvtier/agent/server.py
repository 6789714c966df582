"""The agent process: a ZMQ ROUTER loop that serves the control protocol.

One thread owns the socket. Requests the pool can answer alone (most of them) are a few
dictionary operations and are answered inline. A lookup or load that must ask secondary
tiers goes to a worker pool; its reply comes back to the loop over an inproc socket and is
sent from there (ZMQ sockets belong to one thread), so a slow tier never stalls other
clients; its time budget counts from the request's arrival, so time spent queued for a worker
is part of it. Lease reaping runs between requests, on the loop's poll timeout.

Every request is decoded against the protocol's bounds and checked completely before
anything changes: a refused request is answered (or, one-way, counted) and leaves the index,
the leases and the pool as they were. A client is bound to its connection by Hello; the
connection's client, never a field of the request, holds the leases it is granted.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import compress
from operator import not_
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

import kvtier
from kvtier.agent.access_log import AccessLog
from kvtier.agent.host.events import NodeEvents
from kvtier.agent.host.index import LeaseError
from kvtier.agent.host.tier import HostTier
from kvtier.agent.report.metrics import AgentMetrics
from kvtier.agent.report.publisher import Reporter
from kvtier.agent.report.registry import make_registry
from kvtier.agent.runtime_checks import check_runtime
from kvtier.agent.tiers.chain import SecondaryTiers
from kvtier.agent.tiers.factory import TierContext
from kvtier.api.config import AgentConfig, ConfigError
from kvtier.api.stats import AgentStats
from kvtier.client import protocol as p
from kvtier.client.liveness import ClientRegistry
from kvtier.client.protocol import Where
from kvtier.shm.files import hold_lock, lock_holder
from kvtier.shm.table import digests

if TYPE_CHECKING:
    from kvtier.agent.report.event_stream import EventStream

log = logging.getLogger("kvtier.agent")

Deferred = Callable[[], p.Reply]
# `Where.MISS` as a plain int: an IntEnum member read in a per-key comprehension costs about
# 70 ns a read (65 µs of a 1k-key lookup), and the wire carries the int either way.
MISS = int(Where.MISS)
MAX_SESSIONS = 4096  # connections that said hello, whose clients are not known gone
PREDECESSOR_WAIT_SECONDS = 10.0


def node_name(config: AgentConfig) -> str:
    """The node this agent serves: the report's node, $NODE_NAME, else the host's name."""
    return config.report.node or os.environ.get("NODE_NAME") or socket.gethostname()


class NotRegistered(ValueError):
    """A request on a connection that has not said hello to this agent process."""


def _listening(path: Path) -> bool:
    """Whether a live process accepts connections on the unix socket at `path` (a socket a
    killed agent left behind refuses them, and is replaced)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


class AlreadyServed(RuntimeError):
    """Another agent holds this agent's pool: two would both write it and take each other's
    socket, and clients would lose what they stored."""


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        check_runtime(config)
        self.config = config
        # Held for this process's life: one agent per pool. A predecessor still shutting
        # down (a rolling update that surged) is waited for, a while.
        lock = config.pool_path.with_name(config.pool_path.name + ".lock")
        held = hold_lock(lock, PREDECESSOR_WAIT_SECONDS)
        if held is None:
            raise AlreadyServed(
                f"another agent (pid {lock_holder(lock)}) serves {config.pool_path} "
                f"(host.poolDir, name); waited {PREDECESSOR_WAIT_SECONDS:.0f} s for it. Fix: "
                "stop it, or give this agent a name, host.poolDir and runDir of its own"
            )
        self._pool_lock = held
        if _listening(config.socket_path):  # another agent's, of another pool
            raise AlreadyServed(
                f"another agent listens on {config.socket_path} (runDir); fix: give each agent "
                "a runDir of its own"
            )
        self.metrics = AgentMetrics()
        self.boot = secrets.randbits(31) + 1  # names this process in lease ids, generations
        self.host = HostTier(
            config.host,
            config.pool_path,
            self.metrics,
            config.lease_timeout_seconds,
            self.boot,
        )
        self.registry = make_registry(config.report)
        # Every tier's stores and removals, for engines' KV events and the node's stream.
        self.events = NodeEvents(node_name(config))
        context = TierContext(self.host, self.registry, config.report.interval_seconds)
        self.tiers = (
            SecondaryTiers(
                config.tiers,
                self.host,
                self.metrics,
                config.tier_budget_seconds,
                context,
                config.reap_interval_seconds,
                self.events,
            )
            if config.tiers
            else None
        )
        self.event_stream: EventStream | None = None
        if config.events.enabled:
            from kvtier.agent.report.event_stream import EventStream

            self.event_stream = EventStream(config.events, self.events, self.pump_events)
        self.clients = ClientRegistry(config.run_dir / "clients")
        self.access_log = AccessLog(  # what `kvtier trace` exports
            config.access_log.max_keys, config.access_log.sample_rate
        )
        self._sessions: dict[bytes, str] = {}  # connection identity -> client id
        self.stopping = threading.Event()
        self.metrics_port: int | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        config.socket_path.unlink(missing_ok=True)
        self._sock.bind(config.endpoint)
        self._replies_addr = f"inproc://kvtier-replies-{id(self)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._replies_addr)
        self._local = threading.local()
        self._workers = ThreadPoolExecutor(8, thread_name_prefix="kvtier-request")
        self.reporter = (
            Reporter(config.report, self.registry, self.stats)
            if self.registry is not None
            else None
        )
        self.metrics.count_from(self.stats)

    def pump_events(self) -> None:
        """The pool's new events into the node's (`events`)."""
        self.events.pump(self.host.events_since, self.host.held)

    def stats(self) -> AgentStats:
        return AgentStats(
            name=self.config.name,
            host=self.host.stats(),
            tiers=self.tiers.stats() if self.tiers is not None else [],
            peers=self.tiers.peers() if self.tiers is not None else [],
            clients=len(self.clients),
            metrics_port=self.metrics_port,
            events=self.event_stream.stats() if self.event_stream is not None else None,
        )

    def serve(self) -> None:
        cfg = self.config
        if cfg.metrics.enabled:  # first: a port taken stops the agent before anything runs
            try:
                self.metrics_port = self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
            except OSError as exc:
                where = f"{cfg.metrics.host}:{cfg.metrics.port}"
                taken = exc.errno == errno.EADDRINUSE
                raise ConfigError(
                    [
                        f"metrics.port: cannot listen on {where} (in use); fix: a port nothing "
                        "else holds, or 0 for any"
                        if taken
                        else f"metrics.host: cannot listen on {where} ({exc.strerror or exc}); "
                        "fix: an address of this host, such as 0.0.0.0"
                    ]
                ) from None
        if self.event_stream is not None:
            self.event_stream.start()
        if self.reporter is not None:
            self.reporter.start()
        log.info(
            "agent ready",
            extra={
                "endpoint": cfg.endpoint,
                "pool": str(cfg.pool_path),
                "slots": self.host.geometry.slot_count,
                "slot_bytes": self.host.geometry.payload_bytes,
                "policy": cfg.host.policy,
                "tiers": [f"{t.name}:{t.kind}" for t in cfg.tiers],
                "metrics_port": self.metrics_port,
            },
        )
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        interval_ms = int(cfg.reap_interval_seconds * 1000)
        next_reap = time.monotonic() + cfg.reap_interval_seconds
        while not self.stopping.is_set():
            ready = dict(poller.poll(interval_ms))
            if self._replies in ready:
                self._sock.send_multipart(self._replies.recv_multipart())
            if self._sock in ready:
                self._handle(self._sock.recv_multipart())
            if time.monotonic() >= next_reap:
                self._reap()
                next_reap = time.monotonic() + cfg.reap_interval_seconds
        self.close()

    def _reap(self) -> None:
        dead = self.clients.gone()
        self.host.reclaim(time.monotonic(), dead)
        if dead:
            gone = set(dead)
            self._sessions = {i: c for i, c in self._sessions.items() if c not in gone}
        self.clients.sweep()

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.stop()
        if self.registry is not None:
            self.registry.close()
        self._workers.shutdown(wait=True, cancel_futures=True)
        if self.event_stream is not None:
            self.event_stream.close()
        self._sock.close()
        self._replies.close()
        self.config.socket_path.unlink(missing_ok=True)
        if self.tiers is not None:
            self.tiers.close()
        self.host.close()
        os.close(self._pool_lock)
        log.info("agent stopped")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.metrics.refused.labels("invalid", p.INVALID).inc()
            return
        identity, rid, body = frames
        started = time.perf_counter()
        op = "invalid"
        reply: p.Reply | Deferred
        try:
            request = p.request_decoder.decode(body)
            op = str(type(request).__struct_config__.tag)
            p.check(request)
            reply = self._dispatch(identity, request, time.monotonic())
        except Exception as exc:
            reply = self._refusal(op, exc)
        if callable(reply):
            self._workers.submit(self._run_deferred, identity, rid, reply, op, started)
            return
        if rid != p.ONE_WAY:
            self._sock.send_multipart([identity, rid, p.encode(reply)])
        elapsed = time.perf_counter() - started
        self.host.after_reply()
        self.metrics.request_seconds.labels(op).observe(elapsed)

    def _refusal(self, op: str, exc: Exception) -> p.ErrorReply:
        """The answer to a request that changed nothing; an unexpected error is logged, as
        it is a bug, but answered all the same."""
        if isinstance(exc, NotRegistered):
            code = p.NOT_REGISTERED
        elif isinstance(exc, LeaseError):
            code = p.LEASE
        elif isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError, ValueError)):
            code = p.INVALID
        else:
            log.exception("request %s failed", op)
            code = "internal"
        self.metrics.refused.labels(op, code).inc()
        return p.ErrorReply(str(exc), code)

    def _run_deferred(
        self, identity: bytes, rid: bytes, work: Deferred, op: str, started: float
    ) -> None:
        try:
            reply = work()
        except Exception as exc:
            log.exception("request %s failed", op)
            reply = p.ErrorReply(f"{type(exc).__name__}: {exc}", "internal")
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(zmq.PUSH)
            push.connect(self._replies_addr)
        push.send_multipart([identity, rid, p.encode(reply)])
        self.metrics.request_seconds.labels(op).observe(time.perf_counter() - started)

    def _client(self, identity: bytes) -> str:
        client = self._sessions.get(identity)
        if client is None:
            raise NotRegistered(
                "this connection has not said hello to this agent process (it restarted?); "
                "say hello again: leases granted before are void"
            )
        return client

    def _dispatch(self, identity: bytes, request: p.Request, now: float) -> p.Reply | Deferred:
        host = self.host
        if isinstance(request, p.Hello):
            return self._hello(identity, request)
        client = self._client(identity)
        deadline = now + self.config.tier_budget_seconds
        match request:
            case p.Lookup(namespace, keys, source, sent):
                ds = np.frombuffer(sent, "<u8") if sent else digests(namespace, keys)
                hits, prefix = host.lookup(namespace, keys, ds)
                # logged by digest, as lookups clients answer are reported (Looked)
                self.access_log.record_digests(namespace, ds, hits)
                if self.tiers is not None and prefix < len(keys):
                    return lambda: self._lookup_tiers(namespace, keys, hits, source, deadline)
                return p.LookupReply(hits, prefix, [0 if h else MISS for h in hits])
            case p.Looked(namespace, reported, sizes, loaded_bytes):
                host.count_loaded(loaded_bytes)
                # Lookups a client answered from the published index: the one place where
                # they reach the counters, the policy's recency and the access log.
                start = 0
                for size in sizes:
                    part = reported[start : start + 8 * size]
                    start += len(part)
                    ds = np.frombuffer(part, "<u8")
                    hits = host.lookup_digests(namespace, ds)
                    self.access_log.record_digests(namespace, ds, hits)
            case p.Allocate(namespace, keys, nbytes, parents, status):
                lease, slots, generations, staged = host.allocate(
                    client, namespace, keys, nbytes, parents
                )
                staging = list(staged)
                if status:  # each key's outcome out of band
                    return p.LeaseReply(
                        lease,
                        p.granted_slots(slots),
                        [],
                        generations,
                        staging,
                        p.store_status(slots),
                    )
                return p.LeaseReply(lease, slots, [], generations, staging)  # in band
            case p.Commit(lease, sums, kinds):
                # the agent copies the staged chunks into the pool: off the request loop
                return lambda: self._commit(lease, client, sums, kinds)
            case p.Abort(lease):
                host.abort(lease, client)
            case p.BeginLoad(namespace, keys, source):
                missing = host.missing(namespace, keys) if self.tiers is not None else []
                if missing:
                    return lambda: self._load_with_promotion(
                        client, namespace, keys, missing, source, deadline
                    )
                lease, slots, generations, _ = host.begin_load(client, namespace, keys)
                where = [0 if s >= 0 else MISS for s in slots]
                return p.LeaseReply(lease, slots, where, generations)
            case p.EndLoad(lease):
                host.end_load(lease, client)
            case p.Events(namespace, after):
                self.pump_events()
                node = self.events.since(namespace, after)
                runs = [p.EventRun(r.medium, r.locality, r.removed, r.keys) for r in node.runs]
                pool = [r for r in runs if (r.medium, r.locality) == ("CPU", "LOCAL")]
                return p.EventsReply(
                    node.seq,
                    [k for r in pool if not r.removed for k in r.keys],
                    [k for r in pool if r.removed for k in r.keys],
                    node.truncated,
                    runs,
                    self.events.owner,
                    self.boot,
                )
            case p.Stats():
                return p.StatsReply(self.stats())
            case p.AccessLog(after):
                return self.access_log.reply(after)
        return p.Ack()

    def _commit(self, lease: int, client: str, sums: list[int] | None, kinds: bytes) -> p.Reply:
        try:
            self.host.commit(lease, client, sums, kinds)
        except (LeaseError, ValueError) as exc:
            return self._refusal("commit", exc)
        return p.Ack()

    def _ask_source(self, source: str, namespace: str, keys: list[bytes]) -> None:
        """Direct mode: learn from the named agent which of the keys it holds."""
        if source and self.tiers is not None and keys:
            self.tiers.ask_source(source, namespace, keys)

    def _lookup_tiers(
        self, namespace: str, keys: list[bytes], hits: list[bool], source: str, deadline: float
    ) -> p.Reply:
        assert self.tiers is not None
        # usually the pool holds none of them: every key is asked, in order
        missing = list(compress(range(len(keys)), map(not_, hits))) if any(hits) else None
        asked = keys if missing is None else [keys[i] for i in missing]
        self._ask_source(source, namespace, asked)
        found = self.tiers.locate(namespace, asked, deadline)
        where = found
        if missing is not None:
            where = [0 if hit else MISS for hit in hits]
            for i, position in zip(missing, found, strict=True):
                where[i] = position
        all_hits = [w != MISS for w in where]
        prefix = all_hits.index(False) if False in all_hits else len(keys)
        return p.LookupReply(all_hits, prefix, where)

    def _load_with_promotion(
        self,
        client: str,
        namespace: str,
        keys: list[bytes],
        missing: list[bytes],
        source: str,
        deadline: float,
    ) -> p.Reply:
        """`missing`: the keys the pool did not hold when the request arrived."""
        assert self.tiers is not None
        self._ask_source(source, namespace, missing)
        promoted = self.tiers.promote(namespace, missing, deadline)
        lease, slots, generations, _ = self.host.begin_load(client, namespace, keys)
        where = [
            MISS if slot < 0 else promoted.get(key, 0)
            for key, slot in zip(keys, slots, strict=True)
        ]
        return p.LeaseReply(lease, slots, where, generations)

    def _hello(self, identity: bytes, hello: p.Hello) -> p.HelloReply:
        if hello.protocol != p.PROTOCOL_VERSION:
            raise ValueError(
                f"client speaks protocol {hello.protocol}, agent {p.PROTOCOL_VERSION}; "
                "run a plug-in and agent of the same kvtier release"
            )
        self.clients.register(hello.client, hello.lock)
        # A client's earlier connections are dead (it rebuilds its socket after a timeout);
        # past the cap the oldest session goes, and its client simply says hello again.
        self._sessions = {i: c for i, c in self._sessions.items() if c != hello.client}
        if len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        self._sessions[identity] = hello.client
        g = self.host.geometry
        return p.HelloReply(
            pool=str(self.config.pool_path),
            payload_bytes=g.payload_bytes,
            slot_count=g.slot_count,
            lease_timeout_seconds=self.config.lease_timeout_seconds,
            agent_version=kvtier.__version__,
            tiers=self.tiers.names if self.tiers is not None else [],
            boot=self.boot,
            sums=["crc32"],
        )


def run_agent(config: AgentConfig) -> None:
    """Run an agent until SIGTERM or SIGINT, then shut down cleanly (the pool file stays for
    a warm restart)."""
    agent = Agent(config)

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping on signal %d", signum)
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.serve()
