"""`kvtier replay`: a request trace through the host tier's real index and eviction policies.

A Mooncake-format trace (JSONL, optionally gzip: `timestamp`, `input_length`, `hash_ids`, an
optional `block_size`) names each request's prompt as prefix blocks. Equal `hash_ids` at equal
positions after an equal prefix are the same block; like vLLM's chained block hashes, a block's
key here is its whole prefix, so a block id that recurs after a different prefix is another
chunk.

Every request goes through `HostIndex` as the agent drives it for the vLLM plug-in: one
lookup of all its keys, a load lease on the hit prefix (the chunks being read are pinned), the
hits reported to the policy, then a store of the blocks after the prefix (a store lease,
committed; the store names each block's predecessor). Capacity is the pool's slot count. The
policies are the agent's own, plus `optimal`: Belady's rule on the next request that uses a
chunk, with bypass (a block whose next use is no sooner than every resident chunk's is not
admitted), as an upper bound.

Accounting follows kvcache-simulator so the figures compare: hits count only up to a
request's first missing block (what vLLM can use), weighted by the block's prompt tokens
(512, the last block what remains of `input_length`), over the last half of the requests; a
capacity the trace does not fill before that window is reported as underfilled. The block hit
rate beside it counts every resident block of a request, wherever the prefix broke.
"""

from __future__ import annotations

import contextlib
import gzip
import heapq
import json
import secrets
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from kvtier.agent.host.index import HostIndex
from kvtier.agent.host.policy import POLICIES, ChunkId, EvictionPolicy, make_policy
from kvtier.api.units import format_bytes, parse_bytes
from kvtier.traces.plot import check_target

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from kvtier.client.connection import AgentClient

NAMESPACE = "replay"
CLIENT = "replay"
OPTIMAL = "optimal"
DEFAULT_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake release
_FOREVER = 1e18  # lease deadline: a replay never expires leases


class TraceError(ValueError):
    """A trace that cannot be replayed (no usable records, inconsistent block size)."""


@dataclass
class Trace:
    """Requests as chained-prefix nodes: node 0 is the empty prefix; node n's parent is
    `parent[n]`. Per block event: its node, prompt tokens, and the next request using it."""

    block_size: int
    starts: list[int]  # request r's events are starts[r]:starts[r + 1]
    nodes: list[int]
    tokens: list[int]
    next_use: list[int]  # index of the next request with this event's node; `requests` if none
    parent: list[int]
    depth: list[int]
    keys: list[bytes]  # per node: the chunk key the index sees
    timestamps: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.starts) - 1

    @property
    def unique_blocks(self) -> int:
        return len(self.parent) - 1

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


def _open(path: Path) -> IO[str]:
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    # utf-8-sig: a byte order mark some editors write is read past, not refused
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return path.open(encoding="utf-8-sig")


def _block_tokens(input_length: int, block_size: int, index: int) -> int:
    """Prompt tokens of a request's block `index`: full blocks, then what remains (at least
    one token, as kvcache-simulator counts a block past `input_length`)."""
    return max(1, min(block_size, input_length - index * block_size))


def read_records(path: Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The trace's records with `hash_ids` and a positive `input_length`, in order (others,
    such as a trace's header lines, are passed over), each field checked: a value of the
    wrong kind is a TraceError naming the file, the line and the field, not a traceback."""
    count = 0
    try:
        with _open(path) as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{number}: not a JSON record ({exc.msg})") from None
                if isinstance(record, dict) and _checked(record, f"{path}:{number}"):
                    yield record
                    count += 1
                    if limit is not None and count >= limit:
                        return
    except (EOFError, OSError, UnicodeDecodeError, zlib.error) as exc:
        if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
            raise
        raise TraceError(f"{path}: unreadable as a (gzipped) JSONL trace: {exc}") from None


def _checked(record: dict[str, Any], where: str) -> bool:
    """Whether `record` is a request to replay; its fields made plain numbers in place."""
    ids = record.get("hash_ids")
    if ids is None or "input_length" not in record:
        return False
    if not isinstance(ids, list) or not all(
        isinstance(b, int | str) and not isinstance(b, bool) for b in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of block ids (integers or strings)")
    record["input_length"] = length = _number(record, "input_length", where, whole=True)
    if length < 0:
        raise TraceError(
            f"{where}: input_length must be a count of tokens, 0 or more (got {length})"
        )
    if not ids or length == 0:
        return False
    if "timestamp" in record:
        record["timestamp"] = _number(record, "timestamp", where, whole=False)
    if record.get("block_size") is not None:
        record["block_size"] = _number(record, "block_size", where, whole=True)
        if record["block_size"] <= 0:
            raise TraceError(f"{where}: block_size must be a positive number of tokens")
    return True


def _number(record: dict[str, Any], field: str, where: str, whole: bool) -> Any:
    value = got = record[field]
    kinds = "an integer" if whole else "a number"
    if isinstance(value, str):  # a number written as a string, as some exports do
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise TraceError(f"{where}: {field} must be {kinds} (got {json.dumps(got)})")
    if not -(2**63) < value < 2**63:  # infinities too
        raise TraceError(f"{where}: {field} is out of range (got {json.dumps(got)}; at most 2^63)")
    if whole and value != int(value):
        raise TraceError(f"{where}: {field} must be {kinds} (got {json.dumps(got)})")
    return int(value) if whole else float(value)


def trace_fields(path: Path) -> dict[str, Any]:
    """`chunk_bytes` and `sample_rate` from the first record (an export writes them)."""
    for record in read_records(path, limit=1):
        return {k: record[k] for k in ("chunk_bytes", "sample_rate") if k in record}
    return {}


def load_trace(path: Path, block_size: int | None = None, limit: int | None = None) -> Trace:
    """Read a trace; `block_size` is the fallback for records without one (records that
    name a block size must agree)."""
    edges: dict[tuple[int, Any], int] = {}
    parent = [0]
    depth = [0]
    starts: list[int] = []
    nodes: list[int] = []
    tokens: list[int] = []
    timestamps: list[float] = []
    size: int | None = None
    for record in read_records(path, limit):
        own = record.get("block_size")
        if own is not None:
            if size is not None and int(own) != size:
                raise TraceError(f"{path}: block_size {own} after block_size {size}")
            size = int(own)
        if size is None:
            size = block_size or DEFAULT_BLOCK_SIZE
        starts.append(len(nodes))
        timestamps.append(float(record.get("timestamp", 0)))
        input_length = int(record["input_length"])
        node = 0
        for index, block in enumerate(record["hash_ids"]):
            child = edges.get((node, block))
            if child is None:
                child = edges[(node, block)] = len(parent)
                parent.append(node)
                depth.append(depth[node] + 1)
            node = child
            nodes.append(node)
            tokens.append(_block_tokens(input_length, size, index))
    if not starts:
        raise TraceError(f"{path}: no records with hash_ids and a positive input_length")
    starts.append(len(nodes))
    requests = len(starts) - 1
    next_use = [requests] * len(nodes)
    last = [requests] * len(parent)
    for r in range(requests - 1, -1, -1):
        span = range(starts[r], starts[r + 1])
        for i in span:
            next_use[i] = last[nodes[i]]
        for i in span:
            last[nodes[i]] = r
    keys = [n.to_bytes(8, "big") for n in range(len(parent))]
    return Trace(
        size or DEFAULT_BLOCK_SIZE, starts, nodes, tokens, next_use, parent, depth, keys, timestamps
    )


class BeladyPolicy(EvictionPolicy):
    """Offline optimal: evict the chunk whose next use is furthest away (the deeper of two
    used by the same request, so a prefix outlives its extensions), and admit nothing whose
    next use is no sooner than that chunk's. The replay tells it, before each request, when
    each of the request's chunks is next used (`upcoming`)."""

    name = OPTIMAL

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.upcoming: dict[ChunkId, tuple[int, int]] = {}  # chunk -> (next use, depth)
        self._rank: dict[ChunkId, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int, ChunkId]] = []
        self._seq = 0

    def _push(self, chunk: ChunkId) -> None:
        rank = self.upcoming[chunk]
        self._rank[chunk] = rank
        self._seq += 1
        heapq.heappush(self._heap, (-rank[0], -rank[1], -self._seq, chunk))

    def on_insert(self, chunk: ChunkId) -> None:
        self._push(chunk)

    def on_hit(self, chunk: ChunkId) -> None:
        if chunk in self._rank:
            self._push(chunk)

    def on_remove(self, chunk: ChunkId) -> None:
        self._rank.pop(chunk, None)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        skipped: list[tuple[int, int, int, ChunkId]] = []
        victim: ChunkId | None = None
        while self._heap:
            item = self._heap[0]
            chunk = item[3]
            if self._rank.get(chunk) != (-item[0], -item[1]):
                heapq.heappop(self._heap)  # superseded by a later push, or gone
                continue
            if not evictable(chunk):
                skipped.append(heapq.heappop(self._heap))
                continue
            if incoming is not None and -item[0] <= self.upcoming[incoming][0]:
                break  # the incoming chunk is needed no sooner: do not admit it
            heapq.heappop(self._heap)
            del self._rank[chunk]
            victim = chunk
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victim

    def __len__(self) -> int:
        return len(self._rank)


REPLAY_POLICIES = [*POLICIES, OPTIMAL]
DEFAULT_POLICIES = "lru,arc,prefix,optimal"  # what `kvtier replay` compares unless told


def _make(policy: str, blocks: int) -> EvictionPolicy:
    return BeladyPolicy(blocks) if policy == OPTIMAL else make_policy(policy, blocks)


@dataclass
class Result:
    policy: str
    blocks: int
    hit_tokens: int = 0  # measured window, prefix semantics
    prompt_tokens: int = 0
    hit_blocks: int = 0  # measured window, any resident block
    looked_up_blocks: int = 0
    filled: bool = False  # the cache was full before the measured window
    evictions: int = 0
    rejected: int = 0  # stores refused (optimal's bypass; every slot pinned)

    @property
    def hit_rate(self) -> float | None:
        if not self.filled or not self.prompt_tokens:
            return None
        return self.hit_tokens / self.prompt_tokens

    @property
    def block_hit_rate(self) -> float | None:
        if not self.filled or not self.looked_up_blocks:
            return None
        return self.hit_blocks / self.looked_up_blocks


def _slots(trace: Trace, blocks: int) -> int:
    """The slots a replay of `blocks` needs: no more than the trace's distinct blocks, which
    is all it can ever hold (a pool larger than that never evicts, never fills, and gets
    the same hits), so a capacity of an exabyte replays in the memory of the trace."""
    return max(1, min(blocks, trace.unique_blocks))


def _request_done(
    r: int,
    warmup: int,
    result: Result,
    pool_full: bool,
    progress: Callable[[int], None] | None,
) -> None:
    """What both replays note once a request is through: whether warm-up has filled the pool
    (hit rates before that say nothing of the policy), and progress every 256 requests."""
    if r < warmup and not result.filled and pool_full:
        result.filled = True
    if progress is not None and r % 256 == 255:
        progress(256)


def _trace_done(
    trace: Trace,
    progress: Callable[[int], None] | None,
    upcoming: dict[ChunkId, tuple[int, int]] | None,
) -> None:
    if progress is not None:
        progress(trace.requests % 256)
    if upcoming is not None:
        upcoming.clear()  # Belady's look-ahead, which holds every future use of the trace


def replay(
    trace: Trace,
    policy: str,
    blocks: int,
    warmup_fraction: float = 0.5,
    progress: Callable[[int], None] | None = None,
) -> Result:
    """Replay every request of `trace` through a `HostIndex` of `blocks` slots."""
    slots = _slots(trace, blocks)
    chooser = _make(policy, slots)
    index = HostIndex(slots, chooser)
    upcoming = chooser.upcoming if isinstance(chooser, BeladyPolicy) else None
    result = Result(policy, blocks)
    warmup = int(trace.requests * warmup_fraction)
    keys_of, nodes, tokens, next_use, depth = (
        trace.keys,
        trace.nodes,
        trace.tokens,
        trace.next_use,
        trace.depth,
    )
    starts = trace.starts
    for r in range(trace.requests):
        start, end = starts[r], starts[r + 1]
        keys = [keys_of[n] for n in nodes[start:end]]
        if upcoming is not None:
            for i in range(start, end):
                n = nodes[i]
                upcoming[(NAMESPACE, keys_of[n])] = (next_use[i], depth[n])
        hits, prefix = index.lookup(NAMESPACE, keys)
        if r >= warmup:
            result.prompt_tokens += sum(tokens[start:end])
            result.hit_tokens += sum(tokens[start : start + prefix])
            result.hit_blocks += sum(hits)
            result.looked_up_blocks += end - start
        load = index.begin_load(CLIENT, NAMESPACE, keys[:prefix], _FOREVER)[0] if prefix else 0
        index.touch()
        if prefix < len(keys):
            # The store names each block's predecessor, as the plug-in does.
            parents = [keys[prefix - 1] if prefix else None, *keys[prefix:-1]]
            store = index.allocate(CLIENT, NAMESPACE, keys[prefix:], 1, _FOREVER, parents)[0]
            if store:
                index.commit(store, CLIENT)
        if load:
            index.end_load(load, CLIENT)
        _request_done(r, warmup, result, slots == blocks and not index.free_slots, progress)
    _trace_done(trace, progress, upcoming)
    result.evictions = index.counters.evictions
    result.rejected = index.counters.full
    return result


def replay_direct(
    trace: Trace,
    policy: str | EvictionPolicy,
    blocks: int,
    warmup_fraction: float = 0.5,
    progress: Callable[[int], None] | None = None,
    observe: Callable[[int, Sequence[int], Sequence[int]], None] | None = None,
) -> Result:
    """`replay` without the index: the same calls reach the same policy in the same order
    (a lookup's hits, the store's parents, an eviction per new chunk with the request's hit
    prefix and the store's own chunks pinned, the commit), the slots and pins kept in
    lists. Several times faster, for sweeps; `tests/test_replay.py` holds it equal to
    `replay`. `observe(r, nodes, slots)`, where given, sees each request's nodes and their
    slots at lookup (-1: not held), before the request changes anything (`kvtier plan`
    runs a secondary tier behind the host tier on it)."""
    slots = _slots(trace, blocks) if isinstance(policy, str) else blocks
    chooser = _make(policy, slots) if isinstance(policy, str) else policy
    by_slot, links = chooser.by_slot, chooser.links_slots
    upcoming = chooser.upcoming if isinstance(chooser, BeladyPolicy) else None
    result = Result(chooser.name, blocks)
    warmup = int(trace.requests * warmup_fraction)
    nodes, tokens, next_use, depth, starts = (
        trace.nodes,
        trace.tokens,
        trace.next_use,
        trace.depth,
        trace.starts,
    )
    slot_of = [-1] * len(trace.parent)  # per node: its slot while resident
    node_in = [0] * slots  # per slot: its node
    pins = [0] * slots
    free = list(range(slots - 1, -1, -1))
    evictions = full = 0

    def evictable(chunk: ChunkId) -> bool:
        return not pins[cast(int, chunk) if by_slot else slot_of[cast(int, chunk)]]

    for r in range(trace.requests):
        start, end = starts[r], starts[r + 1]
        path = nodes[start:end]
        if upcoming is not None:
            for i in range(start, end):
                upcoming[nodes[i]] = (next_use[i], depth[nodes[i]])
        held = [slot_of[n] for n in path]
        if observe is not None:
            observe(r, path, held)
        prefix = held.index(-1) if -1 in held else len(held)
        if r >= warmup:
            result.prompt_tokens += sum(tokens[start:end])
            result.hit_tokens += sum(tokens[start : start + prefix])
            result.hit_blocks += sum(1 for s in held if s >= 0)
            result.looked_up_blocks += end - start
        loaded = held[:prefix]
        for s in loaded:
            pins[s] += 1
        hit = [s for s in held if s >= 0]
        if hit:
            chooser.on_hits(hit if by_slot else [node_in[s] for s in hit])
        if prefix < len(path):
            todo = path[prefix:]
            parents = [path[prefix - 1] if prefix else None, *todo[:-1]]
            if not by_slot:
                chooser.on_parents(
                    [(n, p) for n, p in zip(todo, parents, strict=True) if slot_of[n] < 0]
                )
            granted: list[int] = []
            given: list[int] = []
            for n in todo:
                if slot_of[n] >= 0:
                    continue
                if free:
                    got = free.pop()
                else:
                    victim = chooser.evict(evictable, None if by_slot else n)
                    if victim is None:
                        full += 1
                        continue
                    got = cast(int, victim) if by_slot else slot_of[cast(int, victim)]
                    slot_of[node_in[got]] = -1
                    evictions += 1
                slot_of[n] = got
                node_in[got] = n
                pins[got] += 1
                granted.append(n)
                given.append(got)
            if given:
                if links:
                    parent_of = dict(zip(todo, parents, strict=True))
                    chooser.on_links(
                        given,
                        [-1 if (p := parent_of[n]) is None else slot_of[p] for n in granted],
                    )
                for s in given:
                    pins[s] -= 1
                chooser.on_inserts(given if by_slot else granted)
        for s in loaded:
            pins[s] -= 1
        _request_done(r, warmup, result, slots == blocks and not free, progress)
    _trace_done(trace, progress, upcoming)
    result.evictions, result.rejected = evictions, full
    return result


@dataclass
class Budget:
    label: str  # as given: "8Gi", or the block count
    blocks: int
    capacity_bytes: int | None = None  # where given as a size


def capacity_label(capacity: str) -> str:
    """A capacity as given, and in binary units where it was not: `8G` is 8 x 10^9 bytes
    (Kubernetes' rule), `8G = 7.5 GiB`."""
    given = capacity.strip()
    if given.rstrip("B").endswith("i"):
        return given
    return f"{given} = {format_bytes(parse_bytes(given))}"


def positive_bytes(flag: str, text: str | None) -> int | None:
    """A size argument (a Kubernetes quantity), None where not given; 0 or less is refused
    by name, not read as "not given" or as a capacity that holds no block."""
    if text is None:
        return None
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if value <= 0:
        raise ValueError(f"{flag} must be a positive size such as 64Mi (got {text})")
    return value


def _exported_chunk_bytes(path: Path) -> int | None:
    """The chunk size a `kvtier trace` export records, where it is a positive integer."""
    size = trace_fields(path).get("chunk_bytes")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def block_counts(text: str | None) -> list[int]:
    """`--blocks`: comma-separated whole numbers of blocks."""
    counts = []
    for part in (text or "").split(","):
        if part.strip():
            try:
                counts.append(int(part))
            except ValueError:
                raise ValueError(
                    f"--blocks: {part.strip()!r} is not a whole number of blocks (e.g. 512,2048)"
                ) from None
    return counts


def budgets(
    capacities: Sequence[str], block_bytes: int | None, blocks: Sequence[int]
) -> list[Budget]:
    out = [Budget(str(n), n) for n in blocks]
    if capacities:
        if not block_bytes:
            raise ValueError(
                "--capacity needs --block-bytes or --bytes-per-token (the trace names no "
                "chunk_bytes)"
            )
        for c in capacities:
            size = positive_bytes("--capacity", c) or 0
            out.append(Budget(capacity_label(c), size // block_bytes, size))
    if not out:
        raise ValueError("give --capacity (with --block-bytes) or --blocks")
    for budget in out:
        if budget.blocks < 1:
            raise ValueError(f"capacity {budget.label} holds no block")
    return out


def show(report: dict[str, Any], as_json: bool, table: Any, lines: list[str], width: int) -> None:
    """A command's report: JSON on stdout for scripts, else its table and lines (`width`
    columns when stdout is not a terminal, so piped output is not cut)."""
    if as_json:
        print(json.dumps(report, indent=2))
        return
    from rich.console import Console

    out = Console(width=None if Console().is_terminal else width)
    out.print(table)
    for line in lines:
        out.print(line)


class _ProgressLines:
    """Progress as a line on `console` every `every` seconds and one at the end, for a
    stderr that is not a terminal (a log, a pipe): the same calls as rich's Progress."""

    def __init__(self, label: str, console: Console, every: float = 5.0) -> None:
        self.label, self.console, self.every = label, console, every
        self.done = self.total = 0
        self.began = self.last = time.monotonic()

    def __enter__(self) -> _ProgressLines:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.console.print(
            f"{self.label}: {self.done:,} requests replayed in "
            f"{time.monotonic() - self.began:.0f} s",
            highlight=False,
        )

    def add_task(self, _name: str, total: int) -> TaskID:
        from rich.progress import TaskID

        self.total += total
        return TaskID(0)

    def advance(self, _task: TaskID, n: float) -> None:
        self.done += int(n)
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            share = 100 * self.done / max(self.total, 1)
            self.console.print(
                f"{self.label}: {self.done:,} of {self.total:,} requests replayed ({share:.0f}%)",
                highlight=False,
            )


def progress_bar(label: str, console: Console) -> Progress | _ProgressLines:
    """How replay and plan show progress on stderr, whatever the output (JSON included): a
    bar on a terminal, else a line every few seconds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    if not console.is_terminal:
        return _ProgressLines(label, console)
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
    )


def run(
    trace: Trace,
    sizes: Sequence[Budget],
    policies: Sequence[str],
    warmup_fraction: float = 0.5,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replay every (budget, policy); the report `--json` prints. Each runs `replay_direct`,
    the index's calls to the policy without the index (held equal to `replay` by
    tests/test_floor.py), several times faster. `requests_per_s` counts the CPU time of the
    replaying thread, which is one core's throughput whatever else the machine runs;
    `wall_s` is the elapsed time beside it."""
    rows: list[dict[str, Any]] = []
    replayed = 0
    began = time.perf_counter()
    began_cpu = time.thread_time()
    for size in sizes:
        row: dict[str, Any] = {"capacity": size.label, "blocks": size.blocks}
        if size.capacity_bytes is not None:
            row["capacity_bytes"] = size.capacity_bytes
        block_rates: dict[str, float | None] = {}
        saved: dict[str, int] = {}
        for policy in policies:
            result = replay_direct(trace, policy, size.blocks, warmup_fraction, progress)
            replayed += trace.requests
            row[policy] = result.hit_rate
            block_rates[policy] = result.block_hit_rate
            saved[policy] = result.hit_tokens
        row["block_hit_rate"] = block_rates
        row["prefill_tokens_saved"] = saved
        row["underfilled"] = all(row[p] is None for p in policies)
        lru, optimal = row.get("lru"), row.get(OPTIMAL)
        for policy in policies:
            mine = row[policy]
            if policy in ("lru", OPTIMAL) or mine is None or lru is None or optimal is None:
                continue
            if optimal > lru:  # the share of LRU's shortfall from optimal this policy recovers
                row[f"{policy}_gap_closed"] = (mine - lru) / (optimal - lru)
        rows.append(row)
    elapsed = time.perf_counter() - began
    cpu = time.thread_time() - began_cpu
    return {
        "trace": {
            "requests": trace.requests,
            "block_size": trace.block_size,
            "unique_blocks": trace.unique_blocks,
            "measured_from_request": int(trace.requests * warmup_fraction),
        },
        "policies": list(policies),
        "budgets": rows,
        "requests_per_s": replayed / max(cpu, 1e-9),
        "wall_requests_per_s": replayed / max(elapsed, 1e-9),
        "wall_s": elapsed,
    }


def _load_checked(
    client: AgentClient, namespace: str, keys: list[bytes], chunk_bytes: int
) -> tuple[int, int]:
    """Load the hit prefix `keys`: how many rows came (up to the first that did not), and how
    many of those differ from the bytes stored under their key."""
    import numpy as np

    from kvtier.traces.workload import row_for

    if not keys:
        return 0, 0
    outs = [np.empty(chunk_bytes, np.uint8) for _ in keys]
    copied = client.load_into(namespace, keys, outs)
    loaded = copied.index(False) if False in copied else len(keys)
    wrong = sum(
        1
        for key, out in zip(keys[:loaded], outs, strict=False)
        if not np.array_equal(out, row_for(key, chunk_bytes))
    )
    return loaded, wrong


def _store_after(
    client: AgentClient, namespace: str, keys: list[bytes], prefix: int, chunk_bytes: int
) -> None:
    """Store the request's chunks after its hit prefix, each naming its parent."""
    from kvtier.traces.workload import row_for

    rest = keys[prefix:]
    parents = [keys[prefix - 1] if prefix else None, *keys[prefix:-1]]
    client.store(namespace, rest, [row_for(k, chunk_bytes) for k in rest], parents)


def replay_agent(
    trace: Trace,
    endpoint: str,
    chunk_bytes: int,
    namespace: str | None = None,
    warmup_fraction: float = 0.5,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replay `trace` against a live agent with real chunk bytes: per request a lookup, a
    load of the hit prefix (each row checked against the bytes stored under its key), and a
    store of the rest naming each chunk's parent. The pool size, policy and secondary tiers
    are the agent's own; hits are counted by the tier that held them. A fresh namespace by
    default, so chunks of an earlier run are no hits."""
    from kvtier.client.connection import AgentClient

    namespace = namespace or f"kvtier-replay-{secrets.token_hex(4)}"
    warmup = int(trace.requests * warmup_fraction)
    hit_tokens = prompt_tokens = hit_blocks = looked_up = wrong = 0
    by_tier: dict[str, int] = {}
    began = time.perf_counter()
    with AgentClient(endpoint) as client:
        names = ["host", *client.tiers]
        for r in range(trace.requests):
            start, end = trace.starts[r], trace.starts[r + 1]
            keys = [trace.keys[n] for n in trace.nodes[start:end]]
            found = client.lookup(namespace, keys)
            prefix, damaged = _load_checked(client, namespace, keys[: found.prefix], chunk_bytes)
            wrong += damaged
            if r >= warmup:
                prompt_tokens += sum(trace.tokens[start:end])
                hit_tokens += sum(trace.tokens[start : start + prefix])
                hit_blocks += sum(found.hits)
                looked_up += end - start
                for i in range(prefix):
                    tier = names[found.where[i]] if found.where else "host"
                    by_tier[tier] = by_tier.get(tier, 0) + trace.tokens[start + i]
            if prefix < len(keys):
                _store_after(client, namespace, keys, prefix, chunk_bytes)
            if progress is not None and r % 256 == 255:
                progress(256)
        stats = client.stats()
    elapsed = time.perf_counter() - began
    return {
        "agent": endpoint,
        "namespace": namespace,
        "chunk_bytes": chunk_bytes,
        "policy": stats.host.policy.policy,
        "slots": stats.host.slots,
        "trace": {"requests": trace.requests, "measured_from_request": warmup},
        "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else None,
        "block_hit_rate": hit_blocks / looked_up if looked_up else None,
        "hit_tokens_by_tier": by_tier,
        "prefill_tokens_saved": hit_tokens,
        "wrong_rows": wrong,
        "requests_per_s": trace.requests / elapsed if elapsed > 0 else None,
    }


def _percent(value: float | None) -> str:
    return "underfilled" if value is None else f"{100 * value:.1f}%"


def render(report: dict[str, Any]) -> Any:
    from rich.table import Table

    policies = report["policies"]
    t = report["trace"]
    table = Table(
        title=f"{t['requests']:,} requests, {t['unique_blocks']:,} prefix blocks of "
        f"{t['block_size']} tokens; hit prompt tokens up to the first miss, last "
        f"{t['requests'] - t['measured_from_request']:,} requests"
    )
    table.add_column("capacity")
    table.add_column("blocks", justify="right")
    for policy in policies:
        table.add_column(policy, justify="right")
    for policy in policies:
        table.add_column(f"{policy} (blocks)", justify="right")
    gaps = (
        [k for k in report["budgets"][0] if k.endswith("_gap_closed")] if report["budgets"] else []
    )
    for gap in gaps:
        table.add_column(gap.replace("_gap_closed", " gap closed"), justify="right")
    for row in report["budgets"]:
        cells = [row["capacity"], f"{row['blocks']:,}"]
        cells += [_percent(row[p]) for p in policies]
        cells += [_percent(row["block_hit_rate"][p]) for p in policies]
        cells += [f"{100 * row[g]:.0f}%" if g in row else "-" for g in gaps]
        table.add_row(*cells)
    table.caption = (
        f"{report['requests_per_s']:,.0f} requests/s through the host index on one core, "
        f"{report.get('wall_requests_per_s', 0):,.0f} by the wall clock "
        f"({report['wall_s']:,.1f} s elapsed)"
    )
    return table


def main(args: Any) -> int:
    """Entry point of `kvtier replay` (flags parsed in kvtier.cli.main)."""
    from rich.console import Console

    err = Console(stderr=True)
    given = DEFAULT_POLICIES if args.policy is None else args.policy
    policies = [p.strip() for p in given.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(REPLAY_POLICIES)) or ([] if policies else [repr("")])
    if unknown:
        err.print(f"unknown policy {', '.join(unknown)}; use {', '.join(REPLAY_POLICIES)}")
        return 2
    if args.agent:
        return _main_agent(args, err)
    try:
        block_bytes = positive_bytes("--block-bytes", args.block_bytes)
        if args.plot is not None:
            check_target(args.plot)
        trace = load_trace(args.trace, args.block_size, args.limit)
        if block_bytes is None and args.bytes_per_token:
            per_token = positive_bytes("--bytes-per-token", args.bytes_per_token)
            block_bytes = (per_token or 0) * trace.block_size
        if block_bytes is None and args.capacity:  # an export names its chunks' size
            block_bytes = _exported_chunk_bytes(args.trace)
        capacities = [c.strip() for c in (args.capacity or "").split(",") if c.strip()]
        blocks = block_counts(args.blocks)
        sizes = budgets(capacities, block_bytes, blocks)
    except (OSError, ValueError) as exc:
        print(exc, file=sys.stderr)  # one line, whatever the terminal's width
        return 2
    total = trace.requests * len(sizes) * len(policies)
    with progress_bar("replay", err) as bar:
        task = bar.add_task("replay", total=total)
        report = run(trace, sizes, policies, progress=lambda n: bar.advance(task, n))
    if block_bytes:
        report["block_bytes"] = block_bytes
    if args.plot is not None:
        from kvtier.traces.plot import plot_replay

        plot_replay(report, args.plot)
    lines = [f"block = {format_bytes(block_bytes)}"] if block_bytes else []
    show(report, args.json, render(report), lines, 160)
    return 0


def _main_agent(args: Any, err: Any) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.client.connection import AgentError

    try:
        trace = load_trace(args.trace, args.block_size, args.limit)
        rows = positive_bytes("--chunk-bytes", args.chunk_bytes or "64Ki") or 0
        report = replay_agent(trace, args.agent, rows, args.namespace)
    except (OSError, ValueError, AgentError) as exc:
        err.print(str(exc))
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        table = Table(title=f"{trace.requests:,} requests against {args.agent}")
        table.add_column("")
        table.add_column("", justify="right")
        table.add_row("policy, slots", f"{report['policy']}, {report['slots']:,}")
        table.add_row("hit rate (prompt tokens)", _percent(report["hit_rate"]))
        table.add_row("block hit rate", _percent(report["block_hit_rate"]))
        for tier, tokens in report["hit_tokens_by_tier"].items():
            table.add_row(f"hit tokens from {tier}", f"{tokens:,}")
        table.add_row("rows with wrong bytes", str(report["wrong_rows"]))
        table.add_row("requests/s", f"{report['requests_per_s']:,.0f}")
        Console().print(table)
    return 1 if report["wrong_rows"] else 0
