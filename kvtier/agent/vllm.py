"""The plug-in's module path until 0.1 (`"module_path": "kvtier.agent.vllm"`), kept for a
release: engines whose `--kv-transfer-config` still names it load the plug-in from
`kvtier.vllm.tier`, where it now lives. The plug-in's payload ships this file and
`kvtier/agent/__init__.py`, nothing else of the agent."""

from kvtier.vllm.tier import KVTierSecondaryTier

__all__ = ["KVTierSecondaryTier"]
