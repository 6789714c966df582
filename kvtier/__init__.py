"""kvtier: a node-shared, tiered, persistent KV cache for vLLM on Kubernetes."""

__version__ = "0.1.0"
