"""The plug-in's 0.1 module path (`"module_path": "kvtier.agent.vllm"`), re-exporting the
plug-in from `kvtier.vllm.tier`, where it now lives. The injected transfer config still names
this path, which loads from a 0.1 payload and from this one alike
(`kvtier.api.transfer_config.PLUGIN_MODULE`). The plug-in's payload ships this file and
`kvtier/agent/__init__.py`, nothing else of the agent."""

from kvtier.vllm.tier import KVTierSecondaryTier

__all__ = ["KVTierSecondaryTier"]
