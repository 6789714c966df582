"""`kvtier bench peers`: chunks fetched from another node's agent over each of the peer
tier's data paths (NIXL, ZMQ), next to a raw TCP stream of the same bytes between the same two
addresses, same run; and the round trip of a batched lookup that must ask the keys' home
agents. Two settings: both agents on loopback, and each agent in a network namespace of its
own (veth pairs on a bridge, their own addresses, UCX pinned to TCP), as on two machines;
the second needs root and is reported as skipped without it."""

from __future__ import annotations

import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.agent.tiers.nixl_path import available
from kvtier.agent.tiers.peer.wire import write_keys
from kvtier.api.config import AgentConfig
from kvtier.api.pool_layout import PAGE
from kvtier.api.stats import PeerCounts
from kvtier.bench import netns
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess, scratch_peer_config

MiB = 1 << 20
NS = "bench-peers"
PEER_PORT = 5557
TCP_PORT = 5600
# Between namespaces of one host UCX must use its TCP transport on the veth (its
# shared-memory transports do not cross namespaces, and loopback is not the other node's).
# Its TCP transport serves a READ in 8 KiB segments by default, each a round trip through the
# holder's software; 256 KiB segments and 4 MiB socket buffers (this machine's maximum) took
# a raw NIXL READ between two namespaces from about 0.2x a TCP stream to 0.4-0.8x (noisy).
UCX_BETWEEN_HOSTS = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "eth0",
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    "UCX_TCP_SNDBUF": "4m",
    "UCX_TCP_RCVBUF": "4m",
}


@dataclass
class Place:
    """Where the two agents run: `prefix` per agent (a namespace, or nothing) and the
    address each binds its peer endpoint to."""

    name: str
    addresses: tuple[str, str] = ("127.0.0.1", "127.0.0.1")
    prefixes: tuple[list[str], list[str]] = field(default_factory=lambda: ([], []))

    def tcp_gbps(self, nbytes: int, chunk: int) -> float:
        """A raw TCP stream from the first agent's address to the second's."""
        if not self.prefixes[0]:
            return raw_tcp_gbps(nbytes, chunk)
        stream = [self.addresses[1], str(TCP_PORT), str(nbytes), str(chunk)]
        me = [sys.executable, "-m", "kvtier.bench.peers"]
        sink = subprocess.Popen(
            [*self.prefixes[1], *me, "sink", *stream],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                sent = subprocess.run(
                    [*self.prefixes[0], *me, "source", *stream],
                    capture_output=True,
                )
                if sent.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # the sink is not listening yet
            out, _ = sink.communicate(timeout=60)
        finally:
            if sink.poll() is None:
                sink.kill()
        return float(out.strip())


def _memory(nbytes: int) -> memoryview:
    """`nbytes` of memory of its own, touched before any timing: a load fills distinct
    pool slots from distinct slots of the holder (one buffer sent over and over would stay
    in the CPU's cache, which no load does)."""
    return memoryview(np.ones(nbytes, np.uint8).data)


def _stream_in(conn: socket.socket, sink: memoryview, chunk: int) -> int:
    received = 0
    while received < len(sink):
        n = conn.recv_into(sink[received : received + chunk - received % chunk])
        if n == 0:
            break
        received += n
    return received


def _stream_out(address: str, port: int, payload: memoryview, chunk: int) -> None:
    with socket.create_connection((address, port)) as conn:
        for start in range(0, len(payload), chunk):
            conn.sendall(payload[start : start + chunk])


def raw_tcp_gbps(nbytes: int, chunk: int) -> float:
    """One loopback TCP stream moving `nbytes` from memory of its own into memory of its
    own, in `chunk` writes."""
    payload, sink = _memory(nbytes), _memory(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    thread = threading.Thread(target=_stream_out, args=("127.0.0.1", port, payload, chunk))
    started = time.perf_counter()
    thread.start()
    conn, _ = server.accept()
    with conn:
        received = _stream_in(conn, sink, chunk)
    elapsed = time.perf_counter() - started
    thread.join()
    server.close()
    return received / elapsed / 1e9


def node(
    scratch: Path, name: str, row: int, slots: int, data_path: str, address: str
) -> AgentConfig:
    """`data_path` a `PATHS` name: "-curve" ones authenticated with the tier's CURVE key
    pair, as every tier the operator makes runs, "-sealed" with `encryptBytes`; "nixl" and
    "zmq" without keys."""
    bind = f"tcp://{address}:{PEER_PORT}" if address != "127.0.0.1" else "tcp://127.0.0.1:*"
    path, *options = data_path.split("-")
    peer: dict[str, Any] = {"timeoutSeconds": 5, "dataPath": path, "bind": bind}
    if "curve" in options:
        keys = scratch / "curve"
        if not keys.exists():
            write_keys(keys)
        peer["curveKeyDir"] = str(keys)
    if "sealed" in options:
        peer["encryptBytes"] = True
    return scratch_peer_config(
        scratch,
        name,
        PAGE + slots * (row + PAGE),
        row,
        scratch / f"registry-{name.rsplit('-', 1)[0]}",
        peer,
        tierBudgetSeconds=30,
    )


def measure(
    scratch: Path, place: Place, data_path: str, row: int, chunks: int, rounds: int, lookups: int
) -> tuple[list[float], list[float], list[float], PeerCounts]:
    """Per round: GB/s bringing `chunks` rows held by another agent into this one's pool, and
    raw TCP GB/s moving the same bytes just before (this machine's speed drifts, so each
    round is compared with its own baseline); then remote lookup latencies (µs) and the
    peer tier's counters."""
    tag = f"{place.name}-{data_path}"
    a = node(scratch, f"{tag}-a", row, chunks * (rounds + 1) + 8, data_path, place.addresses[0])
    # One request promotes at most a quarter of the pool (a slow tier cannot drain it).
    b = node(scratch, f"{tag}-b", row, 4 * chunks + 8, data_path, place.addresses[1])
    try:
        return _measure_pair(place, a, b, row, chunks, rounds, lookups)
    finally:
        # Each pair's pools go once its agents have stopped: the full run's ten pairs
        # (3.5 GiB each) would not fit in a /dev/shm of 24 GiB together.
        for config in (a, b):
            shutil.rmtree(scratch / config.name, ignore_errors=True)


def _measure_pair(
    place: Place, a: AgentConfig, b: AgentConfig, row: int, chunks: int, rounds: int, lookups: int
) -> tuple[list[float], list[float], list[float], PeerCounts]:
    """`measure`'s rounds, with the pair's agents running (they have stopped when it
    returns, so their pools can go)."""
    kv, raw, latencies = [], [], []
    with (
        AgentProcess(a, prefix=place.prefixes[0]),
        AgentProcess(b, prefix=place.prefixes[1]),
        AgentClient(a.endpoint) as producer,
        AgentClient(b.endpoint) as consumer,
    ):
        time.sleep(1.5)  # both reports written and read
        data = [np.full(row, i % 251, np.uint8) for i in range(chunks)]
        outs = [np.empty(row, np.uint8) for _ in range(chunks)]
        for r in range(rounds + 1):  # round 0 warms up: connections, NIXL's wire-up
            keys = [b"r%d-%08d" % (r, i) for i in range(chunks)]
            producer.store(NS, keys, data)
            while producer.stats().tiers[0].counts.writebacks < chunks * (r + 1):
                time.sleep(0.05)
            tcp = place.tcp_gbps(chunks * row, row)
            # Timed, as an engine does it: the lookup (the keys' homes asked), then the load
            # that brings the chunks into this node's pool (bytes moved, verified, indexed);
            # then, untimed, the chunks copied out and compared.
            started = time.perf_counter()
            consumer.lookup(NS, keys)
            grant = consumer.begin_load(NS, keys)
            elapsed = time.perf_counter() - started
            consumer.end_load(grant.lease)
            if r:
                kv.append(sum(s >= 0 for s in grant.slots) * row / elapsed / 1e9)
                raw.append(tcp)
            loaded = consumer.load_into(NS, keys, outs)
            intact = all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))
            if not all(loaded) or not intact:
                raise RuntimeError("a chunk did not come back intact from the peer")
        probe = [b"absent-%08d" % i for i in range(1024)]
        for _ in range(lookups):
            started = time.perf_counter()
            consumer.lookup(NS, probe)
            latencies.append((time.perf_counter() - started) * 1e6)
        counts = consumer.stats().tiers[0].peer
    assert counts is not None, "the consumer's first tier is its peer tier"
    return kv, raw, latencies, counts


# The data paths timed, by name: how chunk bytes cross, and which counter counts them.
PATHS = {
    "nixl": ("NIXL (UCX), bytes in the clear", "nixl_reads"),
    "zmq": ("ZMQ frames, no keys", "zmq_reads"),
    "zmq-curve": ("ZMQ frames, CURVE-encrypted", "zmq_reads"),
    "tcp-curve": ("stream: GMAC per chunk, key over CURVE", "stream_reads"),
    "tcp-curve-sealed": ("stream, encrypted: AES-GCM, key over CURVE", "stream_reads"),
}


def measure_place(
    scratch: Path, place: Place, row: int, chunks: int, rounds: int, lookups: int
) -> dict[str, Any]:
    names = [name for name in PATHS if name != "nixl" or available()]
    paths: dict[str, dict[str, Any]] = {}
    raw: list[float] = []
    for name in names:
        kv, tcp, lookup, counts = measure(scratch, place, name, row, chunks, rounds, lookups)
        moved = getattr(counts, PATHS[name][1])
        if moved != chunks * (rounds + 1):
            raise RuntimeError(f"{place.name}, {name}: {moved} of the chunks took it")
        raw += tcp
        lookup.sort()
        paths[name] = {
            "what": PATHS[name][0],
            "gbps": statistics.median(kv),
            # the median of per-round ratios, each round against the TCP stream just before
            "ratio_vs_tcp": statistics.median(k / t for k, t in zip(kv, tcp, strict=True)),
            "rounds_gbps": kv,
            "chunks_read": moved,
            "lookup_p50_us_remote_1k": lookup[len(lookup) // 2],
            "lookup_p99_us_remote_1k": lookup[min(len(lookup) - 1, int(len(lookup) * 0.99))],
        }
    return {"tcp_gbps": statistics.median(raw), "tcp_rounds_gbps": raw, "paths": paths}


@contextlib.contextmanager
def between_namespaces() -> Iterator[Place]:
    with netns.nodes(2, subnet="10.216.0") as machines:
        env = ["env", *(f"{k}={v}" for k, v in UCX_BETWEEN_HOSTS.items())]
        (ns_a, ip_a), (ns_b, ip_b) = machines
        yield Place(
            "namespaces", (ip_a, ip_b), (netns.run_in(ns_a, *env), netns.run_in(ns_b, *env))
        )


def run(quick: bool) -> dict[str, Any]:
    # 2 MiB rows: a chunk of 16 tokens of Llama-3.1-8B (docs/sizing.md), as `bench tiers`;
    # 128 of them (256 MiB, a prompt of 2k tokens) per round, 3 rounds with --quick: with
    # fewer chunks a load is timed mostly by what it costs whatever its size (the lookup and
    # the requests before the bytes move, about 6 ms here), not by how fast bytes move
    row, chunks, rounds = 2 * MiB, 128, (3 if quick else 9)
    lookups = 200  # a p99 of fewer is the worst one or two; 200 take under a second
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir="/dev/shm"))
    try:
        loopback = measure_place(scratch, Place("loopback"), row, chunks, rounds, lookups)
        namespaces: dict[str, Any]
        if (why := netns.supported()) is not None:
            namespaces = {"skipped": why}
        else:
            with between_namespaces() as place:
                namespaces = measure_place(scratch, place, row, chunks, rounds, lookups)
                namespaces["ucx"] = UCX_BETWEEN_HOSTS
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "benchmark": "peers",
        "quick": quick,
        "row_bytes": row,
        "chunks": chunks,
        "rounds": rounds,
        "loopback": loopback,
        "namespaces": namespaces,
    }


def _main(argv: list[str]) -> None:
    """The two ends of the raw TCP stream between namespaces, each run inside one."""
    what, address, port, nbytes, chunk = argv[0], argv[1], *map(int, argv[2:5])
    memory = _memory(nbytes)
    if what == "source":
        _stream_out(address, port, memory, chunk)
        return
    server = socket.create_server((address, port))
    conn, _ = server.accept()
    started = time.perf_counter()
    with conn:
        received = _stream_in(conn, memory, chunk)
    elapsed = time.perf_counter() - started
    server.close()
    print(received / elapsed / 1e9)


if __name__ == "__main__":
    _main(sys.argv[1:])
