"""Talking to the node agent: the control protocol, the client connection and knowing when a
client is gone. What the vLLM plug-in and kvtier's tools use.

Part of the plug-in's payload: imports only `kvtier.api` and `kvtier.shm` of kvtier."""
