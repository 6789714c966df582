"""A small kubelet: lays out a rendered pod's volumes as the real one does, then runs its
container as the pod's identity in a root filesystem of its own.

Nothing here is what kvtier's code expects; each rule is kubelet's documented behaviour (the
Kubernetes docs on volumes, Secrets, security contexts and CSI ephemeral volumes) or what a
real kubelet v1.36 with containerd was seen to do:
- every volumeMount is a bind mount (containerd's rbind), so the mount path inside the
  container is a mount point: it cannot be removed or renamed (EBUSY);
- hostPath: the node's directory, created 0755 root for DirectoryOrCreate, refused when a
  `Directory` is missing;
- secret and configMap: a tmpfs of files written by kubelet's atomic writer (`key` ->
  `..data/key` -> a timestamped directory), owned by root with the item's mode, else the
  volume's defaultMode, else 0644; with the pod's fsGroup, group-owned by it and OR'd with
  0440 (read-only volumes), else unreadable to a non-root uid at 0400;
- emptyDir: 0777; csi: NodePublishVolume over the driver's socket with the volume's
  attributes and, where the CSIDriver sets podInfoOnMount, the pod's name, namespace and
  uid; the CSIDriver's fsGroupPolicy decides whether kubelet re-owns what it mounts;
- the container's process runs as runAsUser/runAsGroup (the image's user otherwise), with
  supplementalGroups and fsGroup as its groups, umask 022, in a root filesystem that is
  read-only when readOnlyRootFilesystem says so; $(VAR) in args is expanded from its env.
The one liberty: containers reach the API server through a kubeconfig (the emulated server
serves no in-cluster TLS for service-account tokens), mounted like a volume.

The root filesystem holds this machine's system directories and the project with its
virtual environment at their own paths, read-only: the image. Needs root (mounts, chroot).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvtier.csi.messages import message
from tests.container_start import MS_BIND, MS_PRIVATE, MS_SHARED, _mount
from tests.payload_tool import payload_tool

Manifest = dict[str, Any]
REPO = Path(__file__).resolve().parents[1]
IMAGE_USER = (65532, 65532)  # the Dockerfile's USER
ENTRYPOINT = [str(Path(sys.executable).parent / "kvtier")]  # the Dockerfile's ENTRYPOINT
KUBECONFIG_DIR = "/var/run/kvtier-test"
PLUGIN_PAYLOAD = "/opt/kvtier/plugin/kvtier"

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class MountFailed(Exception):
    """What kubelet reports as a FailedMount event: the pod's container never starts."""


def _umount_below(root: Path) -> None:
    """Lazily unmount every mount at or below `root`, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == str(root) or point.startswith(f"{root}/"):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        _libc.umount2(point.encode(), 2)  # MNT_DETACH


def _own_for(root: Path, fs_group: int, change_policy: str) -> None:
    """Kubelet's volume ownership for fsGroup: group fsGroup, group rw (x for directories),
    setgid directories; with fsGroupChangePolicy OnRootMismatch, nothing when the top
    already matches."""
    top = root.stat()
    if (
        change_policy == "OnRootMismatch"
        and top.st_gid == fs_group
        and top.st_mode & 0o2070 == 0o2070
    ):
        return
    for path in [root, *root.rglob("*")]:
        os.chown(path, -1, fs_group, follow_symlinks=False)
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        extra = 0o2070 if path.is_dir() else 0o060
        os.chmod(path, (mode & 0o7777) | extra)


def _is_mount_point(path: Path) -> bool:
    return any(
        line.split()[4] == str(path)
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


@dataclass
class Container:
    """A running container: its process, log, and how to reach its ports."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    rootfs: Path
    ports: dict[str, int]

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """What kubelet's FallbackToLogsOnError puts in lastState.terminated.message."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after the grace period, as kubelet stops a container."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


@dataclass
class Pod:
    manifest: Manifest
    uid: str
    directory: Path  # kubelet's /var/lib/kubelet/pods/<uid> on the node
    volumes: dict[str, Path] = field(default_factory=dict)  # volume name -> what mounts it
    containers: list[Container] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.manifest["metadata"].get("namespace", "default"))


class Kubelet:
    """One node. `root` holds the node's filesystem (hostPaths, kubelet's directories) and
    the containers' root filesystems; `objects` the Secrets, ConfigMaps and CSIDrivers the
    API server would give kubelet; `claims` the directory bound to each PVC name."""

    def __init__(self, root: Path, node_name: str, kubeconfig: Path) -> None:
        self.root = root
        self.node_name = node_name
        self.kubeconfig = kubeconfig
        self.secrets: dict[tuple[str, str], dict[str, bytes]] = {}
        self.configmaps: dict[tuple[str, str], dict[str, str]] = {}
        self.csi_drivers: dict[str, Manifest] = {}
        # Each claim's directory and its driver's fsGroupPolicy ("File": kubelet re-owns it
        # for the pod's fsGroup, as for most RWX CSI drivers; "None": left as it is, as NFS).
        self.claims: dict[tuple[str, str], tuple[Path, str]] = {}
        self.pods: list[Pod] = []
        self._serial = 0
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        # The node's own mount, private: what a container mounts in its namespace (its root
        # filesystem) stays there; only Bidirectional mounts are shared, one by one.
        _mount(str(root), root, None, MS_BIND)
        _mount("none", root, None, MS_PRIVATE)
        for own in ("pods", "plugins", "plugins_registry"):  # what kubelet makes at its start
            self.host(f"/var/lib/kubelet/{own}").mkdir(parents=True, exist_ok=True)

    def host(self, path: str) -> Path:
        """A path of the node's own filesystem."""
        return self.root / "host" / path.lstrip("/")

    def node_path_of(self, path: Path) -> str:
        return "/" + str(path.relative_to(self.root / "host"))

    # --- volumes --------------------------------------------------------------------------

    def _atomic_files(
        self, directory: Path, files: dict[str, bytes], modes: dict[str, int], fs_group: int | None
    ) -> None:
        """Kubelet's atomic writer on a tmpfs: files in a timestamped directory, `..data`
        pointing at it, each key a symlink through `..data`."""
        directory.mkdir(parents=True)
        _mount("tmpfs", directory, "tmpfs", 0, "mode=0755")
        stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{self._serial}"
        stamp.mkdir()
        for path, data in files.items():
            target = stamp / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            mode = modes[path]
            if fs_group is not None:
                os.chown(target, 0, fs_group)
                mode |= 0o440
            os.chmod(target, mode)
        (directory / "..data").symlink_to(stamp.name)
        for top in {p.split("/")[0] for p in files}:
            (directory / top).symlink_to(f"..data/{top}")

    def _data_volume(self, pod: Pod, volume: Manifest, fs_group: int | None) -> Path:
        kind = "secret" if "secret" in volume else "configMap"
        source = volume[kind]
        ref = source["secretName"] if kind == "secret" else source["name"]
        data: dict[str, bytes] | None
        if kind == "secret":
            data = self.secrets.get((pod.namespace, ref))
        else:
            found = self.configmaps.get((pod.namespace, ref))
            data = None if found is None else {k: v.encode() for k, v in found.items()}
        if data is None:
            raise MountFailed(
                f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                f'{kind.lower()} "{ref}" not found'
            )
        default = source.get("defaultMode", 0o644)
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        files = {i["path"]: data[i["key"]] for i in items}
        modes = {i["path"]: i.get("mode", default) for i in items}
        where = pod.directory / f"volumes/kubernetes.io~{kind.lower()}/{volume['name']}"
        self._atomic_files(where, files, modes, fs_group)
        return where

    def _csi_volume(self, pod: Pod, volume: Manifest) -> Path:
        csi = volume["csi"]
        driver = self.csi_drivers.get(csi["driver"])
        if driver is None:
            raise MountFailed(f"driver name {csi['driver']} not found in the list of CSI drivers")
        target = pod.directory / f"volumes/kubernetes.io~csi/{volume['name']}/mount"
        attributes = dict(csi.get("volumeAttributes", {}))
        if driver["spec"].get("podInfoOnMount"):
            attributes.update(
                {
                    "csi.storage.k8s.io/pod.name": pod.name,
                    "csi.storage.k8s.io/pod.namespace": pod.namespace,
                    "csi.storage.k8s.io/pod.uid": pod.uid,
                    "csi.storage.k8s.io/serviceAccount.name": str(
                        pod.manifest["spec"].get("serviceAccountName", "default")
                    ),
                    "csi.storage.k8s.io/ephemeral": "true",
                }
            )
        try:
            self._node_call(
                csi["driver"],
                "NodePublishVolume",
                volume_id=f"csi-{pod.uid}-{volume['name']}",
                target_path=self.node_path_of(target),
                volume_capability={"mount": {}, "access_mode": {"mode": 1}},
                volume_context=attributes,
            )
        except grpc.RpcError as exc:
            raise MountFailed(
                f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                f"rpc error: code = {exc.code().name} desc = {exc.details()}"
            ) from exc
        return target

    def _node_call(self, driver: str, method: str, **fields: Any) -> None:
        """One call of the CSI Node service on the driver's socket, as kubelet makes it."""
        socket = self.host(f"/var/lib/kubelet/plugins/{driver}/csi.sock")
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            call = channel.unary_unary(
                f"/csi.v1.Node/{method}",
                request_serializer=message(f"{method}Request").SerializeToString,
                response_deserializer=message(f"{method}Response").FromString,
            )
            call(message(f"{method}Request")(**fields), timeout=30)

    @staticmethod
    def _change_policy(pod: Pod) -> str:
        security = pod.manifest["spec"].get("securityContext") or {}
        return str(security.get("fsGroupChangePolicy", "Always"))

    def _volume(self, pod: Pod, volume: Manifest, fs_group: int | None) -> Path:
        name = volume["name"]
        if "hostPath" in volume:
            spec = volume["hostPath"]
            path = self.host(spec["path"])
            if spec.get("type") == "DirectoryOrCreate" and not path.exists():
                path.mkdir(parents=True, mode=0o755)
            elif spec.get("type") == "Directory" and not path.is_dir():
                raise MountFailed(f"hostPath type check failed: {spec['path']} is not a directory")
            return path
        if "secret" in volume or "configMap" in volume:
            return self._data_volume(pod, volume, fs_group)
        if "emptyDir" in volume:
            path = pod.directory / f"volumes/kubernetes.io~empty-dir/{name}"
            path.mkdir(parents=True)
            path.chmod(0o777)
            if fs_group is not None:
                os.chown(path, 0, fs_group)
                path.chmod(0o2777)
            return path
        if "csi" in volume:
            target = self._csi_volume(pod, volume)
            policy = self.csi_drivers[volume["csi"]["driver"]]["spec"].get("fsGroupPolicy")
            if policy == "File" and fs_group is not None:
                _own_for(target, fs_group, self._change_policy(pod))
            return target
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            bound = self.claims.get((pod.namespace, claim))
            if bound is None:
                raise MountFailed(f'persistentvolumeclaim "{claim}" not found')
            path, policy = bound
            if policy == "File" and fs_group is not None:
                _own_for(path, fs_group, self._change_policy(pod))
            return path
        raise MountFailed(f"volume {name}: a kind this kubelet does not lay out")

    # --- pods -----------------------------------------------------------------------------

    def run_pod(self, manifest: Manifest, ports: dict[str, int] | None = None) -> Pod:
        """Set up the pod's volumes and start its containers; `ports` maps a containerPort
        name to the port it is reached at. Raises MountFailed as kubelet would report it."""
        self._serial += 1
        uid = f"pod-{self._serial:04d}"
        pod = Pod(manifest, uid, self.host(f"/var/lib/kubelet/pods/{uid}"))
        pod.directory.mkdir(parents=True)
        self.pods.append(pod)
        security = manifest["spec"].get("securityContext") or {}
        fs_group = security.get("fsGroup")
        for volume in manifest["spec"].get("volumes", []):
            pod.volumes[volume["name"]] = self._volume(pod, volume, fs_group)
        for init in manifest["spec"].get("initContainers", []):  # each to its end, in order
            done = self._start(pod, init, {})
            if done.process.wait(60) != 0:
                raise RuntimeError(f"Init:Error: {init['name']}: {done.log_tail()}")
        for container in manifest["spec"]["containers"]:
            pod.containers.append(self._start(pod, container, ports or {}))
        return pod

    def restart(self, pod: Pod, index: int = 0) -> Container:
        """The container restarted in place (a crash, a liveness failure): same volumes."""
        old = pod.containers[index]
        old.stop()
        spec = pod.manifest["spec"]["containers"][index]
        pod.containers[index] = self._start(pod, spec, old.ports)
        return pod.containers[index]

    def delete_pod(self, pod: Pod) -> None:
        """Containers stopped, then every CSI volume unpublished and the pod's directory
        removed (kubelet's teardown)."""
        for container in pod.containers:
            container.stop()
        for volume in pod.manifest["spec"].get("volumes", []):
            where = pod.volumes.get(volume["name"])
            if where is None:
                continue
            if "csi" in volume:
                self._unpublish(volume["csi"]["driver"], where)
            elif _is_mount_point(where):
                _umount_below(where)
        shutil.rmtree(pod.directory, ignore_errors=True)
        self.pods.remove(pod)

    def _unpublish(self, driver: str, target: Path) -> None:
        self._node_call(
            driver, "NodeUnpublishVolume", volume_id="x", target_path=self.node_path_of(target)
        )

    def close(self) -> None:
        for pod in list(self.pods):
            with contextlib.suppress(Exception):
                self.delete_pod(pod)
        _umount_below(self.root)

    # --- containers -----------------------------------------------------------------------

    def _image(self) -> tuple[list[Manifest], dict[str, str], list[str]]:
        """The image's layers as read-only binds (this machine's system directories, the
        interpreter and the project with its environment, at their own paths), its links,
        and the files of its /etc."""
        layers = [Path("/usr"), Path("/etc/ssl"), Path(sys.base_prefix), Path(sys.prefix)]
        # The project by its entries, not as one bind: a checkout in a directory only root may
        # enter (`mktemp -d` makes it 0700) would shut the image's user out of all of it.
        layers += sorted(p for p in REPO.iterdir() if not p.is_symlink())
        binds = [
            {"source": str(d), "inside": str(d), "readOnly": True}
            for d in dict.fromkeys(layers)
            if d.is_dir() or d.is_file()
        ]
        # The plug-in payload, made and placed as the Dockerfile does for the webhook's init
        # container: the plug-in's packages only.
        payload = self.root / "image" / "plugin"
        if not payload.exists():
            payload_tool().copy_payload(REPO, payload)
        plugin = {"source": str(payload / "kvtier"), "inside": PLUGIN_PAYLOAD, "readOnly": True}
        binds.append(plugin)
        links = {}
        for top in ("bin", "lib", "lib64", "sbin"):
            path = Path("/", top)
            if path.is_symlink():
                links[top] = os.readlink(path)
            elif path.is_dir():
                binds.append({"source": str(path), "inside": str(path), "readOnly": True})
        etc = [
            name
            for name in ("passwd", "group", "hosts", "nsswitch.conf", "ld.so.cache", "resolv.conf")
            if Path("/etc", name).is_file()
        ]
        binds += [{"source": f"/{d}", "inside": f"/{d}"} for d in ("dev", "proc", "sys")]
        binds.append(
            {
                "source": str(self.kubeconfig),
                "inside": f"{KUBECONFIG_DIR}/kubeconfig",
                "readOnly": True,
            }
        )
        return binds, links, etc

    def _start(self, pod: Pod, container: Manifest, ports: dict[str, int]) -> Container:
        spec = pod.manifest["spec"]
        pod_security = spec.get("securityContext") or {}
        security = {**pod_security, **(container.get("securityContext") or {})}
        user = security.get("runAsUser", IMAGE_USER[0])
        group = security.get("runAsGroup", IMAGE_USER[1] if "runAsUser" not in security else 0)
        groups = [group, *pod_security.get("supplementalGroups", [])]
        if "fsGroup" in pod_security:
            groups.append(pod_security["fsGroup"])
        binds, links, etc = self._image()
        for mount in container.get("volumeMounts", []):
            source = pod.volumes[mount["name"]]
            shared = mount.get("mountPropagation") == "Bidirectional"
            if shared:
                # The node's side of a Bidirectional mount is shared, so what the container
                # mounts below it reaches the node (kubelet requires a shared mount there).
                if not _is_mount_point(source):
                    _mount(str(source), source, None, MS_BIND)
                _mount("none", source, None, MS_SHARED)
            binds.append(
                {
                    "source": str(source),
                    "inside": mount["mountPath"],
                    "readOnly": bool(mount.get("readOnly")),
                    "shared": shared,
                }
            )
        env = self._env(pod, container)
        argv = [
            re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a)
            for a in container.get("command", ENTRYPOINT) + container.get("args", [])
        ]
        self._serial += 1
        rootfs = self.root / "containers" / f"{pod.uid}-{container['name']}-{self._serial}"
        rootfs.mkdir(parents=True)
        start = {
            "rootfs": str(rootfs),
            "binds": binds,
            "links": links,
            "etc": etc,
            "readOnlyRootFilesystem": bool(security.get("readOnlyRootFilesystem")),
            "uid": user,
            "gid": group,
            "groups": groups,
            "argv": argv,
            "env": env,
        }
        spec_file = rootfs.with_suffix(".json")
        spec_file.write_text(json.dumps(start))
        log = rootfs.with_suffix(".log")
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "unchanged",
                    sys.executable,
                    str(Path(__file__).with_name("container_start.py")),
                    str(spec_file),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        named = {
            p["name"]: ports.get(p["name"], p["containerPort"])
            for p in container.get("ports", [])
            if "name" in p
        }
        return Container(container["name"], process, log, rootfs, named)

    def _env(self, pod: Pod, container: Manifest) -> dict[str, str]:
        fields = {
            "spec.nodeName": self.node_name,
            "status.podIP": "127.0.0.1",
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
        }
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/",
            "KUBECONFIG": f"{KUBECONFIG_DIR}/kubeconfig",
            "PYTHONUNBUFFERED": "1",
        }
        if "PYTHONPATH" in os.environ:  # the image's: a run against another checkout uses it
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif "fieldRef" in item.get("valueFrom", {}):
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        return env


def wait_ready(container: Container, probe: Manifest, timeout: float = 60.0) -> None:
    """Poll the container's readinessProbe (httpGet) until it answers 200; raises with the
    container's last log lines when it exits first, as kubelet's status would show."""
    get = probe["httpGet"]
    port = container.ports.get(get["port"], get["port"])
    url = f"http://127.0.0.1:{port}{get.get('path', '/')}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not container.alive():
            raise RuntimeError(
                f"container {container.name} exited {container.process.returncode}: "
                f"{container.log_tail()}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(
        f"container {container.name} not ready in {timeout}s: {container.log_tail()}"
    )


@contextlib.contextmanager
def node(root: Path, node_name: str, kubeconfig: Path) -> Iterator[Kubelet]:
    kubelet = Kubelet(root, node_name, kubeconfig)
    try:
        yield kubelet
    finally:
        kubelet.close()
