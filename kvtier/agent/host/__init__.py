"""The host tier: the node's shared pool, its index, leases, eviction policies and the events
of what it holds. Runs in the agent; the host tier's lock and index are `tier.py`'s alone."""
