"""Offline work on traffic: traces generated or exported, replayed through the host tier's real
index and policies, routed over several nodes, planned for, and plotted. Runs on a laptop or
in CI, never in the cluster."""
