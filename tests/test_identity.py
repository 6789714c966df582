"""Any pod identity works, and only with the tier's group: clients as root (vLLM images), as
the agent's 65532 and as an OpenShift-style random uid, each with and without the tier's
group, against a live agent whose directory is laid out as the CSI plugin makes it (the
agent's and the tier's group, setgid, group-only). A client without the group gets AgentUnavailable
with the reason, at once; the agent keeps serving everyone else. Clients are forked from the
test process and drop to their identity, so they need no interpreter of their own (the
test's virtual environment may sit where other uids cannot read). Needs root."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest

from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient, AgentUnavailable
from kvtier.local.agent import AgentProcess, scratch_config
from kvtier.shm.pool import PoolMap, staging_path

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to other uids and groups needs root (CI runs as root)"
)
GROUP = 1 << 30 | 12345  # a tier group, as the operator derives them
OTHER_GROUP = 1 << 30 | 54321
ROW = 64 << 10


@pytest.fixture
def tier_agent() -> Iterator[AgentConfig]:
    base = Path(tempfile.mkdtemp(prefix="kv-id-", dir="/dev/shm"))
    base.chmod(0o755)
    volume = base / "vol"
    for path, mode in ((volume, 0o2750), (volume / "pool", 0o2750), (volume / "run", 0o3770)):
        path.mkdir()
        os.chown(path, 0, GROUP)  # the agent here runs as root: the owner of pool/ and run/
        path.chmod(mode)
    config = scratch_config(volume, "identity", 16 * (ROW + 4096) + 4096, ROW)
    try:
        with AgentProcess(config):
            yield config
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _become(uid: int, groups: list[int]) -> None:
    """In a forked child: drop to `uid` with exactly `groups` (the first as primary)."""
    os.setgroups(groups)
    os.setgid(groups[0] if groups else uid)
    os.setuid(uid)


def _client(endpoint: str, uid: int, groups: list[int], tag: int, out: Connection) -> None:
    """In a forked child: become `uid` with `groups`, store and load, report what happened."""
    try:
        _become(uid, groups)
        os.umask(0o022)  # as in a vLLM container: the client must not rely on a kind umask
        rows = [np.full(ROW, tag + i, np.uint8) for i in range(4)]
        keys = [b"id-%d-%027d" % (tag, i) for i in range(4)]
        with AgentClient(endpoint, timeout=5) as client:
            client.store("identity", keys, rows)
            back = [np.zeros(ROW, np.uint8) for _ in rows]
            loaded = client.load_into("identity", keys, back)
        same = all(loaded) and all(np.array_equal(a, b) for a, b in zip(rows, back, strict=True))
        out.send(("intact" if same else "differs", ""))
    except AgentUnavailable as exc:
        out.send(("unavailable", str(exc)))
    except BaseException as exc:  # anything else is a failure of the contract
        out.send(("raised", f"{type(exc).__name__}: {exc}"))


def run_as(endpoint: str, uid: int, groups: list[int], tag: int) -> tuple[str, str]:
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_client, args=(endpoint, uid, groups, tag, send)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0, child.exitcode
    return tuple(receive.recv())  # type: ignore[return-value]


@pytest.mark.parametrize("uid", [0, 65532, 1000710000], ids=["root", "agent-uid", "random-uid"])
def test_any_uid_with_the_tiers_group_stores_and_loads(tier_agent: AgentConfig, uid: int) -> None:
    outcome, detail = run_as(tier_agent.endpoint, uid, [GROUP], tag=uid % 200)
    assert outcome == "intact", detail


@pytest.mark.parametrize("uid", [65532, 1000710000], ids=["agent-uid", "random-uid"])
def test_without_the_group_a_client_gets_a_clear_miss_and_the_agent_serves_on(
    tier_agent: AgentConfig, uid: int
) -> None:
    outcome, detail = run_as(tier_agent.endpoint, uid, [OTHER_GROUP], tag=1)
    assert outcome == "unavailable", detail
    assert "group" in detail  # says what the pod lacks
    assert run_as(tier_agent.endpoint, 1000710000, [GROUP], tag=2)[0] == "intact"


def test_files_the_agent_makes_belong_to_the_tiers_group_only(tier_agent: AgentConfig) -> None:
    assert run_as(tier_agent.endpoint, 1000710000, [GROUP], tag=3)[0] == "intact"
    socket = Path(tier_agent.endpoint.removeprefix("ipc://"))
    pool = tier_agent.pool_path
    staging = staging_path(pool)
    index = pool.with_name(pool.name + ".index")
    # the group writes the socket and the staging area; the pool and its index it only
    # reads (the agent alone writes them, so no pod can alter a sealed chunk)
    for path, group in ((socket, 0o060), (staging, 0o060), (pool, 0o040), (index, 0o040)):
        info = path.stat()
        assert info.st_gid == GROUP, path
        assert info.st_mode & 0o007 == 0, (path, oct(info.st_mode))  # nothing for others
        assert info.st_mode & 0o060 == group, (path, oct(info.st_mode))


def _scribble(staging: str, uid: int, groups: list[int], seconds: float) -> None:
    """In a forked child: a pod of the tier that means harm, writing other bytes into every
    staging slot, over and over, while other clients store (the area is its group's)."""
    _become(uid, groups)
    area = PoolMap.open(Path(staging), populate=False, writable=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for slot in range(area.geometry.slot_count):
            area.payload(slot).fill(0xEE)


def _store_and_check(
    endpoint: str, uid: int, groups: list[int], rounds: int, out: Connection
) -> None:
    """In a forked child: store rows round after round (new keys each) and load each round
    back; report how many came back whole, and how many with bytes that are not the row's."""
    _become(uid, groups)
    same = wrong = 0
    with AgentClient(endpoint, timeout=5) as client:
        for r in range(rounds):
            rows = [np.full(ROW, (r * 16 + i) % 200, np.uint8) for i in range(16)]
            keys = [b"scribbled-%03d-%018d" % (r, i) for i in range(16)]
            client.store("identity", keys, rows)
            back = [np.zeros(ROW, np.uint8) for _ in rows]
            for ok, a, b in zip(client.load_into("identity", keys, back), rows, back, strict=True):
                if ok:
                    same += int(np.array_equal(a, b))
                    wrong += int(not np.array_equal(a, b))
    out.send((same, wrong))


def test_bytes_a_tier_member_writes_into_other_clients_staging_slots_are_never_served(
    tier_agent: AgentConfig,
) -> None:
    """The staging area is the tier group's to write: a member (another uid, the group, no
    capabilities) scribbling over every slot while a client stores must not get its bytes
    sealed under the client's keys. Each chunk loaded back is the client's row; the ones
    scribbled on are dropped at commit (counted as corrupt) and come back as misses."""
    staging = str(staging_path(tier_agent.pool_path))
    fork = multiprocessing.get_context("fork")
    scribbler = fork.Process(target=_scribble, args=(staging, 1000710000, [GROUP], 20.0))
    receive, send = multiprocessing.Pipe(duplex=False)
    storer = fork.Process(
        target=_store_and_check, args=(tier_agent.endpoint, 65532, [GROUP], 40, send)
    )
    scribbler.start()
    try:
        time.sleep(0.5)  # scribbling before the first store
        storer.start()
        storer.join(60)
        assert storer.exitcode == 0, storer.exitcode
    finally:
        scribbler.terminate()
        scribbler.join(10)
    same, wrong = receive.recv()
    with AgentClient(tier_agent.endpoint, timeout=5) as client:
        corrupt = client.stats().host.corrupt
    assert wrong == 0, f"{wrong} chunks loaded with another pod's bytes ({same} whole)"
    assert corrupt > 0  # the scribbles landed, and were caught
