"""Benchmarks that report kvtier's speed as ratios against baselines measured in the same run."""
