"""`kvtier replay`: traces through the host index, against kvcache-simulator's figures."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.agent.host.index import HostIndex
from kvtier.cli.main import main
from kvtier.client.protocol import StoreCode
from kvtier.traces.replay import BeladyPolicy, Budget, budgets, load_trace, replay, run
from kvtier.traces.tracegen import write as write_trace
from tests.conftest import ROW, ChatsThroughAgent

# The first 3,000 requests of the Mooncake conversation trace (see tests/data/README.md).
TRACE_SLICE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_3000.jsonl.gz"


@pytest.mark.parametrize("blocks", [128, 512])
@pytest.mark.parametrize("policy", ["lru", "optimal"])
def test_agrees_with_kvcache_simulator(policy: str, blocks: int, tmp_path: Path) -> None:
    from kvcache_sim import trace as sim_trace
    from kvcache_sim.plan import build_execution_plan
    from kvcache_sim.policies import simulate_policy

    requests = 3000
    plain = tmp_path / "trace.jsonl"  # kvcache-simulator reads plain JSONL only
    plain.write_bytes(gzip.decompress(TRACE_SLICE.read_bytes()))
    plan = build_execution_plan(
        sim_trace.parse_trace_file(plain, block_size=512, max_records=requests)
    )
    reference = simulate_policy(plan, policy, blocks)
    assert reference.measurementMode == "fixed_window"

    result = replay(load_trace(TRACE_SLICE, 512, requests), policy, blocks)
    assert result.hit_rate is not None
    assert result.prompt_tokens == reference.totalTokens
    assert abs(result.hit_rate - reference.hitRate) <= 0.005, (result.hit_rate, reference)


def test_prefix_semantics_and_token_weights(tmp_path: Path) -> None:
    # Three slots under LRU, leaves first: request 2 evicts block 2, never block 1 under
    # it, so request 3 finds its first block (512 tokens) and, having evicted the leaf 4,
    # request 4 its first (512). A flat LRU evicted block 1 and left 2 as dead weight.
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 600, "hash_ids": [3, 4]},
            {"timestamp": 2, "input_length": 700, "hash_ids": [1, 2]},
            {"timestamp": 3, "input_length": 1000, "hash_ids": [3, 4]},
        ],
    )
    trace = load_trace(path)
    assert trace.tokens == [512, 512, 512, 88, 512, 188, 512, 488]
    result = replay(trace, "lru", 3)
    assert result.filled
    assert result.prompt_tokens == 700 + 1000  # the last half of the requests
    assert result.hit_tokens == 512 + 512
    assert result.block_hit_rate == 0.5
    roomy = replay(trace, "lru", 4)
    assert roomy.hit_rate == 1.0  # both halves hit in full, the short last blocks weighed
    assert roomy.block_hit_rate == 1.0


def test_chained_keys_distinguish_prefixes(tmp_path: Path) -> None:
    # The same hash id after another prefix is another chunk.
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"input_length": 1024, "hash_ids": [1, 2]},
            {"input_length": 1024, "hash_ids": [9, 2]},
        ],
    )
    trace = load_trace(path)
    assert trace.unique_blocks == 4
    assert trace.nodes[1] != trace.nodes[3]


def test_underfilled_capacity_reports_none(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl.gz",
        [{"input_length": 512, "hash_ids": [i % 3]} for i in range(10)],
    )
    trace = load_trace(path)
    result = replay(trace, "lru", 100)
    assert result.hit_rate is None and not result.filled


def test_belady_evicts_furthest_and_bypasses() -> None:
    policy = BeladyPolicy(2)
    index = HostIndex(2, policy)
    ns = "n"
    policy.upcoming = {(ns, b"a"): (5, 1), (ns, b"b"): (9, 1), (ns, b"c"): (7, 1)}
    for key in (b"a", b"b"):
        lease = index.allocate("c", ns, [key], 1, 1e18)[0]
        index.commit(lease, "c")
    lease = index.allocate("c", ns, [b"c"], 1, 1e18)[0]
    index.commit(lease, "c")
    assert index.get(ns, b"b") is None  # next used at 9, after c's 7
    policy.upcoming[(ns, b"d")] = (8, 1)
    assert index.allocate("c", ns, [b"d"], 1, 1e18)[1] == [StoreCode.FULL]  # d is needed last
    # A tie on next use goes to the deeper chunk: the prefix outlives its extension.
    policy.upcoming[(ns, b"a")] = (7, 3)
    policy.on_hit((ns, b"a"))
    assert policy.evict(lambda _c: True) == (ns, b"a")


def test_budgets_from_bytes_and_blocks() -> None:
    sizes = budgets(["8Gi", "32Gi"], 64 << 20, [10])
    assert [(b.label, b.blocks) for b in sizes] == [("10", 10), ("8Gi", 128), ("32Gi", 512)]
    with pytest.raises(ValueError):
        budgets(["8Gi"], None, [])


def test_report_gap_closed(tmp_path: Path) -> None:
    records = [
        {"input_length": 2048, "hash_ids": [r % 7, 100 + r % 5, 200 + r % 3, r]} for r in range(200)
    ]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", records))
    report = run(trace, [Budget("6", 6)], ["lru", "arc", "optimal"])
    row = report["budgets"][0]
    assert row["optimal"] > row["lru"]  # the trace leaves LRU a gap to close
    assert row["arc_gap_closed"] == pytest.approx(
        (row["arc"] - row["lru"]) / (row["optimal"] - row["lru"])
    )
    assert report["requests_per_s"] > 0 and report["wall_s"] > 0


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"timestamp": r, "input_length": 1500, "hash_ids": [1, 2, r % 4]} for r in range(50)]
    path = write_trace(tmp_path / "t.jsonl.gz", records)
    code = main(
        [
            "replay",
            str(path),
            "--capacity",
            "4Mi",
            "--block-bytes",
            "1Mi",
            "--policy",
            "lru,optimal",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["budgets"]
    assert row["capacity"] == "4Mi" and row["blocks"] == 4 and row["capacity_bytes"] == 4 << 20
    assert 0 <= row["lru"] <= row["optimal"] <= 1
    assert set(row["block_hit_rate"]) == {"lru", "optimal"}
    assert isinstance(report["requests_per_s"], float)
    assert main(["replay", str(path), "--blocks", "4", "--policy", "nope"]) == 2
    assert main(["replay", str(path), "--capacity", "1Gi", "--block-bytes", "lots"]) == 2
    assert "cannot read 'lots'" in capsys.readouterr().err  # a message, not a traceback


GOOD = '{"timestamp": 1, "input_length": 1024, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"timestamp": 0, "input_length": 100, "hash_ids": [[1], 2]}', "t.jsonl:3: hash_ids"),
        ('{"timestamp": 0, "input_length": null, "hash_ids": [1]}', "t.jsonl:3: input_length"),
        ('{"timestamp": 0, "input_length": 1e400, "hash_ids": [1]}', "t.jsonl:3: input_length"),
        ('{"timestamp": 0, "input_length": "abc", "hash_ids": [1]}', "t.jsonl:3: input_length"),
        ('{"timestamp": "x", "input_length": 10, "hash_ids": [1]}', "t.jsonl:3: timestamp"),
        ('{"input_length": 10, "hash_ids": [1], "block_size": 0}', "t.jsonl:3: block_size"),
        ("{bad json", "t.jsonl:3: not a JSON record"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [true]}', "t.jsonl:3: hash_ids"),
        ('{"timestamp": 0, "input_length": -100, "hash_ids": [1]}', "t.jsonl:3: input_length"),
        (
            '{"timestamp": 0, "input_length": 100000000000000000000000000, "hash_ids": [1]}',
            "t.jsonl:3: input_length is out of range",
        ),
    ],
)
def test_a_bad_record_is_named_by_its_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, said: str
) -> None:
    """Two good records, then the bad one (line 3): the message names the line in the file
    and the field, for replay and plan alike, and nothing raises past the command."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + GOOD + line + "\n")
    assert main(["replay", str(path), "--blocks", "4"]) == 2
    assert said in _unwrapped(capsys.readouterr().err)
    assert main(["plan", str(path), "--block-bytes", "64Mi"]) == 2
    assert said in _unwrapped(capsys.readouterr().err)


def _unwrapped(text: str) -> str:
    """Messages as one line (the console wraps them at its width)."""
    return " ".join(text.split())


def test_a_truncated_gzip_and_a_byte_order_mark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = gzip.compress((GOOD * 400).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert main(["replay", str(cut), "--blocks", "4"]) == 2
    err = _unwrapped(capsys.readouterr().err)
    assert "cut.jsonl.gz: unreadable as a (gzipped) JSONL trace" in err
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + (GOOD * 3).encode())
    assert main(["replay", str(marked), "--blocks", "4", "--policy", "lru"]) == 0
    assert "3 requests" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--limit", "--block-size", "--nodes"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_counts_below_one_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """`--limit 0` used to replay one request, `--nodes 0` to raise, `--block-size 0` to
    fall back to 512 quietly."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD * 3)
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(path), "--blocks", "4", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["replay", "--blocks", "4,abc"], "--blocks: 'abc' is not a whole number"),
        (["replay", "--blocks", "1e3"], "--blocks: '1e3'"),
        (["replay", "--capacity", "8gi", "--block-bytes", "64Mi"], "--capacity: cannot read '8gi'"),
        (["replay", "--capacity", "8Gi", "--block-bytes", "64mi"], "--block-bytes: cannot read"),
        (["plan", "--memory-budget", "3x", "--block-bytes", "1Mi"], "--memory-budget: cannot"),
    ],
)
def test_a_bad_number_is_named_by_its_flag_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """Of two quantity flags, the message says which one it could not read, and stays one
    line however narrow the terminal (it was wrapped at 80 columns even into a file)."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD * 3)
    assert main([argv[0], str(path), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--nodes", "2", "--agent", "ipc:///nowhere.sock"], "give one"),
        (["--nodes", "2", "--blocks", "100"], "--blocks: not used with --nodes"),
        (["--nodes", "2", "--policy", "arc"], "--policy: not used with --nodes"),
        (["--agent", "ipc:///nowhere.sock", "--policy", "arc"], "--policy: not used with --agent"),
        (["--agent", "ipc:///nowhere.sock", "--blocks", "4"], "--blocks: not used with --agent"),
        (["--blocks", "4", "--route", "random"], "--route: not used without --nodes"),
        (["--blocks", "4", "--chunk-bytes", "1Mi"], "--chunk-bytes: not used without"),
        (["--blocks", "4", "--block-bytes", "1Mi", "--bytes-per-token", "1Ki"], "give one"),
    ],
)
def test_flags_a_replay_would_ignore_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    """The replay over nodes sizes its own pools and a live agent has its own pool and
    policy: a flag they would ignore (the output was the same for --blocks 100 and 5000)
    is refused by name, before anything runs."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD * 3)
    assert main(["replay", str(path), *flags]) == 2
    assert said in capsys.readouterr().err


def test_an_exports_chunk_size_sizes_a_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier trace` writes `chunk_bytes` into its export; `plan` read it and `replay`
    asked for --block-bytes all the same."""
    path = tmp_path / "export.jsonl"
    first = '{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2], "chunk_bytes": 1048576}\n'
    path.write_text(first + GOOD * 3)
    assert main(["replay", str(path), "--capacity", "4Mi", "--policy", "lru", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["budgets"]
    assert row["blocks"] == 4
    plain = tmp_path / "t.jsonl"
    plain.write_text(GOOD * 3)
    assert main(["replay", str(plain), "--capacity", "4Mi"]) == 2
    assert "names no chunk_bytes" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path: Path) -> None:
    """`kvtier plan --json | head -1`: the reader closes the pipe before the report is
    written; the command stops with the shell's status for it, no traceback."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD * 300)
    argv = [sys.executable, "-m", "kvtier.cli.main", "plan", str(path), "--block-bytes", "1Mi"]
    read, write = os.pipe()
    os.close(read)  # nobody will read what it prints
    proc = subprocess.run(
        [*argv, "--json"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
    )
    os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"input_length": 1024, "hash_ids": [1, r % 3]} for r in range(40)]
    path = write_trace(tmp_path / "t.jsonl", records)
    assert main(["replay", str(path), "--blocks", "3", "--policy", "lru,arc"]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "arc gap closed" not in out  # no optimal, no gap


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"input_length": 1024, "hash_ids": [1, r % 5]} for r in range(60)]
    path = write_trace(tmp_path / "t.jsonl", records)
    out = tmp_path / "replay.png"
    argv = ["replay", str(path), "--blocks", "3,4", "--policy", "lru,optimal", "--json"]
    assert main([*argv, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out)["budgets"][1]["blocks"] == 4


def test_replay_against_a_live_agent(
    chats_through_agent: ChatsThroughAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    """64 slots under a multi-turn chat trace: real rows stored, loaded and checked."""
    agent, path, _, report = chats_through_agent("prefix", 2, 80)
    assert report["wrong_rows"] == 0
    assert report["policy"] == "prefix" and report["slots"] == 64
    assert report["hit_rate"] is not None and report["hit_rate"] > 0
    assert sum(report["hit_tokens_by_tier"].values()) == report["prefill_tokens_saved"]
    assert set(report["hit_tokens_by_tier"]) <= {"host"}

    argv = ["replay", str(path), "--agent", agent.config.endpoint, "--chunk-bytes", str(ROW)]
    assert main([*argv, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["namespace"] != report["namespace"]  # a fresh namespace: no stale hits
    assert again["hit_rate"] == pytest.approx(report["hit_rate"], abs=0.05)


@pytest.mark.parametrize("size", ["0", "-64Mi"])
def test_a_block_size_in_bytes_below_one_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD * 3)
    assert main(["replay", str(path), "--capacity", "8Gi", f"--block-bytes={size}"]) == 2
    assert "--block-bytes must be a positive size" in capsys.readouterr().err
    assert main(["plan", str(path), f"--block-bytes={size}"]) == 2
    assert "--block-bytes must be a positive size" in capsys.readouterr().err


def test_a_capacity_past_the_trace_replays_in_the_trace_s_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exabyte used to allocate per slot (MemoryError); a pool larger than the trace's
    distinct blocks never fills and gets every hit a pool of all of them gets."""
    records = [{"input_length": 1024, "hash_ids": [1, r % 5]} for r in range(60)]
    path = write_trace(tmp_path / "t.jsonl", records)
    code = main(["replay", str(path), "--blocks", "6,5000000000", "--policy", "lru", "--json"])
    assert code == 0
    small, huge = json.loads(capsys.readouterr().out)["budgets"]
    assert huge["blocks"] == 5_000_000_000 and huge["underfilled"] and huge["lru"] is None
    assert huge["prefill_tokens_saved"] == small["prefill_tokens_saved"]


def test_a_picture_that_cannot_be_written_and_no_policy_are_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD * 3)
    missing = tmp_path / "nowhere" / "x.png"
    for command in (
        ["replay", str(path), "--blocks", "4"],
        ["plan", str(path), "--block-bytes", "1Mi"],
    ):
        assert main([*command, "--plot", str(missing)]) == 2
        assert "does not exist" in _unwrapped(capsys.readouterr().err)
        assert main([*command, "--plot", str(tmp_path / "x.txt")]) == 2
        assert "name a file of one of" in _unwrapped(capsys.readouterr().err)
    for nothing in ("", ","):
        assert main(["replay", str(path), "--blocks", "4", "--policy", nothing]) == 2
        assert "unknown policy ''" in capsys.readouterr().err


def test_numbers_as_strings_read_and_huge_or_routed_records_are_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": "5", "input_length": "1024", "hash_ids": [1, 2]}\n' * 3)
    assert main(["replay", str(path), "--blocks", "4", "--policy", "lru"]) == 0
    assert "3 requests" in capsys.readouterr().out
    # an unreplayable record (no ids) is passed over whatever else it holds
    skipped = tmp_path / "s.jsonl"
    skipped.write_text(GOOD + '{"timestamp": "x", "input_length": 10, "hash_ids": []}\n')
    assert main(["replay", str(skipped), "--blocks", "4", "--policy", "lru"]) == 0
    capsys.readouterr()
    huge = tmp_path / "h.jsonl"
    huge.write_text(GOOD + '{"input_length": 1' + "0" * 400 + ', "hash_ids": [1]}\n')
    for command in (["--blocks", "4"], ["--nodes", "2"]):
        assert main(["replay", str(huge), *command]) == 2
        assert "h.jsonl:2: input_length" in _unwrapped(capsys.readouterr().err)
