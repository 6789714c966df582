"""`kvtier demo`: one agent, several client processes replaying multi-turn chats; then a
second node served by the first one's agent (`peers.py`), and two vLLM engines sharing an
agent (`vllm.py`) when a vLLM environment is given.

Each client acts like an engine serving its share of conversations: per turn it looks up the
prompt's chunks, loads the hit prefix through the node's pool (checking every byte),
"prefills" the rest and stores the new chunks. The agent's host pool is deliberately small
and backed by a filesystem tier, so once the pool is full, evicted chunks come back from the
filesystem. The report shows what each tier saved.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.api.config import AgentConfig
from kvtier.api.stats import AgentStats
from kvtier.api.units import format_bytes
from kvtier.client.connection import AgentClient
from kvtier.demo import peers
from kvtier.demo import vllm as vllm_engines
from kvtier.demo.shape import NAMESPACE, ROW_BYTES
from kvtier.local.agent import AgentProcess, scratch_config
from kvtier.traces.workload import WorkloadShape, chunk_keys, conversation_turns, row_for


@dataclass(frozen=True)
class DemoOptions:
    clients: int = 4
    conversations: int = 3
    turns: int = 6
    policy: str = "lru"
    capacity: str = "12Mi"
    fs_dir: Path | None = Path(".scratch/demo-fs")
    vllm_python: Path | None = None
    plot: Path | None = None
    as_json: bool = False


@dataclass
class ClientReport:
    """One engine's replay of its conversations."""

    client: int
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from kvtier: prefill avoided
    chunks_looked_up: int = 0
    chunks_hit: int = 0  # the lookups' hit prefixes
    hits_host: int = 0  # ... found in the pool
    hits_fs: int = 0  # ... found on the filesystem tier
    chunks_loaded: int = 0
    chunks_stored: int = 0  # new chunks, after the hit prefix
    bytes_loaded: int = 0
    bytes_stored: int = 0
    corrupt_loads: int = 0  # loaded rows that differ from what was stored: must stay 0
    seconds: float = 0.0


@dataclass
class DemoReport:
    clients: list[ClientReport] = field(default_factory=list)
    agent: AgentStats | None = None
    # One point per completed turn: cumulative hits by tier and occupancy, for --plot.
    timeline: list[dict[str, float]] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(getattr(c, name) for c in self.clients)

    def summary(self) -> dict[str, Any]:
        looked = self.total("chunks_looked_up")
        return {
            "clients": len(self.clients),
            "turns": self.total("turns"),
            "hit_rate": self.total("chunks_hit") / looked if looked else 0.0,
            "hits_from_host": self.total("hits_host"),
            "hits_from_filesystem": self.total("hits_fs"),
            "prompt_tokens": self.total("prompt_tokens"),
            "prefill_tokens_avoided": self.total("cached_tokens"),
            "bytes_stored": self.total("bytes_stored"),
            "bytes_loaded": self.total("bytes_loaded"),
            "evictions": self.agent.host.evictions if self.agent is not None else 0,
            "corrupt_loads": self.total("corrupt_loads"),
        }


def replay(index: int, endpoint: str, options: DemoOptions, events: mp.Queue[Any]) -> None:
    """One engine's work; runs in its own process."""
    shape = WorkloadShape()
    report = ClientReport(client=index)
    started = time.perf_counter()
    with AgentClient(endpoint) as client:
        buffers = [np.empty(ROW_BYTES, np.uint8) for _ in range(64)]
        for turn in conversation_turns(shape, 1000 + index, options.conversations, options.turns):
            keys = chunk_keys(turn.prompt, shape.chunk_tokens)
            found = client.lookup(NAMESPACE, keys)
            prefix = found.prefix
            report.hits_host += found.where[:prefix].count(0)
            report.hits_fs += prefix - found.where[:prefix].count(0)
            while len(buffers) < prefix:
                buffers.append(np.empty(ROW_BYTES, np.uint8))
            loaded = client.load_into(NAMESPACE, keys[:prefix], buffers[:prefix])
            usable = loaded.index(False) if False in loaded else prefix
            for key, buf in zip(keys[:usable], buffers, strict=False):
                if not np.array_equal(buf, row_for(key, ROW_BYTES)):
                    report.corrupt_loads += 1
            new = keys[usable:]
            result = client.store(NAMESPACE, new, [row_for(k, ROW_BYTES) for k in new])
            report.turns += 1
            report.prompt_tokens += len(turn.prompt)
            report.cached_tokens += usable * shape.chunk_tokens
            report.chunks_looked_up += len(keys)
            report.chunks_hit += prefix
            report.chunks_loaded += usable
            report.chunks_stored += result.stored
            report.bytes_loaded += usable * ROW_BYTES
            report.bytes_stored += result.stored * ROW_BYTES
            events.put(
                (
                    "turn",
                    (
                        found.where[:prefix].count(0),
                        prefix - found.where[:prefix].count(0),
                        len(keys),
                    ),
                )
            )
    report.seconds = time.perf_counter() - started
    events.put(("done", asdict(report)))


def sample(
    timeline: list[dict[str, float]], turn: tuple[int, int, int], client: AgentClient
) -> dict[str, float]:
    """Add one finished turn to the running totals and read the agent's occupancy."""
    host, fs, looked = turn
    last = timeline[-1] if timeline else {"host": 0.0, "fs": 0.0, "looked": 0.0}
    stats = client.stats()
    return {
        "turn": float(len(timeline) + 1),
        "host": last["host"] + host,
        "fs": last["fs"] + fs,
        "looked": last["looked"] + looked,
        "host_used": stats.host.used_bytes / max(1, stats.host.capacity_bytes),
        "fs_used_bytes": float(sum(t.used_bytes for t in stats.tiers)),
    }


def demo_config(scratch: Path, options: DemoOptions) -> AgentConfig:
    tiers = []
    if options.fs_dir is not None:
        tiers.append(
            {"name": "demo-fs", "filesystem": {"path": str(options.fs_dir), "capacity": "1Gi"}}
        )
    return scratch_config(
        scratch,
        "demo",
        options.capacity,
        ROW_BYTES,
        options.policy,
        tiers=tiers,
        metrics={"port": 0, "host": "127.0.0.1"},
    )


DEMO_MARK = ".kvtier-demo"  # an empty directory: the tier, which walks files, sees nothing


def foreign_files(fs_dir: Path) -> str | None:
    """Why the demo must not empty `fs_dir`, or None: it may be absent, empty, or one a demo
    made (it holds `DEMO_MARK`), such as an earlier run killed before it cleaned up."""
    if not fs_dir.exists():
        return None
    if not fs_dir.is_dir():
        return f"{fs_dir} is not a directory"
    if (fs_dir / DEMO_MARK).is_dir():
        return None
    for entry in fs_dir.iterdir():
        return f"{fs_dir} holds {entry.name}, and no demo made it"
    return None


def run_workload(options: DemoOptions, console: Console) -> DemoReport:
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir="/dev/shm"))
    report = DemoReport()
    ctx = mp.get_context("spawn")
    events: mp.Queue[Any] = ctx.Queue()
    try:
        if options.fs_dir is not None:
            shutil.rmtree(options.fs_dir, ignore_errors=True)  # every run starts cold
            (options.fs_dir / DEMO_MARK).mkdir(parents=True)
        config = demo_config(scratch, options)
        with AgentProcess(config):
            procs = [
                ctx.Process(target=replay, args=(i, config.endpoint, options, events))
                for i in range(options.clients)
            ]
            for proc in procs:
                proc.start()
            total = options.clients * options.conversations * options.turns
            with Progress(console=console, transient=True, disable=options.as_json) as progress:
                task = progress.add_task("replaying chats", total=total)
                with AgentClient(config.endpoint) as watcher:
                    while len(report.clients) < options.clients:
                        kind, payload = events.get(timeout=120)
                        if kind == "turn":
                            progress.advance(task)
                            report.timeline.append(sample(report.timeline, payload, watcher))
                        else:
                            report.clients.append(ClientReport(**payload))
            for proc in procs:
                proc.join(timeout=30)
            with AgentClient(config.endpoint) as client:
                report.agent = client.stats()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if options.fs_dir is not None:
            shutil.rmtree(options.fs_dir, ignore_errors=True)
    report.clients.sort(key=lambda c: c.client)
    return report


_COLUMNS = ("client", "turns", "hit rate", "hits host/fs", "prefill avoided", "stored", "loaded")


def _row(
    name: str,
    turns: int,
    hits: tuple[int, int, int, int],
    tokens: tuple[int, int],
    moved: tuple[int, int],
) -> tuple[str, ...]:
    """One table row: hits (chunks hit, looked up, from host, from fs), tokens (cached,
    prompt) and bytes moved (stored, loaded)."""
    hit, looked, host, fs = hits
    cached, prompt = tokens
    return (
        name,
        str(turns),
        f"{hit / looked if looked else 0:.1%}",
        f"{host}/{fs}",
        f"{cached / prompt if prompt else 0:.1%}",
        format_bytes(moved[0]),
        format_bytes(moved[1]),
    )


def _agent_lines(agent: AgentStats) -> list[str]:
    """What the agent holds, its host tier then each secondary tier."""
    host = agent.host
    lines = [
        f"host tier: {host.chunks} chunks in {host.slots} slots "
        f"({format_bytes(host.used_bytes)} of {format_bytes(host.capacity_bytes)}), "
        f"policy {host.policy.policy}, {host.evictions} evictions"
    ]
    lines += [
        f"{t.kind} tier {t.name}: {t.chunks} chunks "
        f"({format_bytes(t.used_bytes)} of {format_bytes(t.capacity_bytes)}), "
        f"{t.counts.writebacks} written back, {t.counts.promotions} promoted, "
        f"{t.counts.dropped} write-backs dropped"
        for t in agent.tiers
    ]
    return lines


def render(report: DemoReport, console: Console) -> None:
    table = Table(title="kvtier demo: clients sharing one node agent")
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    for c in report.clients:
        table.add_row(
            *_row(
                str(c.client),
                c.turns,
                (c.chunks_hit, c.chunks_looked_up, c.hits_host, c.hits_fs),
                (c.cached_tokens, c.prompt_tokens),
                (c.bytes_stored, c.bytes_loaded),
            )
        )
    s = report.summary()
    table.add_section()
    table.add_row(
        *_row(
            "all",
            s["turns"],
            (
                report.total("chunks_hit"),
                report.total("chunks_looked_up"),
                s["hits_from_host"],
                s["hits_from_filesystem"],
            ),
            (s["prefill_tokens_avoided"], s["prompt_tokens"]),
            (s["bytes_stored"], s["bytes_loaded"]),
        )
    )
    console.print(table)
    console.print(
        f"prefill tokens avoided: {s['prefill_tokens_avoided']:,} of {s['prompt_tokens']:,}; "
        f"{s['corrupt_loads']} corrupt loads"
    )
    if report.agent is not None:
        for line in _agent_lines(report.agent):
            console.print(line)


def run_demo(options: DemoOptions) -> int:
    console = Console(stderr=options.as_json)
    report = run_workload(options, console)
    second = peers.run_second_node()
    if options.plot is not None:
        from kvtier.traces.plot import plot_demo

        plot_demo(report.timeline, options.plot)
        console.print(f"plot written to {options.plot}")
    engines = None
    if options.vllm_python is not None:
        engines = vllm_engines.run_engines(options.vllm_python, console)
    if options.as_json:
        document = {
            "summary": report.summary(),
            "clients": [asdict(c) for c in report.clients],
            "agent": msgspec.to_builtins(report.agent),
            "second_node": asdict(second),
        }
        if engines is not None:
            document["vllm"] = engines
        print(json.dumps(document, indent=2))
    else:
        render(report, console)
        peers.render(second, console)
        if engines is not None:
            vllm_engines.render(engines, console)
    hits_b = engines["engines"][1]["external_hit_tokens"] if engines else 1
    corrupt = report.summary()["corrupt_loads"] + second.corrupt_loads
    return 1 if corrupt or not hits_b or not second.chunks_from_peer else 0
