"""Bytes altered in the pool after sealing are never served, because no pod of the tier can
alter them: the pool file is the agent's to write and its group's to read, clients map it
read-only, and stores go through a staging area that the agent copies into the pool and
seals at commit. A hostile member of the tier can neither open the pool for writing nor map
it writable, and garbage it writes into the staging area changes no sealed chunk."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from kvtier.shm.pool import staging_path
from tests.conftest import ROW
from tests.helpers import NS, key, row, wait_settled
from tests.pool_access import sealed_slots


def test_pool_is_read_only_to_its_group_and_staging_writable(agent: AgentProcess) -> None:
    pool = agent.config.pool_path
    assert stat.S_IMODE(pool.stat().st_mode) == 0o640
    assert stat.S_IMODE(staging_path(pool).stat().st_mode) == 0o660
    with AgentClient(agent.config.endpoint) as client:
        assert client.pool is not None and not client.pool.writable
        with pytest.raises(ValueError, match="read-only"):
            client.slot(0)[:] = 1


@pytest.mark.skipif(os.geteuid() != 0, reason="a tier member of another uid needs root")
def test_a_hostile_tier_member_cannot_alter_sealed_chunks(agent: AgentProcess) -> None:
    ids = list(range(8))
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])
        wait_settled(client)
        assert len(sealed_slots(agent.config.pool_path, NS)) == len(ids)
        # the tier's directories open to its group, as the CSI volume is to the tier's pods
        for path in agent.config.pool_path.parents[:2]:
            path.chmod(0o750)
        hostile = [sys.executable, "-m", "tests.pool_access", str(agent.config.pool_path), NS]
        done = subprocess.run(hostile, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "0"  # no slot altered, by any way it tried
        outs = [np.zeros(ROW, np.uint8) for _ in ids]
        assert client.load_into(NS, [key(i) for i in ids], outs) == [True] * len(ids)
        for i in ids:
            assert np.array_equal(outs[i], row(i, ROW)), i
        # stores after the staging area was scribbled on are sealed from what they staged
        client.store(NS, [key(100)], [row(100, ROW)])
        back = np.zeros(ROW, np.uint8)
        assert client.load_into(NS, [key(100)], [back]) == [True]
        assert np.array_equal(back, row(100, ROW))
        assert client.stats().host.corrupt == 0
