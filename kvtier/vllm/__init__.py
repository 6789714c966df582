"""The vLLM plug-in: kvtier as a secondary tier of vLLM's tiered KV offloading, running inside
the engine's scheduler and worker processes (`tier.py` is what a transfer config names).

Part of the plug-in's payload: imports only the other payload packages and what vLLM has."""
