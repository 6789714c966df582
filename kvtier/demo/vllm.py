"""The demo's second act: two real vLLM engines sharing one node agent.

Engine A answers questions that share a long system prompt; engine B, a separate process
with its own (empty) host buffer, then answers other questions behind the same system
prompt and loads that prefix from the agent instead of computing it. Engines run under the
vLLM environment (CPU build, a tiny random model built locally) with the CPU copy worker of
`kvtier.local.engines`, which vLLM pods never get (the plug-in payload leaves it out).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.api.transfer_config import build_kv_transfer_config
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess, scratch_config

SYSTEM = " ".join(f"w{(i * 11) % 400}" for i in range(256))
QUESTIONS = {
    "A": [" ".join(f"w{(i * 3 + q) % 400}" for i in range(40)) for q in range(3)],
    "B": [" ".join(f"w{(i * 5 + q) % 400}" for i in range(40)) for q in range(3)],
}


@dataclass(frozen=True)
class EngineRun:
    name: str
    prompt_tokens: int
    external_hit_tokens: float
    outputs: list[list[int]]


def _engine(python: Path, model: Path, kv: dict[str, Any], name: str) -> EngineRun:
    prompts = [f"{SYSTEM} {q}" for q in QUESTIONS[name]]
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "kvtier.local.engines.run_engine",
            "--runs",
            json.dumps([{"model": str(model), "kv_transfer_config": kv, "prompts": prompts}]),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM engine {name} failed:\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line.removeprefix("RESULT "))
    return EngineRun(
        name=name,
        prompt_tokens=sum(len(p.split()) for p in prompts),
        external_hit_tokens=float(result["metrics"].get("vllm:external_prefix_cache_hits", 0)),
        outputs=result["passes"][0],
    )


def run_engines(vllm_python: Path, console: Console) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-demo-vllm-", dir="/dev/shm"))
    try:
        model_dir = scratch / "tiny-llama"
        subprocess.run(
            [str(vllm_python), "-m", "kvtier.local.engines.tiny_model", str(model_dir)],
            check=True,
            capture_output=True,
        )
        agent = scratch_config(scratch, "demo-vllm", "64Mi", "64Ki")
        kv = build_kv_transfer_config(
            agent,
            cpu_bytes_to_use=4 << 20,
            spec=("kvtier.local.engines.cpu_spec", "CPUTestTieringSpec"),
        )
        with AgentProcess(agent):
            runs = []
            for name in ("A", "B"):
                with console.status(f"engine {name}: starting vLLM and serving 3 prompts"):
                    runs.append(_engine(vllm_python, model_dir, kv, name))
            with AgentClient(agent.endpoint) as client:
                stats = client.stats()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "engines": [
            {
                "name": r.name,
                "prompt_tokens": r.prompt_tokens,
                "external_hit_tokens": r.external_hit_tokens,
            }
            for r in runs
        ],
        "agent_chunks": stats.host.chunks,
        "agent_namespaces": stats.host.namespaces,
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="two vLLM engines (CPU, tiny model) sharing one agent")
    for col in ("engine", "prompt tokens", "tokens loaded from kvtier"):
        table.add_column(col, justify="right")
    for e in result["engines"]:
        table.add_row(e["name"], f"{e['prompt_tokens']:,}", f"{e['external_hit_tokens']:,.0f}")
    console.print(table)
    console.print(
        f"agent: {result['agent_chunks']} chunks in "
        f"{len(result['agent_namespaces'])} namespace(s); engine B loaded the shared system "
        "prompt that engine A computed"
    )
