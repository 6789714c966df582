"""kvtier's CSI node plugin, `csi.kvtier.io`: the one privileged kvtier component.

It gives each pod of a tier's namespace the tier's node-local directory (a size-limited tmpfs
holding the shared pool and the agent's socket) through a CSI ephemeral inline volume, so the
agent and vLLM pods need no hostPath and run under Pod Security `restricted`.
"""
