"""One agent per pool: a second agent started on the same pool (an overlapping pod, a
restart race, the same config twice) waits for the first, then refuses to start and says
who holds it; the first keeps its socket, its clients and what they stored. The lock is the
kernel's (flock), so an agent killed with SIGKILL leaves it free for the next start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess, scratch_config
from kvtier.shm.files import hold_lock

ROW = 64 << 10
NS = "one"


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kv-one-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_lock_is_held_once_and_freed_when_its_holder_is_killed(scratch: Path) -> None:
    lock = scratch / "x.pool.lock"
    first = hold_lock(lock, 0.0)
    assert first is not None
    assert lock.stat().st_mode & 0o777 == 0o600
    assert lock.read_text().strip() == str(os.getpid())
    assert hold_lock(lock, 0.3) is None  # another open of it: refused, after the wait
    os.close(first)
    again = hold_lock(lock, 0.0)
    assert again is not None
    os.close(again)
    # held by a process killed with SIGKILL: free at once for the next one
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from kvtier.shm.files import hold_lock;"
            f" assert hold_lock(Path({str(lock)!r}), 0.0) is not None; print('held', flush=True);"
            " time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert hold_lock(lock, 0.0) is None
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    after = hold_lock(lock, 0.0)
    assert after is not None
    os.close(after)


def _second_agent(config: AgentConfig) -> subprocess.CompletedProcess[str]:
    path = config.run_dir / "second.yaml"
    path.write_text(config.to_yaml())
    return subprocess.run(
        [sys.executable, "-m", "kvtier.agent", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_agent_on_the_same_pool_refuses_and_the_first_keeps_serving(
    scratch: Path,
) -> None:
    config = scratch_config(scratch, "one", 32 * (ROW + 4096) + 4096, ROW)
    rows = [np.full(ROW, i, np.uint8) for i in range(8)]
    keys = [b"k%d" % i for i in range(8)]
    with AgentProcess(config) as first, AgentClient(config.endpoint) as early:
        assert early.store(NS, keys, rows).stored == 8
        started = time.monotonic()
        second = _second_agent(config)
        assert second.returncode == 2, second.stderr
        assert time.monotonic() - started >= 9  # it waited for the first to go, a while
        assert f"another agent (pid {first.proc.pid})" in second.stderr  # type: ignore[union-attr]
        assert "Traceback" not in second.stderr
        assert config.socket_path.exists()  # not taken over, not removed
        # the first agent's clients, old and new, still find and load what was stored
        outs = [np.zeros(ROW, np.uint8) for _ in keys]
        with AgentClient(config.endpoint) as late:
            assert late.load_into(NS, keys, outs) == [True] * 8
        assert all(np.array_equal(o, r) for o, r in zip(outs, rows, strict=True))
        assert early.lookup(NS, keys).hits == [True] * 8


def test_an_agent_killed_with_sigkill_is_replaced_at_once_and_warm(scratch: Path) -> None:
    config = scratch_config(scratch, "one", 32 * (ROW + 4096) + 4096, ROW)
    rows = [np.full(ROW, 7 + i, np.uint8) for i in range(4)]
    keys = [b"w%d" % i for i in range(4)]
    agent = AgentProcess(config).start()
    try:
        with AgentClient(config.endpoint) as client:
            assert client.store(NS, keys, rows).stored == 4
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
    finally:
        agent.stop()
    # were the lock to outlive its holder, this start would end in the refusal, exit 2
    with AgentProcess(config), AgentClient(config.endpoint) as client:
        outs = [np.zeros(ROW, np.uint8) for _ in keys]
        assert client.load_into(NS, keys, outs) == [True] * 4
        assert all(np.array_equal(o, r) for o, r in zip(outs, rows, strict=True))


def test_an_agent_of_another_pool_on_a_live_agent_s_run_dir_refuses(scratch: Path) -> None:
    """Two names, one runDir: the second would take the first's socket and its clients."""
    first = scratch_config(scratch, "one", 32 * (ROW + 4096) + 4096, ROW)
    other = scratch_config(scratch, "two", 32 * (ROW + 4096) + 4096, ROW)
    assert first.run_dir == other.run_dir and first.pool_path != other.pool_path
    with AgentProcess(first), AgentClient(first.endpoint) as client:
        second = _second_agent(other)
        assert second.returncode == 2, second.stderr
        assert f"another agent listens on {first.socket_path}" in second.stderr
        assert client.lookup(NS, [b"x"]).hits == [False]  # the first still answers
