"""The agent process: a ZMQ ROUTER loop that serves the control protocol.

One thread owns the socket; every request is a few dictionary operations, so the loop
never waits on I/O of chunk bytes (clients copy those through the shared pool themselves).
Lease reaping runs between requests, on the loop's poll timeout.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import msgspec
import zmq

import kvtier
from kvtier.agent import protocol as p
from kvtier.agent.config import AgentConfig, check_runtime
from kvtier.agent.host_tier import HostTier
from kvtier.agent.liveness import ClientRegistry
from kvtier.agent.metrics import AgentMetrics

log = logging.getLogger("kvtier.agent")


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        check_runtime(config)
        self.config = config
        self.metrics = AgentMetrics()
        self.host = HostTier(
            config.host, config.pool_path, self.metrics, config.lease_timeout_seconds
        )
        self.clients = ClientRegistry(config.run_dir / "clients")
        self.stopping = threading.Event()
        self.metrics_port: int | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        config.socket_path.unlink(missing_ok=True)
        self._sock.bind(config.endpoint)

    def serve(self) -> None:
        cfg = self.config
        if cfg.metrics.enabled:
            self.metrics_port = self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
        log.info(
            "agent ready",
            extra={
                "endpoint": cfg.endpoint,
                "pool": str(cfg.pool_path),
                "slots": self.host.geometry.slot_count,
                "slot_bytes": self.host.geometry.payload_bytes,
                "policy": cfg.host.policy,
                "metrics_port": self.metrics_port,
            },
        )
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        interval_ms = int(cfg.reap_interval_seconds * 1000)
        next_reap = time.monotonic() + cfg.reap_interval_seconds
        while not self.stopping.is_set():
            if poller.poll(interval_ms):
                self._handle(self._sock.recv_multipart())
            if time.monotonic() >= next_reap:
                self.host.reclaim(time.monotonic(), self.clients.gone())
                next_reap = time.monotonic() + cfg.reap_interval_seconds
        self.close()

    def close(self) -> None:
        self._sock.close()
        self.config.socket_path.unlink(missing_ok=True)
        self.host.close()
        log.info("agent stopped")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        identity, rid, body = frames
        started = time.perf_counter()
        op = "invalid"
        try:
            request = p.request_decoder.decode(body)
            op = str(type(request).__struct_config__.tag)
            reply = self._dispatch(request)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            reply = p.ErrorReply(str(exc))
        if rid != p.ONE_WAY:
            self._sock.send_multipart([identity, rid, p.encode(reply)])
        elapsed = time.perf_counter() - started
        self.host.after_reply()
        self.metrics.request_seconds.labels(op).observe(elapsed)

    def _dispatch(self, request: p.Request) -> p.Reply:
        host = self.host
        match request:
            case p.Lookup(namespace, keys):
                hits, prefix = host.lookup(namespace, keys)
                return p.LookupReply(hits, prefix)
            case p.Allocate(client, namespace, keys, nbytes):
                return p.LeaseReply(*host.allocate(client, namespace, keys, nbytes))
            case p.Commit(lease):
                host.commit(lease)
            case p.Abort(lease):
                host.abort(lease)
            case p.BeginLoad(client, namespace, keys):
                return p.LeaseReply(*host.begin_load(client, namespace, keys))
            case p.EndLoad(lease):
                host.end_load(lease)
            case p.Hello(client, lock, protocol):
                if protocol != p.PROTOCOL_VERSION:
                    raise ValueError(
                        f"client speaks protocol {protocol}, agent {p.PROTOCOL_VERSION}; "
                        "run a plug-in and agent of the same kvtier release"
                    )
                self.clients.register(client, lock)
                g = host.geometry
                return p.HelloReply(
                    pool=str(self.config.pool_path),
                    payload_bytes=g.payload_bytes,
                    slot_count=g.slot_count,
                    lease_timeout_seconds=self.config.lease_timeout_seconds,
                    agent_version=kvtier.__version__,
                )
            case p.Stats():
                return p.StatsReply(
                    {
                        **host.stats(),
                        "clients": len(self.clients),
                        "name": self.config.name,
                        "metrics_port": self.metrics_port,
                    }
                )
        return p.Ack()


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
