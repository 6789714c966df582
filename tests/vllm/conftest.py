"""Fixtures for the tests that load kvtier into vLLM's own classes."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.api.config import AgentConfig
from kvtier.bench.vllm_scheduler import ROW, Engine, kvtier_extra_config
from kvtier.local.engines.tiny_model import build

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_leftover_offload_regions() -> Iterator[None]:
    """vLLM leaves /dev/shm/vllm_offload_* behind when a process dies holding one."""
    before = set(glob.glob("/dev/shm/vllm_offload_*"))
    yield
    for path in set(glob.glob("/dev/shm/vllm_offload_*")) - before:
        os.unlink(path)


def vllm_config_of(model: Path, **model_options: Any) -> Any:
    """vLLM's resolved config of a local model, as an engine has it."""
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(model), **model_options))


def engine_of(vllm_config: Any, extra: dict[str, Any], **kw: Any) -> Engine:
    """An Engine whose tier finds `vllm_config` as it finds an engine's own: vLLM's
    current config while the connector (here, the manager) is built."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        return Engine(extra, model=str(vllm_config.model_config.model), **kw)


@pytest.fixture(scope="session")
def vllm_config() -> Any:
    return vllm_config_of(build(REPO / ".scratch" / "tiny-llama"))


@pytest.fixture
def agent_config(make_config: Callable[..., AgentConfig]) -> AgentConfig:
    return make_config(chunkBytes=ROW)


@pytest.fixture
def engines(vllm_config: Any) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(
        agent: AgentConfig, timeout_seconds: float = 2.0, config: Any = None, **kw: Any
    ) -> Engine:
        extra = kvtier_extra_config(agent, 16, timeout_seconds=timeout_seconds)
        engine = engine_of(config or vllm_config, extra, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
