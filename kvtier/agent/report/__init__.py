"""What the agent tells the outside: its KVCacheNode report and the registry agents find each
other in, Prometheus metrics, and the KV event stream routers subscribe to."""
