"""Contracts every part of kvtier shares: the agent's config model, sizes, stats, the node status,
the run fingerprint, the transfer config, the pool's layout and the names of what a tier creates.

Part of the plug-in's payload, so it imports nothing of kvtier and nothing vLLM lacks."""
