"""`kvtier bench host`: the client<->agent path against raw memcpy between two mappings.

Store = allocate round trip + copy into staging slots + commit round trip, in rounds that
overlap the agent's copy into the pool (checksummed while hot) with the next round's staging.
Load = a copy straight out of the read-only pool for chunks the published index names (no
round trip). Lookups are answered by the client from the published index and compared with
one bare ZMQ ipc round trip measured in the same run; the index's bytes per entry and batched
lookups per second are measured on 2^20 entries. The baseline copies the same rows between
two populated mappings with the same number of threads, and is measured in alternation with
kvtier so both see the same machine state.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.progress import Progress

from kvtier.api.config import AgentConfig
from kvtier.api.pool_layout import PAGE
from kvtier.bench import sealed_segments
from kvtier.bench.baseline import (
    memcpy_rows,
    python_spinning,
    run_threads,
    shared_buffer,
    tmpfs_buffer,
)
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess, scratch_config
from kvtier.shm.pool import Bytes
from kvtier.shm.table import digests

if TYPE_CHECKING:
    from kvtier.agent.host.index import HostIndex

NS = "bench"
BATCH_BYTES = 64 << 20  # rows per call: an 8k-token prompt of 256-token chunks at 2 MiB
KiB, MiB = 1 << 10, 1 << 20
# Rows copied beside a thread running Python: a chunk of 32 to 128 tokens of a small model.
BESIDE_PYTHON_ROWS = (128 * KiB, 1 * MiB)


@contextmanager
def bench_agent(
    chunk_bytes: int, slots: int, directory: Path | None = None
) -> Iterator[AgentConfig]:
    """An agent whose pool and socket live in `directory` (a tmpfs; /dev/shm by default)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=directory or "/dev/shm"))
    try:
        config = scratch_config(scratch, "bench", PAGE + slots * (chunk_bytes + PAGE), chunk_bytes)
        with AgentProcess(config):
            yield config
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _store_worker(
    client: AgentClient, src: Bytes, row: int, rows: int, ids: Iterator[int]
) -> Callable[[], int]:
    views = [src[r * row : (r + 1) * row] for r in range(rows)]

    def work() -> int:
        keys = [b"k%012d" % next(ids) for _ in range(rows)]
        return client.store(NS, keys, views).stored * row

    return work


def _load_worker(
    client: AgentClient, dst: Bytes, row: int, rows: int, first: int
) -> Callable[[], int]:
    views = [dst[r * row : (r + 1) * row] for r in range(rows)]
    keys = [b"k%012d" % (first + r) for r in range(rows)]
    client.store(NS, keys, views)
    key_digests = digests(NS, keys).tolist()  # as the vLLM plug-in has them from its lookups

    def work() -> int:
        return sum(client.load_into(NS, keys, views, key_digests=key_digests)) * row

    return work


def copy_cases(
    row: int,
    threads: int,
    duration: float,
    rounds: int,
    directory: Path | None = None,
    beside_python: bool = False,
) -> list[dict[str, Any]]:
    """Store and load against memcpy; `beside_python` runs kvtier's copies beside a thread
    running Python (the engine thread of vLLM's scheduler process, where the plug-in copies)
    and the baseline alone, so the ratio says what that thread costs the copies."""
    rows = max(1, BATCH_BYTES // row)
    srcs = [shared_buffer(rows * row) for _ in range(threads)]
    # The store baseline walks as many rows as the pool has slots per thread.
    pool_like = [tmpfs_buffer(3 * rows * row) for _ in range(threads)]
    results = []
    with bench_agent(row, slots=threads * rows * 3, directory=directory) as config:
        clients = [AgentClient(config.endpoint, timeout=30).connect() for _ in range(threads)]
        ids = itertools.count()
        pairs = list(zip(clients, srcs, pool_like, strict=True))
        for op in ("store", "load"):
            # Load workers store their rows when built, after the store phase's evictions.
            kv_workers = [
                _store_worker(c, s, row, rows, ids)
                if op == "store"
                else _load_worker(c, s, row, rows, 10**9 + i * rows)
                for i, (c, s, _d) in enumerate(pairs)
            ]
            raw_workers = [
                memcpy_rows(s, d, row, rows)
                if op == "store"
                else memcpy_rows(d[: rows * row], s, row, rows)
                for _c, s, d in pairs
            ]
            hashed_workers = [memcpy_rows(s, d, row, rows, checksum=True) for _c, s, d in pairs]
            kv, raw, hashed = [], [], []
            for _ in range(rounds):
                raw.append(run_threads(raw_workers, duration).gbps)
                if op == "store":
                    hashed.append(run_threads(hashed_workers, duration).gbps)
                with python_spinning() if beside_python else nullcontext():
                    kv.append(run_threads(kv_workers, duration).gbps)
                wait_sealed(clients[0])
            kv_gbps, raw_gbps = statistics.median(kv), statistics.median(raw)
            case: dict[str, Any] = {
                "op": op,
                "row_bytes": row,
                "threads": threads,
                "rows_per_call": rows,
                "kvtier_gbps": kv_gbps,
                "memcpy_gbps": raw_gbps,
                "ratio": kv_gbps / raw_gbps,
                "beside_python_thread": beside_python,
            }
            if hashed:
                case["memcpy_checksum_gbps"] = statistics.median(hashed)
                case["ratio_vs_memcpy_checksum"] = kv_gbps / case["memcpy_checksum_gbps"]
            results.append(case)
        for c in clients:
            c.close()
    return results


def wait_sealed(client: AgentClient, timeout: float = 60.0) -> None:
    """Let the agent's sealer finish, so it does not compete with what is measured next."""
    deadline = time.monotonic() + timeout
    while client.stats().host.pinned_slots and time.monotonic() < deadline:
        time.sleep(0.01)


def _percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6,
    }


PACE_SECONDS = 0.002  # between lookups (and round trips), as a scheduler's steps are apart


def lookup_latency(batches: list[int], reps: dict[int, int]) -> dict[str, dict[str, float]]:
    """Latency of batched lookups as vLLM's scheduler makes them: answered in the client's
    process from the published index, half the keys held by the pool and half not (their
    order shuffled), one every PACE_SECONDS; their reports reach the agent from the client's
    reporting thread meanwhile."""
    biggest = max(batches)
    out: dict[str, dict[str, float]] = {}
    with bench_agent(PAGE, slots=biggest + 16) as config, AgentClient(config.endpoint) as client:
        held = [b"%032d" % i for i in range(biggest)]
        row = np.zeros(PAGE, np.uint8)
        for start in range(0, biggest, 1024):
            batch = held[start : start + 1024]
            client.store(NS, batch, [row] * len(batch))
        wait_sealed(client)
        rng = np.random.default_rng(0)
        for n in batches:
            samples = []
            for rep in range(reps[n]):
                offset = (rep * 7919) % (biggest - n + 1)
                keys = held[offset : offset + n // 2] + [
                    b"m%031d" % (rep * n + i) for i in range(n - n // 2)
                ]
                keys = [keys[i] for i in rng.permutation(n)]
                time.sleep(PACE_SECONDS)
                t = time.perf_counter()
                result = client.lookup(NS, keys)
                samples.append(time.perf_counter() - t)
                assert sum(result.hits) == n // 2
            out[f"{n // 1024}k"] = {"keys": n, **_percentiles(samples)}
    return out


def _echo(endpoint: str, ready: Any) -> None:
    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            return
        sock.send_multipart(frames)


def ipc_round_trip(reps: int) -> dict[str, float]:
    """One bare ZMQ round trip over an ipc socket (DEALER to a ROUTER echoing in another
    process), the messages as small as a lookup's reply header: the floor any lookup that
    asks the agent pays."""
    import multiprocessing as mp

    import zmq

    directory = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm"))
    endpoint = f"ipc://{directory}/echo.sock"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_echo, args=(endpoint, ready))
    proc.start()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        ready.wait(30)
        sock.connect(endpoint)
        body = b"x" * 64
        samples = []
        for _ in range(reps + 20):
            time.sleep(PACE_SECONDS)
            t = time.perf_counter()
            sock.send_multipart([b"rid00000", body])
            sock.recv_multipart()
            samples.append(time.perf_counter() - t)
        sock.send_multipart([b"rid00000", b"stop"])
        return _percentiles(samples[20:])
    finally:
        sock.close(linger=0)
        proc.join(10)
        shutil.rmtree(directory, ignore_errors=True)


def index_footprint_and_rate(entries: int, batch: int = 1024) -> dict[str, float]:
    """The published table and the agent's own index holding `entries` chunks: bytes per
    entry of each, and batched lookups per second (one thread) on the table, digests
    included, half the keys held. The agent's index is measured under each policy on a
    tenth as many chunks (its bytes per chunk do not depend on how many there are), its
    batched lookups (by key, and by digest as clients report them) under the default, and
    its event log on its own."""
    from kvtier.api.pool_layout import index_file_bytes
    from kvtier.shm.table import TableReader, TableWriter, digests

    directory = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm"))
    path = directory / "bench.pool.index"
    keys = [_index_key(i) for i in range(entries)]
    try:
        writer = TableWriter(path, entries, boot=1)
        for slot, d in enumerate(digests(NS, keys).tolist()):
            writer.put(d, slot, slot + 1)
        reader = TableReader(path)
        misses = [b"miss" + k[4:] for k in keys[: entries // 2]]
        rounds = max(1, min(entries // batch, 400))
        queries = [
            keys[(r * batch) % entries : (r * batch) % entries + batch // 2]
            + misses[(r * batch) % len(misses) : (r * batch) % len(misses) + batch // 2]
            for r in range(rounds)
        ]
        started = time.perf_counter()
        for q in queries:
            reader.find(digests(NS, q))
        rate = sum(len(q) for q in queries) / (time.perf_counter() - started)
        table_per_entry = index_file_bytes(writer.capacity) / entries
        reader.close()
        writer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    del keys, misses, queries
    sample = max(1, entries // 10)
    agent = {policy: agent_index_bytes(policy, sample) for policy in ("lru", "arc", "prefix")}
    return {
        "index_bytes_per_entry": table_per_entry,
        "agent_index_bytes_per_entry": agent["lru"],  # the default policy
        "agent_index_bytes_per_entry_arc": agent["arc"],
        "agent_index_bytes_per_entry_prefix": agent["prefix"],
        "agent_event_log_bytes_per_event": event_log_bytes(min(sample, 65536)),
        **agent_index_rates(sample, batch),
        "index_lookups_per_s": rate,
        "index_entries": entries,
    }


def _index_key(i: int) -> bytes:
    return i.to_bytes(32, "little") + b"\0\0\0\1"


def agent_index_bytes(policy: str, chunks: int) -> float:
    """Bytes per chunk of the agent's own index holding `chunks` chunks under `policy`.

    Traced from before the index is built, with the keys made inside the traced region, so
    whatever the index keeps of them counts. Its log of stores and evictions is swapped for
    a one-event log: that log is a ring of at most 65,536 events per namespace however many
    chunks the pool holds, and `event_log_bytes` measures it.
    """
    import tracemalloc

    from kvtier.agent.host.events import ChunkEvents
    from kvtier.agent.host.index import HostIndex
    from kvtier.agent.host.policy import make_policy

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = HostIndex(chunks, make_policy(policy, chunks))
    index.events = ChunkEvents(per_namespace=1)
    _fill(index, chunks)
    per_chunk = (tracemalloc.get_traced_memory()[0] - before) / chunks
    tracemalloc.stop()
    return per_chunk


def agent_index_rates(chunks: int, batch: int) -> dict[str, float]:
    """Keys per second the agent's own index (LRU) answers holding `chunks` chunks, in
    batches of `batch` keys, half of them held: looked up by key (requests over the socket)
    and by digest (lookups clients answered from the published table and report)."""
    from kvtier.agent.host.index import HostIndex
    from kvtier.agent.host.policy import make_policy
    from kvtier.shm.table import TableWriter, digests

    directory = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm"))
    try:
        table = TableWriter(directory / "bench.pool.index", chunks, boot=1)
        index = HostIndex(chunks, make_policy("lru", chunks), table=table)
        _fill(index, chunks)
        rounds = max(1, min(chunks // batch, 200))
        queries = [
            [_index_key((r * batch + i) % chunks) for i in range(batch // 2)]
            + [_index_key(chunks + r * batch + i) for i in range(batch - batch // 2)]
            for r in range(rounds)
        ]
        reported = [digests(NS, q) for q in queries]
        by_key = _keys_per_s(lambda q: index.lookup(NS, q), queries)
        by_digest = _keys_per_s(lambda d: index.lookup_digests(NS, d), reported)
        table.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"agent_index_lookups_per_s": by_key, "agent_index_digest_lookups_per_s": by_digest}


def _keys_per_s(ask: Callable[[Any], object], batches: list[Any]) -> float:
    started = time.perf_counter()
    for batch in batches:
        ask(batch)
    return sum(map(len, batches)) / (time.perf_counter() - started)


def _fill(index: HostIndex, chunks: int) -> None:
    """Store and commit `chunks` new chunks, 1,024 a lease, each naming the chunk before
    it as its parent (as the plug-in's stores do: `prefix` keeps its tree), keeping no key
    here."""
    for start in range(0, chunks, 1024):
        keys = [_index_key(i) for i in range(start, min(start + 1024, chunks))]
        parents: list[bytes | None] = [None, *keys[:-1]]
        lease, _, _, _ = index.allocate("bench", NS, keys, PAGE, float("inf"), parents)
        index.commit(lease, "bench")


def event_log_bytes(events: int) -> float:
    """Bytes per event of the index's log of stores and evictions (kept for KV-event
    consumers), keys included, for up to its 65,536 events per namespace."""
    import tracemalloc

    from kvtier.agent.host.events import ChunkEvents

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    log = ChunkEvents()
    for i in range(events):
        log.record(NS, _index_key(i), removed=False)
    per_event = (tracemalloc.get_traced_memory()[0] - before) / events
    tracemalloc.stop()
    del log
    return per_event


def run(quick: bool) -> dict[str, Any]:
    sizes = (
        [256 * KiB, 1 * MiB, 32 * MiB]
        if quick
        else [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB]
    )
    thread_counts = [1, 2]
    duration, rounds = (0.25, 2) if quick else (0.6, 3)
    cases: list[dict[str, Any]] = []
    with Progress(transient=True) as progress:
        task = progress.add_task(
            "host tier vs memcpy",
            total=len(sizes) * len(thread_counts) + len(BESIDE_PYTHON_ROWS) + 4,
        )
        for row in sizes:
            for threads in thread_counts:
                cases.extend(copy_cases(row, threads, duration, rounds))
                progress.advance(task)
        for row in BESIDE_PYTHON_ROWS:
            cases.extend(copy_cases(row, 1, duration, rounds, beside_python=True))
            progress.advance(task)
        lookup = lookup_latency(
            [1024, 32768], {1024: 200 if quick else 1000, 32768: 10 if quick else 40}
        )
        progress.advance(task)
        rtt = ipc_round_trip(200 if quick else 1000)
        progress.advance(task)
        index = index_footprint_and_rate(1 << 20)
        progress.advance(task)
        segments = sealed_segments.run(quick)
        progress.advance(task)

    def worst(op: str, field: str = "ratio", beside_python: bool = False) -> float:
        return min(
            float(c[field])
            for c in cases
            if c["op"] == op
            and c["threads"] == 1
            and c["beside_python_thread"] == beside_python
            and (beside_python or c["row_bytes"] >= MiB)
        )

    return {
        "benchmark": "host",
        "quick": quick,
        "cases": cases,
        "lookup": lookup,
        "store_ratio_vs_memcpy": worst("store"),
        "store_ratio_vs_memcpy_checksum": worst("store", "ratio_vs_memcpy_checksum"),
        "load_ratio_vs_memcpy": worst("load"),
        "store_ratio_beside_python": worst("store", beside_python=True),
        "load_ratio_beside_python": worst("load", beside_python=True),
        "lookup_p50_us_1k": lookup["1k"]["p50_us"],
        "lookup_p99_us_1k": lookup["1k"]["p99_us"],
        "lookup_p99_us_32k": lookup["32k"]["p99_us"],
        "ipc_rtt_p50_us": rtt["p50_us"],
        "ipc_rtt_p99_us": rtt["p99_us"],
        "lookup_p99_ratio_vs_ipc_rtt": lookup["1k"]["p99_us"] / rtt["p99_us"],
        **index,
        "sealed_segments": segments,
        **{
            f"sealed_store_ratio_{pages.replace(' ', '').lower()}_pages": min(
                c["ratio"] for c in segments["cases"] if c["pages"] == pages
            )
            for pages in sorted({c["pages"] for c in segments["cases"]})
        },
    }
