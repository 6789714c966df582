"""The node agent: the process that owns a node's pool and its tiers (docs/architecture.md).

Nothing here runs inside vLLM, except `vllm.py`, the plug-in's old module path, which is why
importing this package must stay free of anything but the standard library.
"""
