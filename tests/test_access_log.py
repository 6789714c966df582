"""The agent's access log and `kvtier trace`: a bounded, sampled, content-free log of lookups
that exports as a trace `kvtier replay` reads, with the reuse structure of the traffic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.agent.access_log import AccessLog, to_records
from kvtier.cli.main import main
from kvtier.client import protocol as p
from kvtier.traces.replay import Budget, load_trace, run
from kvtier.traces.tracegen import multi_turn, write
from tests.conftest import ROW, ChatsThroughAgent


def chained(records: list[dict[str, object]]) -> list[list[bytes]]:
    """Each record's keys as vLLM makes them: a block's key names its whole prefix."""
    out = []
    for record in records:
        keys, prefix = [], b""
        for block in record["hash_ids"]:  # type: ignore[attr-defined]
            prefix = prefix + int(block).to_bytes(8, "big")
            keys.append(prefix[-64:] + len(prefix).to_bytes(4, "big"))
        out.append(keys)
    return out


def test_ids_hide_keys_and_namespaces() -> None:
    log = AccessLog(secret=b"s" * 16)
    key = b"system-prompt-block"
    log.record_request("llama@abc", [key, b"x"], [True, False], now=1.0)
    log.record_request("llama@abc", [key], 1, now=2.0)
    log.record_request("qwen@def", [key], 0, now=3.0)
    a, b, c = log.page(0)[0]
    assert a.ids[0] == b.ids[0] != c.ids[0]  # same key, same id; other namespace, other id
    assert a.ids[1] not in (a.ids[0], c.ids[0])
    assert (a.hits, b.hits, c.hits) == (1, 1, 0)
    other = AccessLog(secret=b"t" * 16)  # another agent: other ids for the same key
    other.record_request("llama@abc", [key], 1, now=1.0)
    assert other.page(0)[0][0].ids[0] != a.ids[0]
    wire = p.encode(log.reply(0))
    assert key not in wire and b"llama" not in wire


def test_bounded_by_keys_oldest_dropped() -> None:
    log = AccessLog(max_keys=10)
    for i in range(6):
        log.record_request("ns", [bytes([i, j]) for j in range(3)], 0, now=float(i))
    held, _, more = log.page(0)
    assert [e.seq for e in held] == [4, 5, 6] and not more
    assert log.dropped == 3 and log.stats()["keys"] == 9


def test_pages_cover_the_log_once() -> None:
    log = AccessLog()
    for i in range(50):
        log.record_request("ns", [bytes([i, j]) for j in range(7)], 0, now=float(i))
    seen: list[int] = []
    after = 0
    while True:
        page, after, more = log.page(after, max_keys=20)
        assert sum(len(e.ids) for e in page) <= 21
        seen += [e.seq for e in page]
        if not more:
            break
    assert seen == list(range(1, 51))


def test_sampling_keeps_whole_requests_by_first_chunk() -> None:
    log = AccessLog(sample_rate=0.25, secret=b"k" * 16)
    kept: dict[int, set[bool]] = {}
    for head in range(2000):
        for turn in range(3):  # requests that start alike are kept or dropped together
            keys = [b"head%d" % head, *(b"t%d-%d" % (head, t) for t in range(turn + 1))]
            kept.setdefault(head, set()).add(log.record_request("ns", keys, 0, now=0.0))
        # the first key's id alone decides, before any other key's id is computed
        assert {log.sampled("ns", b"head%d" % head)} == kept[head]
    assert all(len(choice) == 1 for choice in kept.values())
    rate = sum(True in c for c in kept.values()) / len(kept)
    assert 0.2 < rate < 0.3
    assert all(len(e.ids) in (2, 3, 4) for e in log.page(0, max_keys=1 << 20)[0])


def test_export_replays_like_the_traffic(tmp_path: Path) -> None:
    """Logged from chained keys and exported, a multi-turn trace gives the same hit rates."""
    records = multi_turn(seed=5, conversations=300)
    log = AccessLog()
    for i, keys in enumerate(chained(records)):
        log.record_request("ns", keys, 0, now=1000.0 + i)
    exported = to_records(log.page(0, max_keys=1 << 30)[0], block_size=512)
    assert exported[0]["timestamp"] == 0 and exported[1]["timestamp"] == 1000
    original = load_trace(write(tmp_path / "a.jsonl", records))
    again = load_trace(write(tmp_path / "b.jsonl", exported))
    assert again.unique_blocks == original.unique_blocks
    sizes = [Budget("64", 64), Budget("256", 256)]
    # Token weights differ (the export knows chunks, not tokens); block-level figures agree.
    a = run(original, sizes, ["lru", "prefix"])["budgets"]
    b = run(again, sizes, ["lru", "prefix"])["budgets"]
    assert [r["block_hit_rate"] for r in a] == [r["block_hit_rate"] for r in b]


def test_kvtier_trace_from_a_live_agent(
    chats_through_agent: ChatsThroughAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Traffic through a real agent, exported over its socket, is the traffic's trace."""
    agent, _, original, _ = chats_through_agent("lru", 3, 60)
    out = tmp_path / "my.jsonl.gz"
    argv = ["trace", "--agent", agent.config.endpoint, "-o", str(out), "--block-size", "512"]
    assert main(argv) == 0
    assert f"{original.requests:,} requests" in capsys.readouterr().err
    exported = load_trace(out)
    assert exported.requests == original.requests
    assert exported.unique_blocks == original.unique_blocks
    assert exported.nodes == original.nodes  # the same prefix tree, numbered alike
    first = json.loads(__import__("gzip").open(out, "rt").readline())
    assert first["chunk_bytes"] >= ROW and first["block_size"] == 512 and "sample_rate" not in first

    argv = ["replay", str(out), "--blocks", "32", "--policy", "lru", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["budgets"][0]["blocks"] == 32


def test_kvtier_trace_needs_an_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = tmp_path / "run" / "agent.sock"
    sock.parent.mkdir()
    argv = ["trace", "--agent", f"ipc://{sock}", "-o", str(tmp_path / "x.jsonl")]
    assert main([*argv, "--timeout", "0.5"]) == 2
    assert "kvtier trace:" in capsys.readouterr().err


def test_logging_a_lookup_is_cheap() -> None:
    """On the lookup path: a 1,000-key request (keys hashed already, as by the index) is
    logged in a small part of the lookup's own round trip (about 700 us)."""
    import os
    import time

    log = AccessLog()
    keys = [os.urandom(36) for _ in range(1000)]
    ready = set(keys[:500])
    hits = [k in ready for k in keys]  # what the index's lookup does, hashing every key
    began = time.perf_counter()
    for _ in range(100):
        log.record_request("ns", keys, hits)
    assert (time.perf_counter() - began) / 100 < 500e-6  # a keyed digest per key took 1.5 ms


def test_digests_logged_as_bytes_read_as_the_same_ids() -> None:
    """A lookup the agent answers is logged by its index digests, kept as bytes and hashed
    only when the log is read: the ids are those of the same digests logged as keys, in
    order, and a request longer than the log keeps its first `max_keys` keys."""
    import numpy as np

    log = AccessLog(max_keys=6, secret=b"s" * 16)
    ds = np.array([7, 1 << 63, 7, 42, 5, 6, 9, 11], np.uint64)
    raw = [int(d).to_bytes(8, "little") for d in ds]
    assert log.record_digests("ns", ds[:3], [True, False, True])
    log.record_request("ns", raw[:3], 2, now=1.0)
    first, second = log.page(0)[0]
    assert list(first.ids) == list(second.ids) and first.ids[0] == first.ids[2] != first.ids[1]
    assert first.hits == second.hits == 2
    assert log.record_digests("ns", ds, [False] * 8)
    (longest,) = [e for e in log.page(0)[0] if len(e.ids) > 3]
    assert len(longest.ids) == 6 and list(longest.ids)[:3] == list(first.ids)
    assert log.stats()["keys"] == 6  # the first two requests were pushed out
    assert not log.record_digests("ns", ds[:0], [])  # a lookup of no keys is not logged
