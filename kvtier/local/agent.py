"""Agents on this machine, for the demo, the benchmarks and the tests: a config whose pool and
socket live in a scratch directory, and the agent run as a child process (each needs a real
agent in its own process rather than one sharing their interpreter). Not part of the agent:
in a cluster the operator writes the config and the kubelet runs the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.api.config import AgentConfig, parse_config
from kvtier.client.connection import AgentClient, AgentUnavailable


class AgentProcess:
    def __init__(
        self,
        config: AgentConfig,
        log_path: Path | None = None,
        python: str | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """`python` runs the agent (default: this interpreter); the vLLM tests pass the
        kvtier environment's, as the agent runs in its own container in a cluster. `prefix`
        is a command the agent runs under, e.g. `ip netns exec NODE` for a node of its own."""
        self.config = config
        self.log_path = log_path or config.run_dir / "agent.log"
        self.python = python or sys.executable
        self.prefix = prefix or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> AgentProcess:
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.config.run_dir / "agent.yaml"
        config_path.write_text(self.config.to_yaml())
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, self.python, "-m", "kvtier.agent", "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{tail}")
            if self.config.socket_path.exists():
                try:
                    with AgentClient(self.config.endpoint, timeout=1.0) as client:
                        client.stats()
                    return
                except AgentUnavailable:
                    pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"agent not ready within {timeout}s; log: {self.log_path}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a node drain would: no cleanup runs."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()


def scratch_config(
    directory: Path,
    name: str,
    capacity: int | str,
    chunk_bytes: int | str,
    policy: str = "lru",
    **fields: Any,
) -> AgentConfig:
    """An agent whose pool and socket live under `directory`, without a metrics port unless
    `fields` says otherwise: what the demo, the benchmarks and the checks start."""
    return parse_config(
        {
            "name": name,
            "runDir": str(directory / "run"),
            "host": {
                "capacity": capacity,
                "chunkBytes": chunk_bytes,
                "policy": policy,
                "poolDir": str(directory / "pool"),
            },
            "metrics": {"enabled": False},
            **fields,
        }
    )


def scratch_peer_config(
    directory: Path,
    name: str,
    capacity: int | str,
    chunk_bytes: int | str,
    registry: Path,
    peer: dict[str, Any] | None = None,
    **fields: Any,
) -> AgentConfig:
    """A `scratch_config` agent with a peer tier on loopback that finds the other agents
    through a registry directory: a second "node" on one machine, for the demo and the
    benchmarks. `peer` overrides the peer tier's settings."""
    return scratch_config(
        directory / name,
        name,
        capacity,
        chunk_bytes,
        tiers=[
            {
                "name": "peers",
                "peer": {"bind": "tcp://127.0.0.1:*", "membershipSeconds": 0.5, **(peer or {})},
            }
        ],
        report={
            "target": "file",
            "directory": str(registry),
            "node": name,
            "intervalSeconds": 0.5,
            "minIntervalSeconds": 0.2,
        },
        **fields,
    )
