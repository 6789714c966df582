"""Prefill/decode disaggregation end to end on CPU: a prefill engine on one node and a
decode engine on another, each node a network namespace of its own with its agent (UCX on
TCP between them). The decode request names the prefill side's agent as `kvtier_source`,
as a P/D proxy does; the decode engine loads the prompts' KV through the peer tier (over
NIXL where installed) and its output equals what the prefill engine computed from scratch.
Runs under the vLLM environment (`make e2e`), as root (namespaces)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from e2e.engines import BLOCKS_PER_PROMPT, HITS, PROMPTS, REPO, kv_config, run_engines
from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from kvtier.local.engines.tiny_model import build
from tests import netns
from tests.conftest import AGENT_PYTHON

UCX = ["env", "UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"]


def nixl_installed() -> bool:
    """Whether the agents' environment has NIXL (this one, vLLM's, need not)."""
    probe = [AGENT_PYTHON or sys.executable, "-c", "import nixl_cu12._api"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def node(
    make_config: Callable[..., AgentConfig], scratch: Path, role: str, address: str, **peer: Any
) -> AgentConfig:
    """An agent whose peer tier listens on its namespace's address, sharing a registry and
    the tier's key pair with the other node."""
    return make_config(
        {
            "name": role,
            "runDir": str(scratch / f"run-{role}"),
            "tiers": [
                {
                    "name": "peers",
                    "peer": {
                        "bind": f"tcp://{address}:5557",
                        "curveKeyDir": str(scratch / "curve"),
                        "membershipSeconds": 1.0,
                        **peer,
                    },
                }
            ],
            "report": {
                "target": "file",
                "directory": str(scratch / "registry"),
                "node": role,
                "intervalSeconds": 0.5,
                "minIntervalSeconds": 0.2,
            },
        },
        poolDir=str(scratch / f"pool-{role}"),
        capacity="48Mi",
        chunkBytes="64Ki",
    )


def engine(namespace: str, run: dict[str, Any]) -> dict[str, Any]:
    """One engine, inside the node's namespace: its outputs and cache metrics."""
    (result,) = run_engines([run], namespace=namespace).results
    return {"outputs": result["passes"][0], "metrics": result["metrics"]}


@pytest.mark.skipif(netns.supported() is not None, reason=str(netns.supported()))
@pytest.mark.timeout(1800)  # two engine start-ups of ~30 s each, more on a loaded machine
def test_decode_engine_loads_the_prefill_engines_kv_through_the_peer_tier(
    make_config: Callable[..., AgentConfig], scratch: Path
) -> None:
    keys = scratch / "curve"
    keys.mkdir()
    public, secret = zmq.curve_keypair()
    (keys / "public.key").write_bytes(public)
    (keys / "secret.key").write_bytes(secret)
    data_path = "nixl" if nixl_installed() else "zmq"
    model = str(build(REPO / ".scratch" / "tiny-llama"))
    with netns.nodes(2, subnet="10.217.0") as machines, contextlib.ExitStack() as stack:
        configs = []
        for role, (namespace, address) in zip(("prefill", "decode"), machines, strict=True):
            config = node(
                make_config, scratch, role, address, dataPath=data_path, timeoutSeconds=2.0
            )
            prefix = netns.run_in(namespace, *UCX)
            stack.enter_context(AgentProcess(config, python=AGENT_PYTHON, prefix=prefix))
            configs.append(config)
        prefill, decode = configs
        (prefill_ns, prefill_ip), (decode_ns, _) = machines
        source = f"tcp://{prefill_ip}:5557"
        time.sleep(1.5)  # each agent has read the other's registration

        computed = engine(
            prefill_ns,
            {"model": model, "kv_transfer_config": kv_config(prefill), "prompts": PROMPTS},
        )
        with AgentClient(prefill.endpoint) as producer:
            assert producer.stats().host.chunks >= 2 * BLOCKS_PER_PROMPT
        loaded = engine(
            decode_ns,
            {
                "model": model,
                "kv_transfer_config": kv_config(decode),
                "prompts": PROMPTS,
                "kv_transfer_params": {"kvtier_source": source},
            },
        )
        with AgentClient(decode.endpoint) as consumer:
            counts = consumer.stats().tiers[0].peer

    assert loaded["outputs"] == computed["outputs"]  # equal to recompute
    assert loaded["metrics"][HITS] >= 2 * BLOCKS_PER_PROMPT * 32  # and it did not recompute
    assert counts is not None, "the decode node's first tier is its peer tier"
    moved = counts.nixl_reads + counts.zmq_reads
    assert moved >= 2 * BLOCKS_PER_PROMPT  # through the peer tier
    assert (counts.nixl_reads if data_path == "nixl" else counts.zmq_reads) >= BLOCKS_PER_PROMPT
    assert counts.refused_sources == 0
