"""What the mutating webhook does to a vLLM pod, as a pure function of the pod and the
KVCacheTier that selects it: the JSON patch to apply, or the reason to leave it alone.

Injected: `--kv-transfer-config` (the plug-in's config), the agent's socket and pool
directories (hostPath, same paths as in the agent), the kvtier plug-in code (an init
container copies it from the kvtier image into an emptyDir, added to PYTHONPATH), and
PYTHONHASHSEED so block hashes match across engines. Never privileged mode, host IPC or
host network. Idempotent: an already injected pod is left as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvtier.agent.transfer_config import build_kv_transfer_config, kv_transfer_config_arg
from kvtier.agent.units import parse_bytes
from kvtier.operator.builders import build_agent_config
from kvtier.operator.names import GROUP
from kvtier.operator.settings import OperatorSettings

Manifest = dict[str, Any]
INJECTED = f"{GROUP}/injected"
SKIPPED = f"{GROUP}/skipped"
TIER = f"{GROUP}/tier"
PLUGIN_MOUNT = "/opt/kvtier-plugin"
HASH_SEED = "0"


@dataclass
class Mutation:
    patch: list[Manifest] = field(default_factory=list)
    reason: str = ""  # why nothing was injected, when patch only annotates

    @property
    def injected(self) -> bool:
        return any(op["path"].startswith("/spec") for op in self.patch)


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and present and labels[key] in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _annotate(pod: Manifest, values: dict[str, str]) -> list[Manifest]:
    if not pod["metadata"].get("annotations"):
        return [{"op": "add", "path": "/metadata/annotations", "value": values}]
    return [
        {"op": "add", "path": f"/metadata/annotations/{_escape(k)}", "value": v}
        for k, v in values.items()
    ]


def _skip(pod: Manifest, tier: str, reason: str) -> Mutation:
    return Mutation(_annotate(pod, {TIER: tier, SKIPPED: reason}), reason)


def mutate_pod(pod: Manifest, tier: Manifest, settings: OperatorSettings) -> Mutation:
    meta, spec = tier["metadata"], tier["spec"]
    annotations = pod["metadata"].get("annotations") or {}
    if INJECTED in annotations:
        return Mutation(reason="already injected")
    containers = pod["spec"].get("containers", [])
    target = spec.get("targetContainer", "vllm")
    index = next((i for i, c in enumerate(containers) if c.get("name") == target), None)
    if index is None:
        return _skip(pod, meta["name"], f"no container named {target!r}")
    container = containers[index]
    command, args = container.get("command", []), container.get("args", [])
    if any(str(a).startswith("--kv-transfer-config") for a in [*command, *args]):
        return _skip(pod, meta["name"], "the container already sets --kv-transfer-config")
    if (
        len(command) >= 2
        and command[0] in {"sh", "bash", "/bin/sh", "/bin/bash"}
        and ("-c" in command)
    ):
        return _skip(pod, meta["name"], "the command is a shell string; pass vLLM's flags as args")
    agent = build_agent_config(tier, settings)
    vllm = spec.get("vllm", {})
    config = build_kv_transfer_config(
        agent,
        cpu_bytes_to_use=parse_bytes(vllm.get("cpuBytes", "4Gi")),
        timeout_seconds=float(vllm.get("timeoutSeconds", 2.0)),
        scope=pod["metadata"].get("namespace") if spec.get("isolation") == "namespace" else None,
    )
    base = f"/spec/containers/{index}"
    patch: list[Manifest] = []
    flag = ["--kv-transfer-config", kv_transfer_config_arg(config)]
    if "args" in container:
        patch += [{"op": "add", "path": f"{base}/args/-", "value": v} for v in flag]
    else:
        patch.append({"op": "add", "path": f"{base}/args", "value": flag})
    volumes = [
        {"name": "kvtier-run", "hostPath": {"path": str(agent.run_dir), "type": "Directory"}},
        {
            "name": "kvtier-pool",
            "hostPath": {"path": str(agent.host.pool_dir), "type": "Directory"},
        },
        {"name": "kvtier-plugin", "emptyDir": {}},
    ]
    mounts = [
        {"name": "kvtier-run", "mountPath": str(agent.run_dir)},
        {"name": "kvtier-pool", "mountPath": str(agent.host.pool_dir)},
        {"name": "kvtier-plugin", "mountPath": PLUGIN_MOUNT, "readOnly": True},
    ]
    if "volumes" not in pod["spec"]:
        patch.append({"op": "add", "path": "/spec/volumes", "value": volumes})
    else:
        patch += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in volumes]
    if "volumeMounts" not in container:
        patch.append({"op": "add", "path": f"{base}/volumeMounts", "value": mounts})
    else:
        patch += [{"op": "add", "path": f"{base}/volumeMounts/-", "value": m} for m in mounts]
    patch += _env_patch(container, base)
    init = {
        "name": "kvtier-plugin",
        "image": spec.get("agent", {}).get("image", settings.image),
        "command": ["cp", "-r", f"{settings.plugin_dir}/.", PLUGIN_MOUNT],
        "volumeMounts": [{"name": "kvtier-plugin", "mountPath": PLUGIN_MOUNT}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if "initContainers" not in pod["spec"]:
        patch.append({"op": "add", "path": "/spec/initContainers", "value": [init]})
    else:
        patch.append({"op": "add", "path": "/spec/initContainers/-", "value": init})
    patch += _annotate(
        pod,
        {
            TIER: meta["name"],
            INJECTED: json.dumps({"agent": agent.endpoint, "container": target}, sort_keys=True),
        },
    )
    return Mutation(patch)


def _env_patch(container: Manifest, base: str) -> list[Manifest]:
    env = {e["name"]: i for i, e in enumerate(container.get("env", []))}
    wanted = []
    if "PYTHONPATH" in env:
        current = container["env"][env["PYTHONPATH"]].get("value", "")
        value = f"{PLUGIN_MOUNT}:{current}" if current else PLUGIN_MOUNT
        wanted.append(
            {"op": "replace", "path": f"{base}/env/{env['PYTHONPATH']}/value", "value": value}
        )
    additions = [{"name": "PYTHONPATH", "value": PLUGIN_MOUNT}] if "PYTHONPATH" not in env else []
    if "PYTHONHASHSEED" not in env:
        additions.append({"name": "PYTHONHASHSEED", "value": HASH_SEED})
    if "env" not in container:
        return [{"op": "add", "path": f"{base}/env", "value": additions}] if additions else []
    return wanted + [{"op": "add", "path": f"{base}/env/-", "value": e} for e in additions]
