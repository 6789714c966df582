"""What lives in shared memory on a node: the files, the pool and its slots, and the index
the agent publishes for clients to read in their own process.

Part of the plug-in's payload: imports only `kvtier.api` of kvtier."""
