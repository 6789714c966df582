"""The CSI Identity and Node services over gRPC on kubelet's unix socket.

Kubelet calls NodePublishVolume for each pod with a `csi.kvtier.io` ephemeral inline volume,
with the pod's namespace in the volume context (the CSIDriver sets podInfoOnMount). The
tier's size and group come from the KVCacheTier of that namespace, so a pod can only ever
mount tiers of its own namespace: the namespace is the trust boundary.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc

import kvtier
from kvtier.api.names import tier_dir, tier_group
from kvtier.api.pool_layout import DEFAULT_CHUNK_SIZE, pool_geometry
from kvtier.api.pool_layout import tier_volume_bytes as files_volume_bytes
from kvtier.api.units import parse_bytes
from kvtier.csi.messages import PACKAGE, SERVICES, message
from kvtier.csi.volumes import TierVolume, Volumes

DRIVER = "csi.kvtier.io"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
log = logging.getLogger("kvtier.csi")


class Tiers(Protocol):
    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The KVCacheTier, or None when there is none."""

    def names(self) -> set[tuple[str, str]]:
        """(namespace, name) of every KVCacheTier."""


class KubernetesTiers:
    """KVCacheTiers read through the API (the plugin's ClusterRole: get and list only)."""

    def __init__(self) -> None:
        from kvtier.kube import Client

        self._client = Client()

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kvtier.kube import ApiError, KVCacheTier, as_dict, not_found

        try:
            return as_dict(self._client.get(KVCacheTier, name, namespace=namespace))
        except ApiError as exc:
            if not_found(exc):
                return None
            raise

    def names(self) -> set[tuple[str, str]]:
        from kvtier.kube import KVCacheTier, as_dict

        found = set()
        for tier in self._client.list(KVCacheTier, namespace="*"):
            meta = as_dict(tier)["metadata"]
            found.add((str(meta["namespace"]), str(meta["name"])))
        return found


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def tier_volume(tiers: Tiers, context: dict[str, str]) -> TierVolume:
    """The volume a pod asks for, checked: its own namespace's tier, with the tier's size."""
    namespace, name = context.get(POD_NAMESPACE, ""), context.get("tier", "")
    if not DNS_LABEL.match(name):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"volumeAttributes.tier {name!r} must name a KVCacheTier (a DNS label)",
        )
    if not DNS_LABEL.match(namespace):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"no pod namespace in the volume context ({POD_NAMESPACE}): the CSIDriver object "
            "must set podInfoOnMount: true",
        )
    tier = tiers.get(namespace, name)
    if tier is None:
        raise Refused(
            grpc.StatusCode.NOT_FOUND,
            f"KVCacheTier {namespace}/{name} not found: a pod mounts only tiers of its own "
            "namespace",
        )
    host = tier["spec"]["host"]
    size = tier_volume_bytes(
        parse_bytes(host["capacity"]), parse_bytes(host.get("chunkSize", DEFAULT_CHUNK_SIZE))
    )
    return TierVolume(tier_dir(namespace, name), size, tier_group(namespace, name))


def tier_volume_bytes(capacity: int, chunk_bytes: int) -> int:
    """The size of a tier's volume, for a host tier of `capacity` with chunks of
    `chunk_bytes` (see pool_layout.tier_volume_bytes)."""
    return files_volume_bytes(pool_geometry(capacity, chunk_bytes))


class NodePlugin:
    def __init__(self, node_id: str, volumes: Volumes, tiers: Tiers) -> None:
        self.node_id = node_id
        self.volumes = volumes
        self.tiers = tiers

    # Identity
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return message("GetPluginInfoResponse")(name=DRIVER, vendor_version=kvtier.__version__)

    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return message("GetPluginCapabilitiesResponse")()  # a node plugin only

    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        return message("ProbeResponse")(ready={"value": True})

    # Node
    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_context = dict(request.volume_context)
        if not request.target_path:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "target_path is required")
        if not request.volume_capability.HasField("mount"):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "only filesystem (mount) volumes are served"
            )
        volume = tier_volume(self.tiers, volume_context)
        self.volumes.publish(volume, Path(request.target_path), request.readonly)
        log.info(
            "published %s to %s for %s",
            volume.name,
            request.target_path,
            volume_context.get("csi.storage.k8s.io/pod.name", "?"),
        )
        return message("NodePublishVolumeResponse")()

    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.target_path:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "target_path is required")
        self.volumes.unpublish(Path(request.target_path))
        return message("NodeUnpublishVolumeResponse")()

    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return message("NodeGetCapabilitiesResponse")()  # no staging, stats or expansion

    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return message("NodeGetInfoResponse")(node_id=self.node_id)

    def sweep(self) -> list[str]:
        """Frees the directories of deleted tiers once no pod mounts them, and brings the
        others to their tiers' sizes and this layout; returns the names of those freed."""
        names = self.tiers.names()
        freed = self.volumes.sweep({tier_dir(ns, name) for ns, name in names})
        mounted = [
            (ns, name)
            for ns, name in names
            if self.volumes.state_dir.joinpath(tier_dir(ns, name)).is_dir()
        ]
        live = []
        for ns, name in mounted:
            try:
                live.append(tier_volume(self.tiers, {POD_NAMESPACE: ns, "tier": name}))
            except Refused:
                continue  # deleted meanwhile: the next sweep frees it
        self.volumes.refresh_live(live)
        return freed


def _handler(method: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    """CSI's error contract: a refused request is its gRPC status and message; a failure of
    the node (a mount that fails) is INTERNAL with the reason; the server never dies of it."""

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(request, context)
        except Refused as exc:
            context.abort(exc.code, str(exc))
        except (ValueError, FileExistsError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            log.warning("%s failed: %s", method.__name__, exc)
            context.abort(grpc.StatusCode.INTERNAL, str(exc))

    return handle


def serve(plugin: NodePlugin, endpoint: str) -> grpc.Server:
    """Starts the Identity and Node services on `endpoint` (e.g. unix:///csi/csi.sock)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    for service, methods in SERVICES.items():
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _handler(getattr(plugin, name)),
                request_deserializer=message(request).FromString,
                response_serializer=message(response).SerializeToString,
            )
            for name, request, response in methods
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(f"{PACKAGE}.{service}", handlers),)
        )
    if endpoint.startswith("unix://"):
        Path(endpoint.removeprefix("unix://")).unlink(missing_ok=True)
    server.add_insecure_port(endpoint)
    server.start()
    return server


def run(plugin: NodePlugin, endpoint: str, sweep_seconds: float, stop: threading.Event) -> None:
    """Serves until `stop` is set, sweeping tier volumes at start (what an earlier version
    laid out is brought to this layout) and then every `sweep_seconds`."""
    server = serve(plugin, endpoint)
    log.info("%s serving on %s for node %s", DRIVER, endpoint, plugin.node_id)
    try:
        while True:
            try:
                plugin.sweep()
            except Exception as exc:  # the API server briefly unreachable: next time
                log.warning("sweeping tier volumes: %s", exc)
            if stop.wait(sweep_seconds):
                break
    finally:
        server.stop(grace=5).wait()
