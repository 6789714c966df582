"""Fixtures for the tests that load kvtier into vLLM's own classes."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.agent.config import AgentConfig
from kvtier.bench.vllm_scheduler import ROW, Engine, kvtier_extra_config


@pytest.fixture(autouse=True)
def no_leftover_offload_regions() -> Iterator[None]:
    """vLLM leaves /dev/shm/vllm_offload_* behind when a process dies holding one."""
    before = set(glob.glob("/dev/shm/vllm_offload_*"))
    yield
    for path in set(glob.glob("/dev/shm/vllm_offload_*")) - before:
        os.unlink(path)


@pytest.fixture
def agent_config(make_config: Callable[..., AgentConfig]) -> AgentConfig:
    return make_config(chunkBytes=ROW)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(agent: AgentConfig, timeout_seconds: float = 2.0, **kw: Any) -> Engine:
        engine = Engine(kvtier_extra_config(agent, 16, timeout_seconds=timeout_seconds), **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
