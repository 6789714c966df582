"""The peer directory stays true over time: holders re-announce what they hold before the
homes' entries expire and re-home their announcements when membership changes, so a chunk a
live agent holds stays findable through several TTLs and through agents joining, leaving and
restarting with a warm pool; and a dead agent's chunks stop being reported once it is stale.

Short settings make the test cover several TTLs in seconds: entries live `TTL` seconds,
holders re-announce every TTL / 3, agents go stale after `STALE` seconds without a heartbeat.
The bounds the test waits within are the ones the design promises, computed from those."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import load_exact, wait_for
from tests.conftest import ROW
from tests.helpers import NS, key, row
from tests.peer_helpers import node_config, peer_stats

StartAgent = Callable[[AgentConfig], AgentProcess]

TTL = 3.0  # announceTtlSeconds
REANNOUNCE = TTL / 3  # what the holders do
MEMBERSHIP = 0.5  # membershipSeconds: how old an agent's view of the members may be
STALE = 3.0  # staleFloorSeconds (report interval 0.5 s: three missed heartbeats are less)
MAINTAIN = 1.0  # the agent's upkeep period (withdrawals, re-announcements, expiry)
SLACK = 1.0  # process scheduling on a loaded test machine
# After a change is visible in the registry: every live holder's chunks are findable again.
FINDABLE_WITHIN = MEMBERSHIP + MAINTAIN + 2 * REANNOUNCE + SLACK
# After an agent dies: its chunks are no longer reported anywhere.
GONE_WITHIN = STALE + MEMBERSHIP + MAINTAIN + SLACK

SETTINGS = {
    "announceTtlSeconds": TTL,
    "membershipSeconds": MEMBERSHIP,
    "staleFloorSeconds": STALE,
    "timeoutSeconds": 0.5,
}


def where(client: AgentClient, ids: list[int]) -> list[int]:
    return list(client.lookup(NS, [key(i) for i in ids]).where)


def test_held_chunks_stay_findable_over_ttls_and_membership_changes(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    def config(name: str) -> AgentConfig:
        return node_config(make_config, scratch, name, None, **SETTINGS)

    a, b, c = (agent_factory(config(n)) for n in ("node-a", "node-b", "node-c"))
    registry = scratch / "registry"
    wait_for(lambda: len(list(registry.glob("*.json"))) == 3)
    time.sleep(2 * MEMBERSHIP)
    on_a, on_c = list(range(24)), list(range(100, 112))
    for holder, ids in ((a, on_a), (c, on_c)):
        with AgentClient(holder.config.endpoint) as producer:
            producer.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])
            wanted = len(ids)
            wait_for(lambda p=producer, n=wanted: peer_stats(p).counts.writebacks == n)

    with AgentClient(b.config.endpoint) as asker:
        wait_for(lambda: where(asker, on_a + on_c) == [1] * 36, FINDABLE_WITHIN)
        # Several TTLs: re-announced before expiry, so no lookup in between misses.
        checked_until = time.monotonic() + 3 * TTL
        while time.monotonic() < checked_until:
            assert where(asker, on_a + on_c) == [1] * 36
            time.sleep(0.2)
        with AgentClient(a.config.endpoint) as holder:
            assert peer_stats(holder).peer.reannounced >= 3 * len(on_a)

        # An agent joins: a share of the keys moves to it as their home.
        d = agent_factory(config("node-d"))
        wait_for(lambda: len(list(registry.glob("*.json"))) == 4)
        with AgentClient(d.config.endpoint) as joined:
            wait_for(
                lambda: where(asker, on_a + on_c) == where(joined, on_a + on_c) == [1] * 36,
                FINDABLE_WITHIN,
            )
            assert peer_stats(joined).peer.directory_keys > 0  # it is home to some of them

        # A holder (and the home of some keys) dies: its chunks stop being reported once it
        # is stale, and the keys it was home to are announced to their new homes.
        c.kill()
        died = time.monotonic()
        wait_for(lambda: where(asker, on_a) == [1] * 24, STALE + FINDABLE_WITHIN)
        time.sleep(max(0.0, died + GONE_WITHIN - time.monotonic()))
        for _ in range(5):
            assert where(asker, on_c) == [-1] * len(on_c)
            assert where(asker, on_a) == [1] * len(on_a)
            time.sleep(0.3)

        # A holder restarts (new endpoint, warm pool): what its pool kept is announced again.
        a.stop()
        a.start()
        wait_for(lambda: where(asker, on_a) == [1] * 24, FINDABLE_WITHIN)
        assert load_exact(asker, on_a[:8]) == [True] * 8
        assert peer_stats(asker).counts.read_errors == 0


def test_idle_peer_connections_are_closed(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """Connections to a peer unused for `idleSeconds` are closed (and reopened on use)."""
    settings = {**SETTINGS, "idleSeconds": 1.0, "dataPath": "zmq"}
    holder = agent_factory(node_config(make_config, scratch, "holder", None, **settings))
    asker_config = node_config(make_config, scratch, "asker", None, **settings)
    agent_factory(asker_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    with AgentClient(holder.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(4)], [row(i, ROW) for i in range(4)])
        wait_for(lambda: peer_stats(producer).counts.writebacks == 4)
    with AgentClient(asker_config.endpoint) as asker:
        wait_for(lambda: where(asker, list(range(4))) == [1] * 4, FINDABLE_WITHIN)
        assert load_exact(asker, [0, 1]) == [True, True]
        assert peer_stats(asker).peer.connections >= 1
        wait_for(lambda: peer_stats(asker).peer.idle_closed >= 1 and asker)
        assert load_exact(asker, [2, 3]) == [True, True]  # reopened on use
