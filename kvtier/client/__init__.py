"""Talking to the node agent: the control protocol (protocol), the socket exchange and a
call's errors (transport), the client connection (connection), the reports of lookups
answered from the published index (reports) and knowing when a client is gone (liveness).
What the vLLM plug-in and kvtier's tools use.

Part of the plug-in's payload: imports only `kvtier.api` and `kvtier.shm` of kvtier."""
