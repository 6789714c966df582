"""Agents that share chunks through a peer tier, for the tests: a node's config, its peer
tier's stats, chunks stored on one node until another finds them."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.api.config import AgentConfig
from kvtier.api.stats import TierStats
from kvtier.client.connection import AgentClient
from tests.agent_helpers import store, wait_for
from tests.helpers import NS, key


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def node_config(
    make_config: Callable[..., AgentConfig],
    scratch: Path,
    node: str,
    keys: Path | None,
    registry: str = "registry",
    host: dict[str, Any] | None = None,
    **peer_settings: Any,
) -> AgentConfig:
    peer: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:*",
        "timeoutSeconds": 0.5,
        "membershipSeconds": 1.0,
        **peer_settings,
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
        **(host or {}),
    )


def peer_stats(client: AgentClient) -> TierStats:
    """The stats of an agent's first tier, which the peer tests make its peer tier."""
    return client.stats().tiers[0]


def shared_between(producer: str, consumer: AgentClient, ids: list[int]) -> None:
    """Store `ids` on the agent at `producer` until its peer tier announced them, then wait
    until the consumer's lookups find them all."""
    time.sleep(1.2)  # both agents have read the membership
    with AgentClient(producer) as client:
        store(client, ids)
        wait_for(lambda: peer_stats(client).counts.writebacks == len(ids))
    wait_for(lambda: consumer.lookup(NS, [key(i) for i in ids]).prefix == len(ids))
