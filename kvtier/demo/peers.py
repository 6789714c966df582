"""The demo's second node: chats served on node A, then routed to node B (load balancing, or
the decode side of P/D), whose agent fetches A's chunks through the peer tier instead of
having them recomputed. Both agents find each other through a shared registry directory,
as they do through their KVCacheNodes in a cluster."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.api.units import format_bytes
from kvtier.client.connection import AgentClient
from kvtier.demo.shape import NAMESPACE, ROW_BYTES
from kvtier.local.agent import AgentProcess, scratch_peer_config
from kvtier.local.wait import wait_for
from kvtier.shm.pool import Bytes
from kvtier.traces.workload import WorkloadShape, chunk_keys, conversation_turns, row_for

WHAT = "the second node's agents settled"


@dataclass
class PeerReport:
    """The second node's replay of the first node's conversations."""

    turns: int = 0
    chunks_looked_up: int = 0
    chunks_from_peer: int = 0  # hit on the first node, through the peer tier
    chunks_local: int = 0  # hit in this node's own pool (brought over earlier)
    chunks_loaded: int = 0
    corrupt_loads: int = 0  # loaded rows that differ from what was stored: must stay 0
    bytes_from_peer: int = 0
    nixl_reads: int = 0  # the peer tier's reads by data path
    stream_reads: int = 0
    zmq_reads: int = 0
    seconds: float = 0.0


def run_second_node(conversations: int = 3, turns: int = 4) -> PeerReport:
    shape = WorkloadShape()
    chats = list(conversation_turns(shape, 7, conversations, turns))
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-demo-peers-", dir="/dev/shm"))
    report = PeerReport()
    try:
        a, b = (
            scratch_peer_config(scratch, name, "32Mi", ROW_BYTES, scratch / "registry")
            for name in ("node-a", "node-b")
        )
        with AgentProcess(a), AgentProcess(b):
            wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2, 30.0, WHAT)
            time.sleep(1.0)  # both agents have read the membership
            stored = 0
            with AgentClient(a.endpoint) as engine_a:
                for turn in chats:
                    keys = chunk_keys(turn.prompt, shape.chunk_tokens)
                    rows = [row_for(k, ROW_BYTES) for k in keys]
                    stored += engine_a.store(NAMESPACE, keys, rows).stored
                wait_for(lambda: engine_a.stats().tiers[0].counts.writebacks >= stored, 30.0, WHAT)
            started = time.perf_counter()
            with AgentClient(b.endpoint) as engine_b:
                buffers: list[Bytes] = []
                for turn in chats:
                    keys = chunk_keys(turn.prompt, shape.chunk_tokens)
                    found = engine_b.lookup(NAMESPACE, keys)
                    prefix = found.prefix
                    while len(buffers) < prefix:
                        buffers.append(np.empty(ROW_BYTES, np.uint8))
                    loaded = engine_b.load_into(NAMESPACE, keys[:prefix], buffers[:prefix])
                    for key, ok, buf in zip(keys, loaded, buffers, strict=False):
                        if ok and not np.array_equal(buf, row_for(key, ROW_BYTES)):
                            report.corrupt_loads += 1
                    report.turns += 1
                    report.chunks_looked_up += len(keys)
                    report.chunks_local += found.where[:prefix].count(0)
                    report.chunks_from_peer += found.where[:prefix].count(1)
                    report.chunks_loaded += sum(loaded)
                peer = engine_b.stats().tiers[0].peer
            report.seconds = time.perf_counter() - started
            assert peer is not None, "the second node's first tier is its peer tier"
            report.nixl_reads, report.zmq_reads = peer.nixl_reads, peer.zmq_reads
            report.stream_reads = peer.stream_reads
            moved = report.nixl_reads + report.stream_reads + report.zmq_reads
            report.bytes_from_peer = moved * ROW_BYTES
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report


def render(report: PeerReport, console: Console) -> None:
    table = Table(title="kvtier demo: a second node served by the first one's agent")
    for col in ("turns", "looked up", "from node A", "already on B", "loaded", "moved"):
        table.add_column(col, justify="right")
    table.add_row(
        str(report.turns),
        str(report.chunks_looked_up),
        str(report.chunks_from_peer),
        str(report.chunks_local),
        str(report.chunks_loaded),
        format_bytes(report.bytes_from_peer),
    )
    console.print(table)
    console.print(
        f"node B loaded {report.chunks_loaded} chunks it never computed, every one verified "
        f"({report.corrupt_loads} corrupt), in {report.seconds:.2f} s; chunks moved over "
        f"NIXL: {report.nixl_reads}, over the stream: {report.stream_reads}, as ZMQ "
        f"frames: {report.zmq_reads}"
    )
