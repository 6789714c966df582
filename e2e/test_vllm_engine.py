"""Real vLLM engines (CPU build, tiny random models) using kvtier through the injected
config, with the canonical layout the webhook injects.

An engine computes and stores; a fresh engine reloads the prompts' KV from the agent and
produces identical output, and an engine whose worker zeroes what it loads produces other
output, which proves the reload is what the engine computes with. Engines that differ in
what determines the KV (weights replaced at the same path, a config override, the block
size) get no hits. Runs under the vLLM environment (`make e2e`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.engines import BLOCKS_PER_PROMPT, HITS, PROMPTS, REPO, kv_config, run_engines
from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from kvtier.local.engines.tiny_model import build


@pytest.fixture
def agent(
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
) -> AgentConfig:
    config = make_config(capacity="48Mi", chunkBytes="64Ki")
    agent_factory(config)
    return config


@pytest.mark.timeout(1200)  # engine start-ups of ~30 s each, more on a loaded machine
def test_engines_reload_kv_from_the_agent(agent: AgentConfig) -> None:
    kv = kv_config(agent)
    assert kv["kv_connector_extra_config"]["canonical_layout"] is True
    model = str(build(REPO / ".scratch" / "tiny-llama"))
    run = {"model": model, "kv_transfer_config": kv, "prompts": PROMPTS}
    zeroing = {**run, "kv_transfer_config": kv_config(agent, kvtier_test_zero_loads=True)}
    engines = run_engines([{**run, "passes": 2}, run, zeroing])
    first, fresh, zeroed = engines.results

    assert first["passes"][0] == first["passes"][1]  # prefix cache reset, same output
    with AgentClient(agent.endpoint) as client:
        stats = client.stats()
    assert stats.host.chunks >= 2 * BLOCKS_PER_PROMPT
    assert len(stats.host.namespaces) == 1
    (namespace,) = stats.host.namespaces
    assert f"kvtier namespace {namespace}" in engines.log  # the plug-in's line, in vLLM's log

    assert fresh["metrics"][HITS] >= 2 * BLOCKS_PER_PROMPT * 32
    assert fresh["passes"][0] == first["passes"][0]
    assert zeroed["metrics"][HITS] >= 2 * BLOCKS_PER_PROMPT * 32
    assert zeroed["passes"][0] != first["passes"][0]


@pytest.mark.timeout(1200)
def test_bytes_altered_in_the_pool_after_sealing_are_never_loaded(agent: AgentConfig) -> None:
    """A pod of the tier tries to flip 4 KiB in half of a model's sealed chunks and scribbles
    over the staging area: the pool is the agent's to write and its group's to read, so it
    alters nothing, and a fresh engine reloads every chunk, output unchanged."""
    model = str(build(REPO / ".scratch" / "tiny-llama"))
    run = {"model": model, "kv_transfer_config": kv_config(agent), "prompts": PROMPTS}
    (first,) = run_engines([run]).results
    with AgentClient(agent.endpoint) as client:
        (namespace,) = client.stats().host.namespaces
    agent_python = os.environ.get("KVTIER_AGENT_PYTHON", sys.executable)
    hostile = [agent_python, "-m", "tests.pool_access", str(agent.pool_path), namespace]
    altered = int(
        subprocess.run(hostile, capture_output=True, text=True, check=True, cwd=REPO).stdout
    )
    assert altered == 0
    (fresh,) = run_engines([run]).results
    assert fresh["passes"][0] == first["passes"][0]
    with AgentClient(agent.endpoint) as client:
        assert client.stats().host.corrupt == 0
    assert fresh["metrics"][HITS] >= 2 * BLOCKS_PER_PROMPT * 32  # every chunk reloaded


@pytest.mark.timeout(1200)
def test_other_weights_or_config_at_the_same_path_get_no_hits(
    agent: AgentConfig, scratch: Path
) -> None:
    """The model path stays; what it holds or how vLLM is told to read it changes."""
    path = build(scratch / "model", seed=0)
    run = {"model": str(path), "kv_transfer_config": kv_config(agent), "prompts": PROMPTS}
    (original,) = run_engines([run]).results
    build(path, seed=1, overwrite=True)  # other weights, same names, shapes and sizes
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
    replaced, overridden = run_engines([run, {**run, "hf_overrides": rope}]).results

    assert replaced["passes"][0] != original["passes"][0]  # really another model
    assert replaced["metrics"][HITS] == 0
    assert overridden["metrics"][HITS] == 0
    with AgentClient(agent.endpoint) as client:
        assert len(client.stats().host.namespaces) == 3


@pytest.mark.timeout(1200)
def test_block_size_change_never_loads_wrong_kv(agent: AgentConfig) -> None:
    """vLLM hashes a single-group model's blocks at its block size, so chunks written with
    32-token blocks have other keys than those an engine with 64-token blocks looks up,
    and the canonical page of a 64-token block is not two 32-token pages in every KV
    layout: the fingerprint keeps block geometry apart, and the engine recomputes."""
    model = str(build(REPO / ".scratch" / "tiny-llama"))
    run = {"model": model, "kv_transfer_config": kv_config(agent), "prompts": PROMPTS}
    two_blocks = {**run, "kv_transfer_config": kv_config(agent, blocks_per_chunk=2)}
    small, large, large_again, chunked, chunked_again = run_engines(
        [
            {**run, "block_size": 32},
            {**run, "block_size": 64},
            {**run, "block_size": 64},
            two_blocks,  # 32-token blocks, 64-token chunks
            two_blocks,
        ]
    ).results
    assert large["metrics"][HITS] == 0
    assert large_again["metrics"][HITS] >= 2 * (330 // 64) * 64  # 64-token blocks do share
    assert chunked["metrics"][HITS] == 0  # other chunk geometry than the first engine's
    assert chunked_again["metrics"][HITS] >= 2 * (330 // 64) * 64
    outputs = [e["passes"][0] for e in (small, large, large_again, chunked, chunked_again)]
    assert all(o == small["passes"][0] for o in outputs)
