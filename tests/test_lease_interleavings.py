"""Random interleavings of allocate, write, commit, abort, load and return across several
clients and SIGKILLed agent restarts, including commits of leases granted by an earlier agent
process and of other clients' leases: no key is ever served with bytes other than its own."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient, AgentUnavailable, Grant
from kvtier.local.agent import AgentProcess
from tests.conftest import ROW
from tests.helpers import NS, key, row

KEYS = 12
STEPS = 120
LEASE = 1.0


def _check_every_key(client: AgentClient) -> int:
    """Load every key; returns how many were served (each must be exactly its own bytes)."""
    outs = [np.zeros(ROW, np.uint8) for _ in range(KEYS)]
    loaded = client.load_into(NS, [key(i) for i in range(KEYS)], outs)
    for i, (ok, out) in enumerate(zip(loaded, outs, strict=True)):
        assert not ok or np.array_equal(out, row(i, ROW)), f"key {i} served other bytes"
    return sum(loaded)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_interleaving_publishes_a_key_with_another_keys_bytes(
    seed: int, make_config: Callable[..., AgentConfig]
) -> None:
    rng = random.Random(seed)
    config = make_config({"leaseTimeoutSeconds": LEASE}, capacity=8 * (ROW + 4096) + 4096)
    agent = AgentProcess(config).start()
    clients = [AgentClient(config.endpoint, timeout=1.0).connect() for _ in range(3)]
    stores: list[tuple[AgentClient, Grant]] = []
    loads: list[tuple[AgentClient, Grant]] = []
    served = 0
    try:
        with AgentClient(config.endpoint, timeout=5.0) as checker:
            for _ in range(STEPS):
                client = rng.choice(clients)
                step = rng.choice(
                    ["allocate", "allocate", "commit", "abort", "begin", "end", "steal", "restart"]
                )
                with contextlib.suppress(AgentUnavailable):
                    if step == "allocate":
                        ids = rng.sample(range(KEYS), rng.randint(1, 2))
                        grant = client.allocate(NS, [key(i) for i in ids], ROW)
                        for i, slot, staged in zip(ids, grant.slots, grant.staging, strict=True):
                            if slot >= 0:
                                np.copyto(client.staging_slot(staged, ROW), row(i, ROW))
                        if grant.lease:
                            stores.append((client, grant))
                    elif step == "commit" and stores:
                        holder, grant = stores.pop(rng.randrange(len(stores)))
                        holder.commit(grant.lease)
                    elif step == "abort" and stores:
                        holder, grant = stores.pop(rng.randrange(len(stores)))
                        holder.abort(grant.lease)
                    elif step == "begin":
                        grant = client.begin_load(NS, [key(rng.randrange(KEYS))])
                        if grant.lease:
                            loads.append((client, grant))
                    elif step == "end" and loads:
                        holder, grant = loads.pop(rng.randrange(len(loads)))
                        holder.end_load(grant.lease)
                    elif step == "steal" and stores:  # another client's lease
                        holder, grant = rng.choice(stores)
                        thief = next(c for c in clients if c is not holder)
                        with pytest.raises(AgentUnavailable):
                            thief.commit(grant.lease)
                    elif step == "restart":
                        agent.kill()
                        agent.start()
                served += _check_every_key(checker)
            # Leases left open expire, and staging slots an earlier agent had lent rest for
            # a lease before they are lent again: then stores go through once more.
            time.sleep(2 * LEASE + 1)
            checker.store(NS, [key(0)], [row(0, ROW)])
            out = np.zeros(ROW, np.uint8)
            assert checker.load_into(NS, [key(0)], [out]) == [True]
            assert np.array_equal(out, row(0, ROW))
            served += _check_every_key(checker)
    finally:
        for client in clients:
            client.close()
        agent.stop()
    assert served > 0
