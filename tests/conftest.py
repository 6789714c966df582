"""Shared fixtures: a scratch directory on tmpfs (real shared memory, like a node's
/dev/shm), agent configs pointing into it, and real agent processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.agent.config import AgentConfig, parse_config
from kvtier.agent.process import AgentProcess

ROW = 64 * 1024


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config_data(scratch: Path, **host: Any) -> dict[str, Any]:
    return {
        "name": "test",
        "runDir": str(scratch / "run"),
        "host": {
            "capacity": 64 * (ROW + 4096) + 4096,
            "chunkBytes": ROW,
            "poolDir": str(scratch / "pool"),
            "policy": "lru",
            **host,
        },
        "metrics": {"port": 0, "host": "127.0.0.1"},
        "leaseTimeoutSeconds": 30,
        "reapIntervalSeconds": 0.1,
    }


@pytest.fixture
def make_config(scratch: Path) -> Callable[..., AgentConfig]:
    def make(top: dict[str, Any] | None = None, **host: Any) -> AgentConfig:
        return parse_config({**config_data(scratch, **host), **(top or {})})

    return make


@pytest.fixture
def agent_factory() -> Iterator[Callable[[AgentConfig], AgentProcess]]:
    started: list[AgentProcess] = []

    def start(config: AgentConfig) -> AgentProcess:
        proc = AgentProcess(config).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def agent(
    make_config: Callable[..., AgentConfig], agent_factory: Callable[[AgentConfig], AgentProcess]
) -> AgentProcess:
    return agent_factory(make_config())
