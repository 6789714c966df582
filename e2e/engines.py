"""Real vLLM engine processes for the e2e scenarios: the runs of `kvtier.local.engines.run_engine`
(one engine after another in one process, under the vLLM environment), on this machine or
inside a node's network namespace, and the connector config they load kvtier with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.api.config import AgentConfig
from kvtier.api.transfer_config import build_kv_transfer_config
from kvtier.bench import netns

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [" ".join(f"w{(i * 7 + j * 13) % 400}" for i in range(330)) for j in range(2)]
BLOCKS_PER_PROMPT = 330 // 32
HITS = "vllm:external_prefix_cache_hits"
CPU_SPEC = ("kvtier.local.engines.cpu_spec", "CPUTestTieringSpec")


@dataclass(frozen=True)
class Engines:
    results: list[dict[str, Any]]
    log: str  # everything the engines wrote: vLLM's log lines, the plug-in's among them


def run_engines(
    runs: list[dict[str, Any]], timeout: float = 900, namespace: str | None = None
) -> Engines:
    """The runs, one engine after another in one process (see run_engine.py); inside the
    network namespace `namespace` when given (a node of its own)."""
    path = [p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(path)}
    command = [sys.executable, "-m", "kvtier.local.engines.run_engine", "--runs", json.dumps(runs)]
    proc = subprocess.run(
        netns.run_in(namespace, *command) if namespace else command,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [
        json.loads(ln.removeprefix("RESULT "))
        for ln in proc.stdout.splitlines()
        if ln.startswith("RESULT ")
    ]
    assert len(results) == len(runs)
    return Engines(results, proc.stdout + proc.stderr)


def kv_config(agent: AgentConfig, **extra: Any) -> dict[str, Any]:
    """What the webhook injects (canonical layout), with the CPU test worker."""
    config = build_kv_transfer_config(agent, cpu_bytes_to_use=4 << 20, spec=CPU_SPEC)
    config["kv_connector_extra_config"].update(extra)
    return config
