"""kvtier's parts as processes on one machine: an agent in a scratch directory, vLLM engines
on CPU (`engines/`), and waiting on them. What the demo, the benchmarks and the tests share."""
