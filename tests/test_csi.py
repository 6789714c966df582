"""The CSI node plugin driven over its gRPC socket as kubelet drives it: NodePublishVolume
with an ephemeral inline volume's context (the pod's namespace from podInfoOnMount), real
tmpfs and bind mounts into target directories, the tier's size and group read from the
KVCacheTier through the (emulated) API server. Mounting needs root (CI runs as root); a
non-root run skips these tests and says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvtier.api.names import tier_group
from kvtier.csi.messages import SERVICES, message
from kvtier.csi.mounts import mount_at
from kvtier.csi.server import NodePlugin, serve, tier_volume_bytes
from kvtier.csi.volumes import Volumes
from kvtier.kube import KVCacheTier, to_object
from tests.kube_api import KubeAPI

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting tmpfs and bind mounts needs root (CI runs as root)"
)
TIERS = {
    ("team-a", "llama"): "32Mi",
    ("team-b", "llama"): "16Mi",
    ("team-b", "qwen"): "8Mi",
    ("team-c", "big"): "256Mi",
}
CHUNK_SIZES = {("team-c", "big"): "64Ki"}  # the others use the default, 2Mi
AGENT = os.geteuid()  # the agents these tests start run as the test's own uid


@dataclass
class Node:
    """kubelet's side of the plugin socket, plus what the test needs to look at."""

    channel: grpc.Channel
    plugin: NodePlugin
    pods: Path
    api: KubeAPI

    def call(self, name: str, **fields: Any) -> Any:
        service = next(s for s, methods in SERVICES.items() if any(m[0] == name for m in methods))
        request, response = next((r, p) for m, r, p in SERVICES[service] if m == name)
        stub = self.channel.unary_unary(
            f"/csi.v1.{service}/{name}",
            request_serializer=message(request).SerializeToString,
            response_deserializer=message(response).FromString,
        )
        return stub(message(request)(**fields), timeout=10)

    def publish(self, pod: str, namespace: str, tier: str, **extra: Any) -> Path:
        target = self.pods / pod / "volumes/kubernetes.io~csi/kvtier/mount"
        self.call(
            "NodePublishVolume",
            volume_id=f"csi-{pod}",
            target_path=str(target),
            volume_capability={"mount": {}, "access_mode": {"mode": 1}},
            volume_context={
                "tier": tier,
                "csi.storage.k8s.io/pod.name": pod,
                "csi.storage.k8s.io/pod.namespace": namespace,
                "csi.storage.k8s.io/ephemeral": "true",
                **extra,
            },
        )
        return target

    def unpublish(self, target: Path) -> None:
        self.call("NodeUnpublishVolume", volume_id="x", target_path=str(target))


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """The node's directories live where any uid may traverse (as /var/lib/kubelet is), so
    what decides access in the identity tests is the tier's group alone."""
    from kvtier.csi.server import KubernetesTiers

    base = Path(tempfile.mkdtemp(prefix="kvtier-csi-"))
    base.chmod(0o755)
    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        for (namespace, name), capacity in TIERS.items():
            api.create(
                f"/apis/kvtier.io/v1alpha1/namespaces/{namespace}/kvcachetiers",
                {
                    "apiVersion": "kvtier.io/v1alpha1",
                    "kind": "KVCacheTier",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {
                        "host": {
                            "capacity": capacity,
                            "chunkSize": CHUNK_SIZES.get((namespace, name), "2Mi"),
                        }
                    },
                },
            )
        pods = base / "kubelet/pods"
        pods.mkdir(parents=True)
        volumes = Volumes(base / "state", pods, AGENT)
        plugin = NodePlugin("node-1", volumes, KubernetesTiers())
        socket = tmp_path / "csi.sock"
        server = serve(plugin, f"unix://{socket}")
        channel = grpc.insecure_channel(f"unix://{socket}")
        try:
            yield Node(channel, plugin, pods, api)
        finally:
            channel.close()
            server.stop(0).wait()
            for mount in sorted(_mounts_under(base), key=lambda p: len(str(p)), reverse=True):
                subprocess.run(["umount", "-l", str(mount)], check=False)
            shutil.rmtree(base, ignore_errors=True)


def _mounts_under(root: Path) -> list[Path]:
    from kvtier.csi.mounts import mounts

    return [m.point for m in mounts() if m.point.is_relative_to(root)]


def test_identity_as_kubelet_and_the_registrar_ask_it(node: Node) -> None:
    info = node.call("GetPluginInfo")
    assert info.name == "csi.kvtier.io" and info.vendor_version
    assert node.call("Probe").ready.value is True
    assert list(node.call("GetPluginCapabilities").capabilities) == []
    assert node.call("NodeGetInfo").node_id == "node-1"
    assert list(node.call("NodeGetCapabilities").capabilities) == []


def test_publish_gives_the_pod_its_tiers_tmpfs_sized_and_grouped_from_the_tier(
    node: Node,
) -> None:
    target = node.publish("pod-1", "team-a", "llama")
    mounted = mount_at(target)
    assert mounted is not None and mounted.fstype == "tmpfs"
    stat = os.statvfs(target)
    assert stat.f_blocks * stat.f_frsize == tier_volume_bytes(32 << 20, 2 << 20)
    gid = tier_group("team-a", "llama")
    layout = {
        target: (0, 0o2750),
        target / "pool": (AGENT, 0o2750),
        target / "run": (AGENT, 0o3770),
    }
    for path, (owner, mode) in layout.items():
        info = path.stat()
        assert info.st_gid == gid and info.st_uid == owner, path
        assert info.st_mode & 0o7777 == mode, (path, oct(info.st_mode))


def test_publish_is_idempotent_and_pods_of_a_tier_share_one_directory(node: Node) -> None:
    first = node.publish("pod-1", "team-a", "llama")
    again = node.publish("pod-1", "team-a", "llama")
    assert again == first
    assert len([m for m in _mounts_under(node.pods) if m == first]) == 1
    second = node.publish("pod-2", "team-a", "llama")
    (first / "pool/marker").write_bytes(b"shared")
    assert (second / "pool/marker").read_bytes() == b"shared"
    other_tier = node.publish("pod-3", "team-b", "llama")
    assert not (other_tier / "pool/marker").exists()


@pytest.mark.parametrize(
    ("namespace", "tier", "extra", "code", "words"),
    [
        ("team-c", "llama", {}, grpc.StatusCode.NOT_FOUND, "own namespace"),
        ("team-a", "qwen", {}, grpc.StatusCode.NOT_FOUND, "team-a/qwen not found"),
        ("team-a", "../etc", {}, grpc.StatusCode.INVALID_ARGUMENT, "volumeAttributes.tier"),
        ("", "llama", {}, grpc.StatusCode.INVALID_ARGUMENT, "podInfoOnMount"),
    ],
)
def test_a_pod_gets_only_its_own_namespaces_tiers(
    node: Node, namespace: str, tier: str, extra: dict[str, str], code: Any, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        node.publish("pod-x", namespace, tier, **extra)
    assert refused.value.code() == code and words in str(refused.value.details())
    assert _mounts_under(node.pods) == []


def test_size_and_group_come_from_the_tier_not_from_volume_attributes(node: Node) -> None:
    target = node.publish("pod-1", "team-b", "qwen", size="1Ti", gid="0", group="0")
    stat = os.statvfs(target)
    assert stat.f_blocks * stat.f_frsize == tier_volume_bytes(8 << 20, 2 << 20)
    assert target.stat().st_gid == tier_group("team-b", "qwen")


def test_targets_outside_kubelets_pods_directory_are_refused(node: Node, tmp_path: Path) -> None:
    outside = tmp_path / "etc"
    for call in (
        lambda: node.call(
            "NodePublishVolume",
            volume_id="v",
            target_path=str(outside),
            volume_capability={"mount": {}, "access_mode": {"mode": 1}},
            volume_context={"tier": "llama", "csi.storage.k8s.io/pod.namespace": "team-a"},
        ),
        lambda: node.call(
            "NodePublishVolume",
            volume_id="v",
            target_path=str(node.pods / "../../etc"),
            volume_capability={"mount": {}, "access_mode": {"mode": 1}},
            volume_context={"tier": "llama", "csi.storage.k8s.io/pod.namespace": "team-a"},
        ),
        lambda: node.call("NodeUnpublishVolume", volume_id="v", target_path="/"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not outside.exists()


def test_unpublish_is_idempotent(node: Node) -> None:
    target = node.publish("pod-1", "team-a", "llama")
    node.unpublish(target)
    assert mount_at(target) is None and not target.exists()
    node.unpublish(target)  # again: still fine
    node.unpublish(node.pods / "never-published/volumes/kubernetes.io~csi/kvtier/mount")


def test_a_restarted_plugin_finds_its_mounts(node: Node, tmp_path: Path) -> None:
    """The plugin keeps no state of its own: after a restart the tier's tmpfs is reused (the
    pool in it intact) and the old pod's volume unpublishes normally."""
    old = node.publish("pod-1", "team-a", "llama")
    (old / "pool/pool-file").write_bytes(b"warm")
    restarted = NodePlugin(
        "node-1",
        Volumes(node.plugin.volumes.state_dir, node.pods),
        node.plugin.tiers,
    )
    socket = tmp_path / "csi2.sock"
    server = serve(restarted, f"unix://{socket}")
    channel = grpc.insecure_channel(f"unix://{socket}")
    try:
        fresh = Node(channel, restarted, node.pods, node.api)
        new = fresh.publish("pod-2", "team-a", "llama")
        assert (new / "pool/pool-file").read_bytes() == b"warm"
        old_mount, new_mount = mount_at(old), mount_at(new)
        assert old_mount is not None and new_mount is not None
        assert old_mount.device == new_mount.device
        fresh.unpublish(old)
        assert mount_at(old) is None
    finally:
        channel.close()
        server.stop(0).wait()


def test_a_deleted_tiers_tmpfs_is_freed_once_no_pod_uses_it(node: Node, tmp_path: Path) -> None:
    target = node.publish("pod-1", "team-b", "qwen")
    state = node.plugin.volumes.state_dir / "team-b.qwen"
    node.plugin.tiers._client.delete(KVCacheTier, "qwen", namespace="team-b")  # type: ignore[attr-defined]
    assert node.plugin.sweep() == []  # a pod still uses it
    assert mount_at(state) is not None
    node.unpublish(target)
    assert node.plugin.sweep() == ["team-b.qwen"]
    assert mount_at(state) is None and not state.exists()


def test_a_resized_tier_is_remounted_with_its_new_size(node: Node) -> None:
    target = node.publish("pod-1", "team-a", "llama")
    node.plugin.tiers._client.apply(  # type: ignore[attr-defined]
        to_object(
            {
                "apiVersion": "kvtier.io/v1alpha1",
                "kind": "KVCacheTier",
                "metadata": {"name": "llama", "namespace": "team-a"},
                "spec": {"host": {"capacity": "48Mi"}},
            }
        ),
        field_manager="test",
        force=True,
    )
    node.publish("pod-2", "team-a", "llama")
    stat = os.statvfs(target)
    assert stat.f_blocks * stat.f_frsize == tier_volume_bytes(48 << 20, 2 << 20)


def _as(uid: int, groups: list[int], code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by the system's Python (the test's virtual environment may sit where other
    uids cannot reach) as `uid` with exactly `groups`."""
    return subprocess.run(
        ["/usr/bin/python3", "-c", code],
        user=uid,
        group=groups[0] if groups else uid,
        extra_groups=groups,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("uid", [0, 65532, 1000710000])
def test_any_uid_with_the_tiers_group_works_and_no_other(node: Node, uid: int) -> None:
    """Root (vLLM images), the agent's 65532 and an OpenShift-style random uid: with the
    tier's group each can create files in the tier's directory; with another tier's group
    (non-root) nothing there can be read or listed."""
    mine = node.publish("pod-1", "team-a", "llama")
    node.publish("pod-2", "team-b", "llama")
    write = f"open({str(mine / 'run' / f'probe-{uid}')!r}, 'w').write('x')"
    allowed = _as(uid, [tier_group("team-a", "llama")], write)
    assert allowed.returncode == 0, allowed.stderr
    created = (mine / "run" / f"probe-{uid}").stat()
    assert created.st_gid == tier_group("team-a", "llama")  # setgid directory
    if uid == 0:
        return  # root reads anything; the namespace boundary is the CSI plugin's
    other = _as(
        uid, [tier_group("team-b", "llama")], f"import os; os.listdir({str(mine / 'run')!r})"
    )
    assert other.returncode != 0 and "PermissionError" in other.stderr


def test_an_agent_using_the_whole_capacity_fits_its_volume(node: Node) -> None:
    """The volume holds the pool, its staging area and its published index (all allocated
    at start), not just the pool: an agent whose pool is the tier's whole capacity passes
    its runtime checks in it, starts and stores."""
    from kvtier.agent.runtime_checks import check_runtime
    from kvtier.client.connection import AgentClient
    from kvtier.local.agent import AgentProcess, scratch_config

    assert tier_volume_bytes(256 << 20, 64 << 10) > (256 << 20) + (64 << 10) * 64  # staging
    target = node.publish("pod-9", "team-c", "big")
    config = scratch_config(target, "big", "256Mi", "64Ki")
    check_runtime(config)
    with AgentProcess(config), AgentClient(config.endpoint) as client:
        rows = [np.full(64 << 10, i, np.uint8) for i in range(200)]
        result = client.store("ns", [b"key-%d" % i for i in range(200)], rows)
        assert result.stored == 200


def test_a_sweep_brings_a_volume_of_an_earlier_layout_to_this_one(node: Node) -> None:
    """A volume an earlier plugin laid out (pool/ root's and group-writable) is laid out
    again at the next sweep, not only at the next pod's publish: clients refuse a pool in a
    directory the group may change."""
    target = node.publish("pod-1", "team-a", "llama")
    for path in (target, target / "pool", target / "run"):
        os.chown(path, 0, -1)
        path.chmod(0o2770)
    node.plugin.sweep()
    assert (target / "pool").stat().st_uid == AGENT
    assert (target / "pool").stat().st_mode & 0o7777 == 0o2750
    assert (target / "run").stat().st_mode & 0o7777 == 0o3770
    assert target.stat().st_mode & 0o7777 == 0o2750
