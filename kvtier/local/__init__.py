"""kvtier's parts as processes on one machine (an agent in a scratch directory) and waiting on
them: what the demo, the benchmarks and the tests share."""
