"""The `--kv-transfer-config` that makes a vLLM engine use the node agent.

The operator's webhook injects exactly this JSON into selected pods; users without the
operator print it with `kvtier vllm-config`. vLLM keeps its own per-engine host buffer
(`cpu_bytes_to_use`) as the primary tier and calls the agent, through
`kvtier.vllm.tier.KVTierSecondaryTier`, for everything behind it.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.api.config import AgentConfig

# The module path the injected config names: the plug-in's 0.1 path, which this release's
# payload re-exports (kvtier/agent/vllm.py), so the config loads whichever payload a pod's
# init container copied, including that of a tier pinned to a 0.1 agent image. The plug-in
# lives in PLUGIN_HOME; configs name it once no supported image lacks it.
PLUGIN_MODULE = "kvtier.agent.vllm"
PLUGIN_HOME = "kvtier.vllm.tier"
PLUGIN_CLASS = "KVTierSecondaryTier"


def build_kv_transfer_config(
    agent: AgentConfig,
    *,
    cpu_bytes_to_use: int,
    eviction_policy: str = "lru",
    timeout_seconds: float = 2.0,
    copy_threads: int = 4,
    enable_kv_events: bool = True,
    canonical_layout: bool = True,
    spec: tuple[str, str] | None = None,
    scope: str | None = None,
) -> dict[str, Any]:
    """The connector config for an engine on `agent`'s node.

    `canonical_layout` makes a row independent of tensor parallelism, so engines with
    different TP sizes share chunks. `spec` (module, class) replaces vLLM's
    TieringOffloadingSpec with a subclass (the CPU test harness's). `scope` (a Kubernetes
    namespace, with isolation "namespace") keeps chunks within engines of that scope.
    """
    if cpu_bytes_to_use <= 0:
        raise ValueError("cpu_bytes_to_use must be positive: vLLM's own host tier needs room")
    extra: dict[str, Any] = {
        "spec_name": spec[1] if spec else "TieringOffloadingSpec",
        "canonical_layout": canonical_layout,
        "cpu_bytes_to_use": cpu_bytes_to_use,
        "eviction_policy": eviction_policy,
        "secondary_tiers": [
            {
                "type": PLUGIN_CLASS,
                "module_path": PLUGIN_MODULE,
                "agent": agent.endpoint,
                "timeout_seconds": timeout_seconds,
                "copy_threads": copy_threads,
                "enable_kv_events": enable_kv_events,
                **({"scope": scope} if scope else {}),
            }
        ],
    }
    if spec is not None:
        extra["spec_module_path"] = spec[0]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def kv_transfer_config_arg(config: dict[str, Any]) -> str:
    """The value of vLLM's `--kv-transfer-config` flag (compact JSON)."""
    return json.dumps(config, separators=(",", ":"), sort_keys=True)
