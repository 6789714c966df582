"""Agents on different "nodes" sharing chunks through the peer tier: separate processes on
loopback, finding each other through a shared registry directory, authenticated with CURVE."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.agent.client import AgentClient
from kvtier.agent.config import AgentConfig
from kvtier.agent.process import AgentProcess
from kvtier.agent.tiers.peer import home_of, write_keys
from tests.conftest import ROW
from tests.helpers import NS, key, row
from tests.test_agent_tiers import load_exact, wait_for

StartAgent = Callable[[AgentConfig], AgentProcess]


def node_config(
    make_config: Callable[..., AgentConfig],
    scratch: Path,
    node: str,
    keys: Path | None,
    registry: str = "registry",
) -> AgentConfig:
    peer: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:*",
        "timeoutSeconds": 0.5,
        "membershipSeconds": 1.0,
    }
    if keys is not None:
        peer["curveKeyDir"] = str(keys)
    return make_config(
        {
            "name": node,
            "runDir": str(scratch / f"run-{node}"),
            "tiers": [{"name": "peers", "peer": peer}],
            "report": {
                "target": "file",
                "directory": str(scratch / registry),
                "node": node,
                "intervalSeconds": 0.5,
                "minIntervalSeconds": 0.2,
            },
            "tierBudgetSeconds": 1.5,
        },
        poolDir=str(scratch / f"pool-{node}"),
    )


def test_chunks_stored_on_one_node_are_loaded_on_another(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    keys = scratch / "curve"
    write_keys(keys)
    a = agent_factory(node_config(make_config, scratch, "node-a", keys))
    b_config = node_config(make_config, scratch, "node-b", keys)
    agent_factory(b_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    # A node without the cluster's key sees the others (their reports are linked into its
    # registry) but they do not see it.
    (scratch / "stranger").mkdir()
    for report in (scratch / "registry").glob("*.json"):
        (scratch / "stranger" / report.name).symlink_to(report)
    stranger_config = node_config(make_config, scratch, "node-c", None, registry="stranger")
    agent_factory(stranger_config)
    time.sleep(1.2)  # members are re-read every second

    with AgentClient(a.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(8)], [row(i, ROW) for i in range(8)])
        wait_for(lambda: producer.stats()["tiers"][0].get("writebacks") == 8)

    with AgentClient(b_config.endpoint) as consumer:
        found = wait_for(
            lambda: (r := consumer.lookup(NS, [key(i) for i in range(9)])).prefix == 8 and r
        )
        assert found.where == [1] * 8 + [-1]
        assert load_exact(consumer, list(range(8))) == [True] * 8
        assert consumer.lookup(NS, [key(0)]).where == [0]  # now in node-b's own pool

    # A peer without the cluster's key is refused: its requests are never answered.
    with AgentClient(stranger_config.endpoint) as stranger:
        started = time.monotonic()
        assert load_exact(stranger, [1, 2]) == [False, False]
        assert time.monotonic() - started < 5

    with AgentClient(a.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(20, 24)], [row(i, ROW) for i in range(20, 24)])
        wait_for(lambda: producer.stats()["tiers"][0].get("writebacks") == 12)
    a.kill()  # the only holder dies: its chunks become misses, in time, nothing hangs
    with AgentClient(b_config.endpoint) as consumer:
        started = time.monotonic()
        assert load_exact(consumer, [20, 21, 22, 23]) == [False] * 4
        assert load_exact(consumer, [3]) == [True]  # promoted earlier: in node-b's own pool
        assert time.monotonic() - started < 10


def test_rendezvous_homes_move_only_for_changed_members() -> None:
    members = [f"tcp://10.0.0.{i}:5557" for i in range(10)]
    keys = [b"k%d" % i for i in range(2000)]
    before = {k: home_of(k, members) for k in keys}
    after = {k: home_of(k, members[:-1]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == members[-1] for k in moved)
    assert 100 < len(moved) < 320  # about a tenth of the keys


def test_direct_mode_fetches_from_the_named_source(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """P/D: the decode side's request names the prefill side's agent; no directory (the two
    agents do not even share a registry) is needed."""
    prefill = agent_factory(node_config(make_config, scratch, "prefill", None, "reg-prefill"))
    decode_config = node_config(make_config, scratch, "decode", None, "reg-decode")
    agent_factory(decode_config)
    source = json.loads((scratch / "reg-prefill" / "prefill.json").read_text())["endpoint"]
    with AgentClient(prefill.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(4)], [row(i, ROW) for i in range(4)])
        wait_for(lambda: producer.stats()["tiers"][0].get("writebacks") == 4)
    with AgentClient(decode_config.endpoint) as consumer:
        keys = [key(i) for i in range(5)]
        assert consumer.lookup(NS, keys).where == [-1] * 5  # unknown without the source
        assert consumer.lookup(NS, keys, source=source).where == [1, 1, 1, 1, -1]
        outs = [np.zeros(ROW, np.uint8) for _ in range(4)]
        assert consumer.load_into(NS, keys[:4], outs, source=source) == [True] * 4
        assert all(np.array_equal(o, row(i, ROW)) for i, o in enumerate(outs))
