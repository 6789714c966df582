"""A real vLLM engine (CPU build, tiny random Llama) using kvtier through the injected config.

Each engine is its own process, as pods are. The first engine computes and stores; a fresh
engine reloads the prompts' KV from the agent and produces identical output; after the
agent's copy is zeroed, a fresh engine's output changes, which proves the reload is what
the engine uses. Runs under the vLLM environment (`make e2e`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_engine.tiny_model import build
from kvtier.agent.client import AgentClient
from kvtier.agent.config import AgentConfig
from kvtier.agent.pool import PoolMap
from kvtier.agent.process import AgentProcess
from kvtier.agent.transfer_config import build_kv_transfer_config

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [" ".join(f"w{(i * 7 + j * 13) % 400}" for i in range(330)) for j in range(2)]
BLOCKS_PER_PROMPT = 330 // 32


@pytest.fixture(scope="module")
def model() -> Path:
    return build(REPO / ".scratch" / "tiny-llama")


def run_engine(model: Path, kv_config: dict[str, Any], passes: int = 1) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "e2e.vllm_engine.run_engine",
            "--model",
            str(model),
            "--kv-transfer-config",
            json.dumps(kv_config),
            "--prompts",
            json.dumps(PROMPTS),
            "--passes",
            str(passes),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return dict(json.loads(line.removeprefix("RESULT ")))


@pytest.mark.timeout(1200)  # three engine start-ups of ~30 s each, more on a loaded machine
def test_engines_reload_kv_from_the_agent(
    model: Path,
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
) -> None:
    config = make_config(capacity="32Mi", chunkBytes="64Ki")
    agent_factory(config)
    kv_config = build_kv_transfer_config(
        config,
        cpu_bytes_to_use=4 << 20,
        canonical_layout=False,
        spec=("e2e.vllm_engine.cpu_spec", "CPUTestTieringSpec"),
    )

    first = run_engine(model, kv_config, passes=2)
    assert first["passes"][0] == first["passes"][1]  # prefix cache reset, same output
    with AgentClient(config.endpoint) as client:
        stats = client.stats()
    assert stats["chunks"] >= 2 * BLOCKS_PER_PROMPT
    assert len(stats["namespaces"]) == 1

    fresh = run_engine(model, kv_config)
    assert fresh["passes"][0] == first["passes"][0]
    assert fresh["metrics"]["vllm:external_prefix_cache_hits"] >= 2 * BLOCKS_PER_PROMPT * 32

    pool = PoolMap.open(config.pool_path, populate=False)
    for slot in range(pool.geometry.slot_count):
        pool.payload(slot)[:] = 0
    pool.close()
    zeroed = run_engine(model, kv_config)
    assert zeroed["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert zeroed["passes"][0] != first["passes"][0]
