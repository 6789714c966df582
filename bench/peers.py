"""`kvtier bench peers`: chunks fetched from another node's agent over each of the peer
tier's data paths (NIXL, ZMQ), next to a raw loopback TCP stream of the same bytes, same run;
and the round trip of a batched lookup that must ask the keys' home agents."""

from __future__ import annotations

import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.agent.client import AgentClient
from kvtier.agent.config import AgentConfig, scratch_peer_config
from kvtier.agent.pool import PAGE
from kvtier.agent.process import AgentProcess
from kvtier.agent.tiers.nixl_path import available

MiB = 1 << 20
NS = "bench-peers"


def raw_tcp_gbps(nbytes: int, chunk: int) -> float:
    """One loopback TCP stream moving `nbytes`, received into a preallocated buffer."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(np.ones(chunk, np.uint8).data)
    done = threading.Event()

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            sent = 0
            while sent < nbytes:
                conn.sendall(payload)
                sent += chunk
        done.set()

    sink = memoryview(bytearray(chunk))
    thread = threading.Thread(target=send)
    started = time.perf_counter()
    thread.start()
    conn, _ = server.accept()
    received = 0
    with conn:
        while received < nbytes:
            n = conn.recv_into(sink[received % chunk :] if received % chunk else sink)
            if n == 0:
                break
            received += n
    elapsed = time.perf_counter() - started
    thread.join()
    server.close()
    return received / elapsed / 1e9


def node(scratch: Path, name: str, row: int, slots: int, data_path: str) -> AgentConfig:
    return scratch_peer_config(
        scratch,
        name,
        PAGE + slots * (row + PAGE),
        row,
        scratch / f"registry-{data_path}",
        {"timeoutSeconds": 5, "dataPath": data_path},
        tierBudgetSeconds=30,
    )


def measure(
    scratch: Path, data_path: str, row: int, chunks: int, rounds: int, lookups: int
) -> tuple[list[float], list[float], list[float], dict[str, Any]]:
    """Per round: GB/s bringing `chunks` rows held by another agent into this one's pool, and
    raw TCP GB/s moving the same bytes just before (this machine's speed drifts, so each
    round is compared with its own baseline); then remote lookup latencies (µs) and the
    peer tier's stats."""
    a = node(scratch, f"{data_path}-a", row, chunks * (rounds + 1) + 8, data_path)
    # One request promotes at most a quarter of the pool (a slow tier cannot drain it).
    b = node(scratch, f"{data_path}-b", row, 4 * chunks + 8, data_path)
    kv, raw, latencies = [], [], []
    with (
        AgentProcess(a),
        AgentProcess(b),
        AgentClient(a.endpoint) as producer,
        AgentClient(b.endpoint) as consumer,
    ):
        time.sleep(1.5)  # both reports written and read
        data = [np.full(row, i % 251, np.uint8) for i in range(chunks)]
        outs = [np.empty(row, np.uint8) for _ in range(chunks)]
        for r in range(rounds + 1):  # round 0 warms up: connections, NIXL's wire-up
            keys = [b"r%d-%08d" % (r, i) for i in range(chunks)]
            producer.store(NS, keys, data)
            while producer.stats()["tiers"][0].get("writebacks", 0) < chunks * (r + 1):
                time.sleep(0.05)
            tcp = raw_tcp_gbps(chunks * row, row)
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
        stats = consumer.stats()["tiers"][0]
    return kv, raw, latencies, stats


def run(quick: bool) -> dict[str, Any]:
    # 2 MiB rows: a chunk of 16 tokens of Llama-3.1-8B (docs/sizing.md), as `bench tiers`
    row, chunks, rounds = 2 * MiB, (32 if quick else 128), (5 if quick else 9)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir="/dev/shm"))
    paths = ["nixl", "zmq"] if available() else ["zmq"]
    per_round: dict[str, list[float]] = {}
    ratios: dict[str, float] = {}
    raw: list[float] = []
    reads: dict[str, int] = {}
    lookups: list[float] = []
    try:
        for path in paths:
            kv, tcp, latencies, stats = measure(
                scratch, path, row, chunks, rounds, 40 if quick else 200
            )
            per_round[path] = kv
            ratios[path] = statistics.median(k / t for k, t in zip(kv, tcp, strict=True))
            raw += tcp
            reads[path] = int(stats.get(f"{path}_reads", 0))
            if reads[path] != chunks * (rounds + 1):
                raise RuntimeError(f"{path}: {reads[path]} of the chunks took it")
            lookups += latencies
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lookups.sort()
    tcp_gbps = statistics.median(raw)
    gbps = {path: statistics.median(kv) for path, kv in per_round.items()}
    nixl = gbps.get("nixl")
    return {
        "benchmark": "peers",
        "quick": quick,
        "row_bytes": row,
        "chunks": chunks,
        "rounds": rounds,
        "tcp_gbps": tcp_gbps,
        "zmq_gbps": gbps["zmq"],
        "nixl_gbps": nixl,
        # medians of per-round ratios, each round against the TCP stream just before it
        "zmq_ratio_vs_tcp": ratios["zmq"],
        "nixl_ratio_vs_tcp": ratios.get("nixl"),
        "chunks_read": reads,
        "rounds_gbps": {**per_round, "tcp": raw},
        "lookup_p50_us_remote_1k": lookups[len(lookups) // 2],
        "lookup_p99_us_remote_1k": lookups[min(len(lookups) - 1, int(len(lookups) * 0.99))],
    }
