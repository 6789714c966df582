"""`kvtier trace`: export an agent's access log as a Mooncake-format trace.

The agent answers `AccessLog` pages on its local control socket only (no new network
endpoint): run this next to the agent (in its pod, which is what `kubectl kvtier trace`
does through the Kubernetes API), or anywhere its socket is mounted. The result is the JSONL
`kvtier replay` and `kvtier plan` read: `timestamp` (ms from the first request),
`input_length` (chunks x `--block-size` tokens), `hash_ids` (key digests renumbered in order
of first appearance), `block_size`, and, for `kvtier plan`, `chunk_bytes` (the agent's slot
size) and `sample_rate` (the log's sampling of whole requests).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from kvtier.agent.access_log import Logged, to_records
from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient

DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size


@dataclass
class Exported:
    requests: int
    keys: int
    unique: int
    sample_rate: float
    dropped: int
    chunk_bytes: int


def fetch(client: AgentClient) -> tuple[list[Logged], float, int]:
    """Every request in the agent's log, page by page; (requests, sample rate, dropped)."""
    out: list[Logged] = []
    after = 0
    while True:
        # The control call the plug-in's client makes for every request, with this message.
        reply: p.AccessLogReply = client._call(p.AccessLog(after), p.AccessLogReply)
        out += [Logged(r.seq, r.time, r.ids, r.hits) for r in reply.requests]
        if not reply.more or reply.next <= after:
            return out, reply.sample_rate, reply.dropped
        after = reply.next


@contextmanager
def _output(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdout
        sys.stdout.flush()
    elif path.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as out:
            yield out
    else:
        with open(path, "w", encoding="utf-8") as out:
            yield out


def export(endpoint: str, output: str, block_size: int, timeout: float = 10.0) -> Exported:
    with AgentClient(endpoint, timeout=timeout) as client:
        logged, rate, dropped = fetch(client)
        chunk_bytes = client.slot_bytes
    extra: dict[str, object] = {"chunk_bytes": chunk_bytes}
    if rate < 1.0:
        extra["sample_rate"] = rate
    ids: dict[int, int] = {}
    records = to_records(logged, block_size, ids, extra=extra)
    with _output(output) as out:
        for record in records:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
    return Exported(
        len(records), sum(len(e.ids) for e in logged), len(ids), rate, dropped, chunk_bytes
    )


def main(args: Any) -> int:
    """Entry point of `kvtier trace` (flags parsed in kvtier.cli.main)."""
    from kvtier.client.connection import AgentError

    endpoint = args.agent
    if endpoint is None:
        from kvtier.api.config import ConfigError, load_config

        try:
            endpoint = load_config(args.config).endpoint
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
    try:
        done = export(endpoint, args.output, args.block_size, args.timeout)
    except AgentError as exc:
        hint = (
            " (an agent older than this kvtier keeps no access log)"
            if "AccessLog" in str(exc)
            else ""
        )
        print(f"kvtier trace: {exc}{hint}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader of stdout went away: `kvtier`'s own quiet exit
    except (OSError, ValueError) as exc:  # ValueError: an endpoint that is not ipc://
        print(f"kvtier trace: {exc}", file=sys.stderr)
        return 2
    lost = f", {done.dropped:,} older requests no longer held" if done.dropped else ""
    print(
        f"{done.requests:,} requests, {done.keys:,} chunk lookups of {done.unique:,} chunks "
        f"(sample rate {done.sample_rate:g}{lost}) -> {args.output}",
        file=sys.stderr,
    )
    return 0
