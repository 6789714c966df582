"""Agents on "machines" of their own (network namespaces joined by veth pairs to a bridge,
each with its own address) move chunks over NIXL, with UCX pinned to its TCP transport: the
bytes cross the namespaces' network interfaces as they would between nodes, not shared
memory between processes of one kernel.

What makes it work (and what a cluster needs): UCX's TCP transport (`UCX_TLS` including
`tcp`; here only `tcp`), on the interface that carries the pod network
(`UCX_NET_DEVICES=eth0`; UCX otherwise also offers loopback, which the other side cannot
use), present with a carrier when the agent starts (UCX lists interfaces once), and the
TCP ports UCX listens on (ephemeral unless `UCX_TCP_PORT_RANGE` pins them) reachable
between the nodes, besides the peer port."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.agent.tiers.nixl_path import available
from kvtier.agent.tiers.peer.wire import write_keys
from kvtier.api.config import AgentConfig
from kvtier.bench.peers import UCX_BETWEEN_HOSTS
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests import netns
from tests.agent_helpers import load_exact, wait_for
from tests.peer_helpers import node_config, peer_stats, shared_between

PEER_PORT = 5557
UCX = UCX_BETWEEN_HOSTS  # UCX_TLS=tcp, UCX_NET_DEVICES=eth0, TCP segment and buffer sizes


def tcp_connections(namespace: str) -> list[tuple[str, str]]:
    """Established TCP connections in a namespace: (local, peer) address:port."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-Htn", "state", "established"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [(f[-2], f[-1]) for f in (line.split() for line in out.splitlines()) if len(f) >= 2]


@pytest.mark.skipif(netns.supported() is not None, reason=str(netns.supported()))
@pytest.mark.skipif(not available(), reason="NIXL is not installed")
def test_chunks_cross_namespaces_over_nixl_on_tcp(
    make_config: Callable[..., AgentConfig], scratch: Path
) -> None:
    keys = scratch / "curve"
    write_keys(keys)
    with netns.nodes(2, subnet="10.214.0") as machines, contextlib.ExitStack() as stack:
        configs, agents = [], []
        for i, (namespace, address) in enumerate(machines):
            config = node_config(
                make_config,
                scratch,
                f"node-{i}",
                keys,
                bind=f"tcp://{address}:{PEER_PORT}",
                dataPath="nixl",
                timeoutSeconds=2.0,
            )
            env = ["env", *(f"{k}={v}" for k, v in UCX.items())]
            agent = AgentProcess(config, prefix=["ip", "netns", "exec", namespace, *env])
            agents.append(stack.enter_context(agent))
            configs.append(config)
        wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
        for agent in agents:  # UCX in each agent is pinned to TCP
            environ = Path(f"/proc/{agent.pid}/environ").read_bytes().split(b"\0")
            assert b"UCX_TLS=tcp" in environ
        ids = list(range(12))
        with AgentClient(configs[1].endpoint) as consumer:
            shared_between(configs[0].endpoint, consumer, ids)
            assert load_exact(consumer, [0]) == [True]  # NIXL connects on first use
            assert load_exact(consumer, ids[1:]) == [True] * (len(ids) - 1)
            counts = peer_stats(consumer).peer
        assert counts is not None
        assert counts.nixl_failures == 0
        assert counts.nixl_reads >= len(ids) - 1
        # UCX's own TCP connection between the two addresses, beside the ZMQ peer port's
        (holder_ns, holder_ip), (_, asker_ip) = machines
        ucx = [
            (local, peer)
            for local, peer in tcp_connections(holder_ns)
            if local.startswith(f"{holder_ip}:")
            and peer.startswith(f"{asker_ip}:")
            and not local.endswith(f":{PEER_PORT}")
            and not peer.endswith(f":{PEER_PORT}")
        ]
        assert ucx, tcp_connections(holder_ns)
