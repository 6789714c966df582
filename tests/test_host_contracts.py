"""The host tier's contracts under agent restarts, misuse and a pool that cannot hold its
size: each test is a reproduction of a way the contracts once broke."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient, AgentRefused, AgentUnavailable, LeaseLost
from kvtier.local.agent import AgentProcess
from kvtier.shm.table import digests
from tests.agent_helpers import wait_for
from tests.conftest import ROW
from tests.helpers import NS, key, loaned_chunk, row, wait_settled

StartAgent = Callable[[AgentConfig], AgentProcess]


def test_lease_from_before_a_restart_cannot_publish_another_clients_chunk(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config()
    first = agent_factory(config)
    a = AgentClient(config.endpoint, timeout=1.0).connect()
    grant_a = a.allocate(NS, [b"key-a"], ROW)
    np.copyto(a.staging_slot(grant_a.staging[0], ROW), row(1, ROW))
    first.kill()

    agent_factory(config)
    with AgentClient(config.endpoint) as b, AgentClient(config.endpoint) as reader:
        grant_b = b.allocate(NS, [b"key-b"], ROW)
        assert grant_b.lease
        with contextlib.suppress(AgentUnavailable):
            a.commit(grant_a.lease)  # A's socket reconnected to the new agent on its own
        out = np.zeros(ROW, np.uint8)
        loaded = reader.load_into(NS, [b"key-b"], [out])
        assert not loaded[0] or not np.array_equal(out, row(1, ROW)), "key B served A's bytes"
        np.copyto(b.staging_slot(grant_b.staging[0], ROW), row(2, ROW))
        b.commit(grant_b.lease)
        assert reader.load_into(NS, [b"key-b"], [out]) == [True]
        assert np.array_equal(out, row(2, ROW))
    a.close()


@pytest.fixture
def small_tmpfs(scratch: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs, as a pod's default /dev/shm is small (needs root to mount)."""
    mount = scratch / "small-shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)])
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_pool_larger_than_its_filesystem_is_refused_at_start(
    make_config: Callable[..., AgentConfig], small_tmpfs: Path
) -> None:
    config = make_config(capacity="64Mi", poolDir=str(small_tmpfs))
    agent = AgentProcess(config)
    with pytest.raises(RuntimeError, match=r"host\.capacity") as refused:
        agent.start(timeout=30)
    agent.stop()
    assert "free" in str(refused.value)
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.agent",
            "--check",
            "--config",
            str(config.run_dir / "agent.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    assert check.returncode != 0 and "host.capacity" in check.stdout + check.stderr


def _load_from_truncated_pool(endpoint: str, pool: str, results: Any) -> None:
    client = AgentClient(endpoint).connect()
    os.truncate(pool, 4096)  # the pool's pages are gone under the client's mapping
    out = np.zeros(ROW, np.uint8)
    try:
        results.put(("loaded", client.load_into(NS, [key(0)], [out])))
    except AgentUnavailable as exc:
        results.put(("unavailable", str(exc)))


def test_client_copy_from_a_truncated_pool_is_a_miss_not_a_signal(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(0)], [row(0, ROW)])
        wait_settled(client)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(
        target=_load_from_truncated_pool,
        args=(agent.config.endpoint, str(agent.config.pool_path), results),
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"client died with exit code {proc.exitcode}"
    outcome, value = results.get(timeout=5)
    assert outcome == "unavailable" or value == [False]


def _pool_state(client: AgentClient) -> dict[str, Any]:
    stats = client.stats()
    return {
        k: getattr(stats.host, k)
        for k in ("chunks", "leases", "pinned_slots", "free_slots", "evictions")
    }


def test_refused_allocate_and_commit_take_no_effect(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        n = client.stats().host.slots
        client.store(NS, [key(i) for i in range(n)], [row(i, ROW) for i in range(n)])
        wait_settled(client)
        before = _pool_state(client)
        with pytest.raises(AgentRefused):
            client.allocate("n" * 300, [key(1000), key(1001), key(1002)], ROW)
        assert _pool_state(client) == before
        long_key = b"k" * 2000
        with contextlib.suppress(AgentRefused):
            grant = client.allocate(NS, [long_key], ROW)
            client.commit(grant.lease)
        assert _pool_state(client) == before


def test_a_load_lease_cannot_be_committed(short_lease_client: AgentClient) -> None:
    client = short_lease_client
    grant = loaned_chunk(client, ROW)
    with pytest.raises(AgentRefused, match="load lease"):
        client.commit(grant.lease)
    client.end_load(grant.lease)
    time.sleep(0.6)  # past the lease timeout: nothing may stay pinned
    stats = client.stats()
    assert stats.host.pinned_slots == 0 and stats.host.leases == 0


class _SlowReader(AgentClient):
    """A reader that stalls before its copy until its lease has expired and the slot was
    given to another chunk, as a descheduled engine thread would."""

    writer: AgentClient
    stall_seconds: float

    def _live_index(self) -> Any:
        return None  # leased loads: the unleased path is checked on its own below

    def slot(self, slot: int, nbytes: int | None = None) -> Any:
        time.sleep(self.stall_seconds)
        n = self.writer.stats().host.slots
        self.writer.store(
            NS, [key(i) for i in range(100, 100 + n)], [row(i, ROW) for i in range(100, 100 + n)]
        )
        wait_settled(self.writer)
        return super().slot(slot, nbytes)


def test_reader_whose_lease_expired_gets_no_other_chunks_bytes(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config({"leaseTimeoutSeconds": 0.3})
    agent_factory(config)
    with AgentClient(config.endpoint) as writer, _SlowReader(config.endpoint) as reader:
        writer.store(NS, [key(0)], [row(0, ROW)])
        wait_settled(writer)
        reader.writer, reader.stall_seconds = writer, 0.6
        out = np.zeros(ROW, np.uint8)
        loaded = reader.load_into(NS, [key(0)], [out])
        assert loaded == [False] or np.array_equal(out, row(0, ROW)), "another chunk's bytes"


def test_unleased_load_of_a_slot_given_to_another_chunk_is_not_counted(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    """A load straight from the published index takes no lease: the chunk found may be
    evicted and its slot rewritten before the copy; the slot's stamp tells."""
    config = make_config()
    agent_factory(config)
    with AgentClient(config.endpoint) as writer, AgentClient(config.endpoint) as reader:
        writer.store(NS, [key(0)], [row(0, ROW)])
        assert reader.index is not None
        found = reader.index.find_one(int(digests(NS, [key(0)])[0]))
        assert found[0] >= 0
        n = writer.stats().host.slots
        others = range(1, n + 1)
        writer.store(NS, [key(i) for i in others], [row(i, ROW) for i in others])
        out = np.zeros(ROW, np.uint8)
        assert reader._load_unleased([out], [found]) == [False]
        assert reader.load_into(NS, [key(0)], [out]) == [False]  # evicted: a miss


def test_writer_whose_lease_expired_cannot_alter_the_next_chunk_of_its_slot(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config({"leaseTimeoutSeconds": 1.0})
    agent_factory(config)
    with AgentClient(config.endpoint) as slow, AgentClient(config.endpoint) as other:
        grant = slow.allocate(NS, [key(0)], ROW)
        time.sleep(1.3)  # the lease expires while the writer is descheduled (it rests 1 s)
        n = other.stats().host.slots
        other.store(NS, [key(i) for i in range(1, n + 1)], [row(i, ROW) for i in range(1, n + 1)])
        wait_settled(other)
        # the late copy lands in its staging slot (the pool is read-only to clients)
        np.copyto(slow.staging_slot(grant.staging[0], ROW), row(0, ROW))
        ids = list(range(1, n + 1))
        outs = [np.zeros(ROW, np.uint8) for _ in ids]
        loaded = other.load_into(NS, [key(i) for i in ids], outs)
        for i, ok, out in zip(ids, loaded, outs, strict=True):
            assert not ok or np.array_equal(out, row(i, ROW)), f"chunk {i} was altered"
        with pytest.raises(LeaseLost):
            slow.commit(grant.lease)


def _hold_after_restart(endpoint: str, restarted: Any, ready: Any) -> None:
    """Connect, then after the agent restarted (unnoticed) take a load lease and hang."""
    client = AgentClient(endpoint, timeout=2.0).connect()
    client.store(NS, [key(0)], [row(0, ROW)])
    ready.set()
    assert restarted.wait(60)
    for _ in range(20):
        with contextlib.suppress(AgentUnavailable):
            if client.begin_load(NS, [key(0)]).lease:
                break
    ready.set()
    time.sleep(600)


def test_client_that_missed_a_restart_is_registered_again(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config()
    first = agent_factory(config)
    ctx = mp.get_context("spawn")
    restarted, ready = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_after_restart, args=(config.endpoint, restarted, ready))
    holder.start()
    try:
        assert ready.wait(60)
        ready.clear()
        with AgentClient(config.endpoint) as client:
            wait_settled(client)
        first.kill()
        agent_factory(config)
        restarted.set()
        assert ready.wait(60)
        with AgentClient(config.endpoint) as client:
            assert client.stats().host.leases == 1
            holder.kill()
            holder.join()
            wait_for(lambda: client.stats().host.leases == 0, timeout=5)  # the timeout is 30 s
        lock_dir = config.run_dir / "clients"
        assert not [p.name for p in lock_dir.iterdir() if p.name.startswith(f"{holder.pid}-")]
    finally:
        holder.kill()


def _connect_and_wait(endpoint: str, ready: Any) -> None:
    AgentClient(endpoint).connect()
    ready.set()
    time.sleep(600)


def test_lock_of_a_client_that_died_while_the_agent_was_down_is_removed(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config()
    first = agent_factory(config)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    client = ctx.Process(target=_connect_and_wait, args=(config.endpoint, ready))
    client.start()
    assert ready.wait(60)
    lock_dir = config.run_dir / "clients"
    mine = [p for p in lock_dir.iterdir() if p.name.startswith(f"{client.pid}-")]
    assert len(mine) == 1
    first.kill()
    client.kill()
    client.join()
    agent_factory(config)
    wait_for(lambda: not mine[0].exists(), timeout=10)  # the dead client's lock file goes


def _connect_as_nobody(endpoint: str, results: Any) -> None:
    os.setgid(65534)
    os.setuid(65534)
    try:
        AgentClient(endpoint, timeout=0.5).connect()
    except AgentUnavailable:
        results.put("AgentUnavailable")
    except BaseException as exc:
        results.put(type(exc).__name__)


def test_connect_turns_os_errors_into_agent_unavailable(scratch: Path) -> None:
    run = scratch / "run"
    (run / "clients").mkdir(parents=True)
    os.chmod(run / "clients", 0o700)  # owned by root: no lock file for another uid
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_connect_as_nobody, args=(f"ipc://{run}/agent.sock", results))
    proc.start()
    proc.join(30)
    assert results.get(timeout=5) == "AgentUnavailable"


def test_load_into_a_buffer_larger_than_a_slot_is_refused(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(0)], [row(0, ROW)])
        client.store("another-namespace", [key(1)], [row(1, ROW)])
        wait_settled(client)
        big = np.zeros(2 * ROW, np.uint8)
        with pytest.raises(ValueError, match="slot"):
            client.load_into(NS, [key(0)], [big])
        assert client.stats().host.leases == 0
