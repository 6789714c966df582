"""The run fingerprint, with vLLM's own resolved model config: engines that would compute
other KV for the same tokens never share chunks, even under the same model path.
(Which component differs is named by the namespaces: tests/test_fingerprint.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from kvtier.api.config import AgentConfig
from kvtier.bench.vllm_scheduler import Engine
from kvtier.local.agent import AgentProcess
from kvtier.local.engines.tiny_model import build
from tests.vllm.conftest import vllm_config_of

MISS = LookupResult.MISS
MakeEngine = Callable[..., Engine]
StartAgent = Callable[[AgentConfig], AgentProcess]
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}


def test_weights_replaced_at_the_same_path_get_no_hits(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine, scratch: Path
) -> None:
    agent_factory(agent_config)
    path = build(scratch / "model", seed=0)
    before = engines(agent_config, config=vllm_config_of(path))
    before.store([1, 2, 3])
    build(path, seed=1, overwrite=True)  # same names, shapes and sizes; other values
    after = engines(agent_config, config=vllm_config_of(path))
    assert after.lookup([1, 2, 3])[0] == [MISS] * 3
    assert after.tier.namespace != before.tier.namespace


def test_config_override_gets_no_hits(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine, vllm_config: Any
) -> None:
    agent_factory(agent_config)
    plain = engines(agent_config)
    plain.store([1, 2])
    model = Path(vllm_config.model_config.model)
    overridden = engines(agent_config, config=vllm_config_of(model, hf_overrides=ROPE))
    assert overridden.lookup([1, 2])[0] == [MISS, MISS]
    assert overridden.tier.namespace != plain.tier.namespace


def test_engine_without_vllms_config_shares_nothing(
    agent_config: AgentConfig, agent_factory: StartAgent
) -> None:
    """An engine built without a VllmConfig in reach cannot prove what it runs."""
    from kvtier.bench.vllm_scheduler import kvtier_extra_config

    agent_factory(agent_config)
    first = Engine(kvtier_extra_config(agent_config, 16))
    second = Engine(kvtier_extra_config(agent_config, 16))
    try:
        first.store([1])
        assert second.lookup([1])[0] == [MISS]
    finally:
        first.close()
        second.close()
