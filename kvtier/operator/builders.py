"""Pure builders of the objects a KVCacheTier owns: they take the resource (as the API
returns it) and the operator settings and return manifests, so every rule is tested
without a cluster. The agent config is rendered and validated with the agent's own model."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

from kvtier.api.agent_memory import agent_memory
from kvtier.api.config import AgentConfig, ConfigError, parse_config
from kvtier.api.names import (
    API_VERSION,
    GROUP,
    agent_name,
    curve_secret_name,
    dns_name,
    instance_id,
    labels,
    tier_group,
)
from kvtier.api.pool_layout import DEFAULT_CHUNK_SIZE
from kvtier.api.units import parse_bytes
from kvtier.operator.settings import OperatorSettings

Manifest = dict[str, Any]
CONFIG_DIR = "/etc/kvtier"
TIER_MOUNT = "/var/lib/kvtier/tiers"
CSI_DRIVER = "csi.kvtier.io"
TIER_VOLUME = "kvtier"  # the CSI volume's name in agent and vLLM pods
S3_MOUNT = "/etc/kvtier/s3"
CURVE_MOUNT = "/etc/kvtier/curve"
DEFAULT_TRANSPORTS = ["nixl", "tcp", "zmq"]  # the CRD's default


def owner_reference(tier: Manifest) -> Manifest:
    meta = tier["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "KVCacheTier",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(tier: Manifest, name: str) -> Manifest:
    return {
        "name": name,
        "namespace": tier["metadata"]["namespace"],
        "labels": labels(tier["metadata"]["name"]),
        "ownerReferences": [owner_reference(tier)],
    }


def tier_volume(tier: Manifest) -> Manifest:
    """The tier's node-local directory (pool and agent socket) as a CSI ephemeral inline
    volume: the plugin sizes it and sets its group from the KVCacheTier itself."""
    return {
        "name": TIER_VOLUME,
        "csi": {"driver": CSI_DRIVER, "volumeAttributes": {"tier": tier["metadata"]["name"]}},
    }


def under(image: str, registry: str) -> bool:
    """Whether `image` is under `registry` (a registry, or a path in one) as a whole path:
    `registry.corp.example` holds `registry.corp.example/x`, not
    `registry.corp.example.attacker.io/x`."""
    return image.startswith(registry if registry.endswith("/") else registry + "/")


def agent_image(tier: Manifest, settings: OperatorSettings) -> str:
    """The image of the agent (and of the plug-in payload): only from allowed registries,
    since whoever may write a KVCacheTier would otherwise choose what runs on every node."""
    image = str(tier["spec"].get("agent", {}).get("image", settings.image))
    own = image == settings.image  # the operator's own, which the chart sets
    if not own and not any(under(image, p) for p in settings.allowed_registries):
        allowed = ", ".join(settings.allowed_registries) or "none"
        raise ConfigError(
            [
                f"spec.agent.image: {image!r} is not from an allowed registry ({allowed}); "
                "fix: use an image from one of them, or add its registry to the chart's "
                "allowedRegistries"
            ]
        )
    return image


def nfs_claim_name(tier: Manifest, entry: str) -> str:
    return dns_name(f"kvtier-{tier['metadata']['name']}-{entry}")


def nfs_volume_name(tier: Manifest, entry: str) -> str:
    """PersistentVolumes are cluster-wide: the name carries the namespace."""
    meta = tier["metadata"]
    return dns_name(f"kvtier-{instance_id(meta['namespace'], meta['name'])}-{entry}", 253)


def data_path(transports: list[str]) -> str:
    """The agent's `dataPath` for the tier's allowed peer transports. A list stored before
    `tcp` existed ([nixl, zmq], then the default) gets the stream too: it is the
    same agents' TCP connections, authenticated at less cost."""
    allowed = set(transports)
    if allowed == {"nixl"}:
        return "nixl"
    if "nixl" in allowed:
        return "auto"
    return "tcp" if "tcp" in allowed else "zmq"


def peer_data_port(peer: Manifest) -> int | None:
    """The stream's port (`dataPort`, 5560 unless set: the event stream's
    documented ports are 5558 and 5559); None when the tier's transports never use it."""
    if data_path(peer.get("transports", DEFAULT_TRANSPORTS)) == "zmq":
        return None
    return int(peer.get("dataPort", 5560))


def _filesystem_tier(entry: Manifest) -> Manifest:
    fs = entry["filesystem"]
    return {
        "path": f"{TIER_MOUNT}/{entry['name']}",
        "capacity": fs["capacity"],
        "highWatermark": fs.get("highWatermark", 0.9),
        "lowWatermark": fs.get("lowWatermark", 0.8),
        "fsync": fs.get("fsync", True),
    }


def _peer_tier(entry: Manifest) -> Manifest:
    peer = entry["peer"]
    stream = peer_data_port(peer)
    return {
        "bind": f"tcp://0.0.0.0:{peer.get('port', 5557)}",
        "dataPath": data_path(peer.get("transports", DEFAULT_TRANSPORTS)),
        **({"streamPort": stream} if stream is not None else {}),
        **({"encryptBytes": True} if peer.get("encryptBytes") else {}),
        "maxLentChunks": peer.get("maxLentChunks", 256),
        # always authenticated: the named Secret, or the one made for it
        "curveKeyDir": f"{CURVE_MOUNT}/{entry['name']}",
    }


def _object_store_tier(entry: Manifest) -> Manifest:
    s3 = entry["objectStore"]
    store = {key: s3[key] for key in ("endpoint", "bucket", "prefix", "region") if key in s3}
    store["capacity"] = s3["capacity"]
    if "credentialsSecret" in s3:
        store["credentialsDir"] = f"{S3_MOUNT}/{entry['name']}"
    return store


# The agent config of each kind of tier the CRD offers, under the same key as in the CRD.
_TIER_KINDS = {
    "filesystem": _filesystem_tier,
    "peer": _peer_tier,
    "objectStore": _object_store_tier,
}


def event_ports(spec: Manifest) -> tuple[int, int] | None:
    """The node event stream's PUB and replay ports (`spec.agent.events`), None when off."""
    events = spec.get("agent", {}).get("events")
    if events is None:
        return None
    port = int(events["port"])
    return port, int(events.get("replayPort", port + 1))


def _event_stream(spec: Manifest) -> Manifest:
    """The agent's `events`: off unless the tier names a port; authenticated with the first
    peer tier's key pair (the Secret the pod already mounts for it), open without one."""
    ports = event_ports(spec)
    if ports is None:
        return {}
    events = spec["agent"]["events"]
    taken = {"spec.agent.metricsPort": spec.get("agent", {}).get("metricsPort", 9400)}
    peers = [t for t in spec.get("tiers", []) if "peer" in t]
    for i, t in enumerate(spec.get("tiers", [])):
        if "peer" in t:
            taken[f"spec.tiers[{i}].peer.port"] = t["peer"].get("port", 5557)
            if (data_port := peer_data_port(t["peer"])) is not None:
                taken[f"spec.tiers[{i}].peer.dataPort"] = data_port
    for field, port in taken.items():
        if port in ports:
            raise ConfigError(
                [
                    f"spec.agent.events: port {port} is also {field}; fix: give the event "
                    "stream (port and replayPort, port + 1 when unset) ports of its own"
                ]
            )
    stream: Manifest = {
        "enabled": True,
        "bind": f"tcp://0.0.0.0:{ports[0]}",
        "replayBind": f"tcp://0.0.0.0:{ports[1]}",
    }
    if "topic" in events:
        stream["topic"] = events["topic"]
    if peers:
        stream["curveKeyDir"] = f"{CURVE_MOUNT}/{peers[0]['name']}"
    return stream


def _agent_tier(entry: Manifest) -> Manifest:
    config = {
        "name": entry["name"],
        "queueDepth": entry.get("queueDepth", 256),
        "admitAfterHits": entry.get("admitAfterHits", 0),
    }
    config.update({kind: build(entry) for kind, build in _TIER_KINDS.items() if kind in entry})
    return config


def build_agent_config(tier: Manifest, settings: OperatorSettings) -> AgentConfig:
    """The agent's config for this resource; raises ConfigError naming the field."""
    meta, spec = tier["metadata"], tier["spec"]
    host = spec["host"]
    tiers = [_agent_tier(entry) for entry in spec.get("tiers", [])]
    agent = spec.get("agent", {})
    return parse_config(
        {
            "name": instance_id(meta["namespace"], meta["name"]),
            "runDir": f"{settings.tier_mount}/run",
            "host": {
                "capacity": host["capacity"],
                "chunkBytes": host.get("chunkSize", DEFAULT_CHUNK_SIZE),
                "policy": host.get("policy", "lru"),
                "poolDir": f"{settings.tier_mount}/pool",
            },
            "tiers": tiers,
            "metrics": {"port": agent.get("metricsPort", 9400)},
            "accessLog": agent.get("accessLog", {}),
            "events": _event_stream(spec),
            # Each agent writes its own KVCacheNode, which the operator aggregates.
            "report": {
                "target": "kubernetes",
                "namespace": meta["namespace"],
                "tier": meta["name"],
            },
        }
    )


def build_configmap(tier: Manifest, config: AgentConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(tier, agent_name(tier["metadata"]["name"])),
        "data": {"agent.yaml": config.to_yaml()},
    }


def curve_secret(tier: Manifest, entry: Manifest) -> str:
    """The Secret a peer tier's agents authenticate with: the one the spec names, else the
    one the operator creates (`build_curve_secret`)."""
    named: str | None = entry["peer"].get("curveKeySecret", {}).get("name")
    return named or curve_secret_name(tier["metadata"]["name"], entry["name"])


def generated_curve_secrets(tier: Manifest) -> list[str]:
    """The Secret names of the peer tiers whose spec names no key Secret."""
    return [
        curve_secret(tier, entry)
        for entry in tier["spec"].get("tiers", [])
        if "peer" in entry and "curveKeySecret" not in entry["peer"]
    ]


def build_curve_secret(tier: Manifest, name: str, public: bytes, secret: bytes) -> Manifest:
    """A peer tier's CURVE key pair (Z85). Created once, when missing, never re-applied:
    the keys are random, and a rotation edits the Secret (docs/upgrading.md)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(tier, name),
        "data": {
            "public.key": base64.b64encode(public).decode(),
            "secret.key": base64.b64encode(secret).decode(),
        },
    }


def _secret_files(
    volume: str, secret: str, keys: list[str] | None, path: str
) -> tuple[Manifest, Manifest]:
    """A Secret's keys as read-only files: credentials are never in env or config. `keys`
    None: every key the Secret has (a CURVE Secret may list extra trusted keys).

    Kubelet writes Secret files as root with the volume's defaultMode; the pod's fsGroup
    (the tier's group, see `build_daemonset`) makes them group-owned, so 0440 lets the
    agent's non-root uid read them and nobody outside the group."""
    items = {} if keys is None else {"items": [{"key": k, "path": k} for k in keys]}
    return (
        {
            "name": volume,
            "secret": {"secretName": secret, "defaultMode": 0o440, **items},
        },
        {"name": volume, "mountPath": path, "readOnly": True},
    )


def _tier_volumes(tier: Manifest) -> tuple[list[Manifest], list[Manifest]]:
    """Filesystem tiers through claims only (Pod Security `restricted` allows no inline NFS
    or hostPath volume): the user's claim, or the one the operator makes for an NFS export."""
    volumes: list[Manifest] = []
    mounts: list[Manifest] = []
    for entry in tier["spec"].get("tiers", []):
        name = entry["name"]
        if "filesystem" in entry:
            fs = entry["filesystem"]
            claim = fs["pvc"]["claimName"] if "pvc" in fs else nfs_claim_name(tier, name)
            volumes.append({"name": f"tier-{name}", "persistentVolumeClaim": {"claimName": claim}})
            mounts.append({"name": f"tier-{name}", "mountPath": f"{TIER_MOUNT}/{name}"})
        # (volume, Secret, the keys mounted (None: all), where): a peer tier's key pair, the
        # one named or the one made for it, and an S3 tier's credentials
        secrets: list[tuple[str, str, list[str] | None, str]] = []
        if "peer" in entry:
            secrets.append((f"curve-{name}", curve_secret(tier, entry), None, CURVE_MOUNT))
        credentials = entry.get("objectStore", {}).get("credentialsSecret")
        if credentials is not None:
            keys = ["accessKeyId", "secretAccessKey"]
            secrets.append((f"s3-{name}", credentials["name"], keys, S3_MOUNT))
        for volume_name, secret, keys_mounted, root in secrets:
            volume, mount = _secret_files(volume_name, secret, keys_mounted, f"{root}/{name}")
            volumes.append(volume)
            mounts.append(mount)
    return volumes, mounts


def host_sizes(spec: Mapping[str, Any]) -> tuple[int, int, str]:
    """The pool's capacity and chunk size in bytes, and its eviction policy, as the agent
    gets them (the CRD's defaults where the spec is silent)."""
    host = spec["host"]
    chunk = parse_bytes(host.get("chunkSize", DEFAULT_CHUNK_SIZE))
    return parse_bytes(host["capacity"]), chunk, str(host.get("policy", "lru"))


def agent_resources(spec: Manifest) -> Manifest:
    """The pool lives on tmpfs and is charged to the agent's memory cgroup, so the agent
    requests (and is limited to) the pool, its page tables, a fixed overhead and what it
    keeps per slot under its policy (`api.agent_memory`), unless told otherwise.
    Its CPU request is small (an agent mostly waits on its socket) and unlimited, so it fits
    beside the engines on any node; docs/sizing.md says when to raise it."""
    given = spec.get("agent", {}).get("resources")
    if given:
        return dict(given)
    memory = str(agent_memory(*host_sizes(spec)))
    return {"requests": {"cpu": "100m", "memory": memory}, "limits": {"memory": memory}}


EVENT_PORT_NAMES = ("events", "events-replay")


def _peer_container_ports(spec: Manifest) -> list[Manifest]:
    ports = []
    for t in spec.get("tiers", []):
        if "peer" in t:
            ports.append({"name": "peer", "containerPort": t["peer"].get("port", 5557)})
            if (data_port := peer_data_port(t["peer"])) is not None:
                ports.append({"name": "peer-data", "containerPort": data_port})
    return ports


def _event_container_ports(spec: Manifest) -> list[Manifest]:
    ports = event_ports(spec)
    if ports is None:
        return []
    return [{"name": n, "containerPort": p} for n, p in zip(EVENT_PORT_NAMES, ports, strict=True)]


def _agent_container(
    tier: Manifest, config: AgentConfig, settings: OperatorSettings, mounts: list[Manifest]
) -> Manifest:
    spec = tier["spec"]
    return {
        "name": "agent",
        "image": agent_image(tier, settings),
        "args": ["agent", "--config", f"{CONFIG_DIR}/agent.yaml"],
        "ports": [
            {"name": "metrics", "containerPort": config.metrics.port},
            *_peer_container_ports(spec),
            *_event_container_ports(spec),
        ],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            # Peers dial this agent at its pod address.
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "resources": agent_resources(spec),
        # A crash-looping agent's last log lines (e.g. the S3 error it stopped on) in its
        # status, lastState.terminated.message, where the operator reads its reason.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "periodSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "periodSeconds": 20,
            "failureThreshold": 3,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": TIER_VOLUME, "mountPath": settings.tier_mount},
            *mounts,
        ],
    }


def build_daemonset(tier: Manifest, config: AgentConfig, settings: OperatorSettings) -> Manifest:
    name, spec = tier["metadata"]["name"], tier["spec"]
    tier_volumes, tier_mounts = _tier_volumes(tier)
    config_hash = hashlib.sha256(config.to_yaml().encode()).hexdigest()[:16]
    uid = settings.agent_uid
    group = tier_group(tier["metadata"]["namespace"], name)
    pod_spec: Manifest = {
        "serviceAccountName": agent_name(name),
        "nodeSelector": dict(spec.get("nodeSelector", {})),
        "tolerations": list(spec.get("tolerations", [])),
        # Pod Security `restricted`: non-root, default seccomp; the tier's group opens its
        # directory, which the CSI plugin made group-only, and (as fsGroup) the Secret
        # volumes, which kubelet otherwise leaves root's alone. The CSI driver's
        # fsGroupPolicy None keeps kubelet from re-owning the tier's directory.
        "securityContext": {
            "runAsUser": uid,
            "runAsGroup": uid,
            "runAsNonRoot": True,
            "supplementalGroups": [group],
            "fsGroup": group,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_agent_container(tier, config, settings, tier_mounts)],
        "volumes": [
            {"name": "config", "configMap": {"name": agent_name(name)}},
            tier_volume(tier),
            *tier_volumes,
        ],
    }
    if "priorityClassName" in spec.get("agent", {}):
        pod_spec["priorityClassName"] = spec["agent"]["priorityClassName"]
    selector = labels(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(tier, agent_name(name)),
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
            "template": {
                "metadata": {
                    "labels": selector,
                    "annotations": {f"{GROUP}/config-hash": config_hash},
                },
                "spec": pod_spec,
            },
        },
    }


def build_service(tier: Manifest, config: AgentConfig) -> Manifest:
    name = tier["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(tier, agent_name(name)),
        "spec": {
            "clusterIP": "None",
            "selector": labels(name),
            # Headless: a router resolves every agent's address and subscribes to each
            # node's stream (KVCacheNode status.events names the same addresses).
            "ports": [
                {"name": "metrics", "port": config.metrics.port, "targetPort": "metrics"},
                *[
                    {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]}
                    for p in _event_container_ports(tier["spec"])
                ],
            ],
        },
    }


def build_rbac(tier: Manifest) -> list[Manifest]:
    """Agents write their own KVCacheNode and read their peers', nothing else."""
    name = agent_name(tier["metadata"]["name"])
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(tier, name)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(tier, name),
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": ["kvcachenodes"],
                    "verbs": ["get", "list", "watch", "create", "update", "patch"],
                },
                {
                    "apiGroups": [GROUP],
                    "resources": ["kvcachenodes/status"],
                    "verbs": ["get", "update", "patch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(tier, name),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {"kind": "ServiceAccount", "name": name, "namespace": tier["metadata"]["namespace"]}
            ],
        },
    ]


def volume_labels(tier: Manifest) -> dict[str, str]:
    """The labels of the tier's cluster-wide PersistentVolumes, which select them for
    deletion with the tier."""
    meta = tier["metadata"]
    return {**labels(meta["name"]), f"{GROUP}/namespace": meta["namespace"]}


def build_nfs_volumes(tier: Manifest, settings: OperatorSettings) -> list[Manifest]:
    """For each NFS filesystem tier, a PersistentVolume of the export (only from the chart's
    allowedNfsServers: a spec never makes nodes mount an arbitrary address) pre-bound to a
    claim in the tier's namespace. The PV cannot be owned by the namespaced tier; it carries
    the tier's labels and is deleted with it."""
    namespace = tier["metadata"]["namespace"]
    objects: list[Manifest] = []
    for i, entry in enumerate(tier["spec"].get("tiers", [])):
        nfs = entry.get("filesystem", {}).get("nfs")
        if nfs is None:
            continue
        if nfs["server"] not in settings.allowed_nfs_servers:
            allowed = ", ".join(settings.allowed_nfs_servers) or "none"
            raise ConfigError(
                [
                    f"spec.tiers[{i}].filesystem.nfs.server: {nfs['server']!r} is not an "
                    f"allowed NFS server ({allowed}); fix: use a PersistentVolumeClaim "
                    "(filesystem.pvc), or add the server to the chart's allowedNfsServers"
                ]
            )
        claim, volume = nfs_claim_name(tier, entry["name"]), nfs_volume_name(tier, entry["name"])
        size = str(parse_bytes(entry["filesystem"]["capacity"]))
        common = {"accessModes": ["ReadWriteMany"], "storageClassName": ""}
        objects += [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume, "labels": volume_labels(tier)},
                "spec": {
                    **common,
                    "capacity": {"storage": size},
                    "nfs": {"server": nfs["server"], "path": nfs["path"]},
                    "persistentVolumeReclaimPolicy": "Retain",
                    "claimRef": {"namespace": namespace, "name": claim},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": _meta(tier, claim),
                "spec": {
                    **common,
                    "resources": {"requests": {"storage": size}},
                    "volumeName": volume,
                },
            },
        ]
    return objects


def build_children(tier: Manifest, settings: OperatorSettings) -> list[Manifest]:
    """Everything the tier owns, in the order to create them."""
    config = build_agent_config(tier, settings)
    return [
        build_configmap(tier, config),
        *build_rbac(tier),
        *build_nfs_volumes(tier, settings),
        build_service(tier, config),
        build_daemonset(tier, config, settings),
    ]
