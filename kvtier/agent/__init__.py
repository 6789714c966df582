"""The kvtier node agent: the node's host-memory hub for KV chunks.

Importing this package must stay cheap and free of heavy dependencies, because the vLLM
plug-in imports `kvtier.client.connection` from inside vLLM's own environment.
"""
