"""Network namespaces as test "nodes" (kept with the benchmark that uses them too)."""

from kvtier.bench.netns import nodes, run_in, supported

__all__ = ["nodes", "run_in", "supported"]
