"""What the mutating webhook does to a vLLM pod, as a pure function of the pod and the
KVCacheTier that selects it: the JSON patch to apply, or the reason to leave it alone.

Injected: `--kv-transfer-config` (the plug-in's config), the tier's CSI volume (pool and
agent socket, at the same path as in the agent) with the tier's group added to the pod's
supplementalGroups, the kvtier plug-in code (an init container copies it from the kvtier
image into an emptyDir, added to PYTHONPATH), and PYTHONHASHSEED so block hashes match across
engines. Everything added meets Pod Security `restricted` (a CSI and an emptyDir volume; an
init container that is non-root, without privilege escalation or capabilities, under the
default seccomp profile), so injection never lowers a pod's level. Idempotent: an already
injected pod is left as it is. The pod is changed as a copy and the patch is the difference.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from kvtier.api.config import AgentConfig
from kvtier.api.names import GROUP, tier_group
from kvtier.api.transfer_config import build_kv_transfer_config, kv_transfer_config_arg
from kvtier.api.units import parse_bytes
from kvtier.operator.builders import TIER_VOLUME, agent_image, build_agent_config, tier_volume
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


def _patch(pod: Manifest, changed: Manifest) -> list[Manifest]:
    return list(jsonpatch.make_patch(pod, changed).patch)


def _annotated(pod: Manifest, values: dict[str, str]) -> Manifest:
    changed = copy.deepcopy(pod)
    changed["metadata"]["annotations"] = {**(pod["metadata"].get("annotations") or {}), **values}
    return changed


def _skip(pod: Manifest, tier: str, reason: str) -> Mutation:
    return Mutation(_patch(pod, _annotated(pod, {TIER: tier, SKIPPED: reason})), reason)


_SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash"}


def _why_not(container: Manifest) -> str | None:
    """Why the target container cannot be given the connector, or None when it can."""
    command, args = container.get("command", []), container.get("args", [])
    if any(str(a).startswith("--kv-transfer-config") for a in [*command, *args]):
        return "the container already sets --kv-transfer-config"
    if len(command) >= 2 and command[0] in _SHELLS and "-c" in command:
        return "the command is a shell string; pass vLLM's flags as args"
    return None


PLUGIN_INIT_RESOURCES = {
    "requests": {"cpu": "10m", "memory": "32Mi"},
    "limits": {"cpu": "500m", "memory": "64Mi"},
}


def _plugin_init(image: str, settings: OperatorSettings) -> Manifest:
    """The init container that copies the plug-in payload into the pod, as restricted
    Pod Security requires of every container."""
    return {
        "name": "kvtier-plugin",
        "image": image,
        "command": ["cp", "-r", f"{settings.plugin_dir}/.", PLUGIN_MOUNT],
        "volumeMounts": [{"name": "kvtier-plugin", "mountPath": PLUGIN_MOUNT}],
        # A namespace whose ResourceQuota counts CPU or memory refuses a container without
        # them (the quota's admission runs after this webhook): a copy of a few MiB.
        "resources": PLUGIN_INIT_RESOURCES,
        "securityContext": {
            "runAsUser": settings.agent_uid,
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _connector_arg(pod: Manifest, tier: Manifest, agent: AgentConfig) -> str:
    """The `--kv-transfer-config` value that makes the engine a client of the node's agent."""
    spec = tier["spec"]
    vllm = spec.get("vllm", {})
    config = build_kv_transfer_config(
        agent,
        cpu_bytes_to_use=parse_bytes(vllm.get("cpuBytes", "4Gi")),
        timeout_seconds=float(vllm.get("timeoutSeconds", 2.0)),
        scope=pod["metadata"].get("namespace") if spec.get("isolation") == "namespace" else None,
    )
    return kv_transfer_config_arg(config)


def mutate_pod(pod: Manifest, tier: Manifest, settings: OperatorSettings) -> Mutation:
    meta = tier["metadata"]
    if INJECTED in (pod["metadata"].get("annotations") or {}):
        return Mutation(reason="already injected")
    target = tier["spec"].get("targetContainer", "vllm")
    containers = pod["spec"].get("containers", [])
    index = next((i for i, c in enumerate(containers) if c.get("name") == target), None)
    if index is None:
        return _skip(pod, meta["name"], f"no container named {target!r}")
    if (reason := _why_not(containers[index])) is not None:
        return _skip(pod, meta["name"], reason)
    agent = build_agent_config(tier, settings)
    changed = _annotated(
        pod,
        {
            TIER: meta["name"],
            INJECTED: json.dumps({"agent": agent.endpoint, "container": target}, sort_keys=True),
        },
    )
    pod_spec = changed["spec"]
    container = pod_spec["containers"][index]
    container["args"] = [
        *container.get("args", []),
        "--kv-transfer-config",
        _connector_arg(pod, tier, agent),
    ]
    pod_spec["volumes"] = [
        *pod_spec.get("volumes", []),
        tier_volume(tier),
        {"name": "kvtier-plugin", "emptyDir": {}},
    ]
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": TIER_VOLUME, "mountPath": settings.tier_mount},
        {"name": "kvtier-plugin", "mountPath": PLUGIN_MOUNT, "readOnly": True},
    ]
    container["env"] = _with_env(container.get("env", []))
    security = pod_spec.setdefault("securityContext", {})
    group = tier_group(meta["namespace"], meta["name"])
    security["supplementalGroups"] = [*security.get("supplementalGroups", []), group]
    init = _plugin_init(agent_image(tier, settings), settings)
    pod_spec["initContainers"] = [*pod_spec.get("initContainers", []), init]
    return Mutation(_patch(pod, changed))


def _with_env(env: list[Manifest]) -> list[Manifest]:
    """The plug-in on PYTHONPATH (in front of what the pod had) and a fixed PYTHONHASHSEED
    unless the pod chose one."""
    names = {e["name"] for e in env}
    result = [
        {**e, "value": f"{PLUGIN_MOUNT}:{e['value']}" if e.get("value") else PLUGIN_MOUNT}
        if e["name"] == "PYTHONPATH"
        else e
        for e in env
    ]
    if "PYTHONPATH" not in names:
        result.append({"name": "PYTHONPATH", "value": PLUGIN_MOUNT})
    if "PYTHONHASHSEED" not in names:
        result.append({"name": "PYTHONHASHSEED", "value": HASH_SEED})
    return result
