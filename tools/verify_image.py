"""Verifies a built kvtier image by running it with podman, as a cluster would run it: the CLI,
the user it runs as, a real agent serving a client through a mounted socket directory and
stopping cleanly on SIGTERM, an agent refusing a pool larger than its /dev/shm, the operator
failing cleanly without a cluster, and the plug-in payload importable with only what vLLM's
image has. With --archive, checks the saved OCI archive's config instead. Prints each check;
exits non-zero on the first failure."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from plugin_payload import PACKAGES, SHIMS, payload_files, payload_modules

UID = 65532
REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = "/opt/kvtier/plugin"
# What of kvtier's dependencies a vLLM image does not have (.venv-vllm, vLLM's own environment,
# lacks them; grpc is there but the plug-in must not count on it): the payload imports without.
NOT_IN_VLLM = [
    "xxhash",
    "boto3",
    "botocore",
    "kopf",
    "jsonpatch",
    "lightkube",
    "kubernetes",
    "grpc",
    "nixl",
    "nixl_cu12",
]
# Never in the payload: the parts that run outside vLLM.
NOT_IN_PAYLOAD = [
    "kvtier.agent.server",
    "kvtier.operator",
    "kvtier.csi",
    "kvtier.cli",
    "kvtier.demo",
    "kvtier.bench",
    "kvtier.traces",
    "kvtier.local",
    "kvtier.kube",
]


CLIENT = """
import numpy as np
from kvtier.client.connection import AgentClient, AgentUnavailable
rows = [np.random.default_rng(i).integers(0, 255, 256 << 10, np.uint8) for i in range(8)]
keys = [b"image-%026d" % i for i in range(8)]
try:
    with AgentClient("ipc:///var/run/kvtier/run/agent.sock") as client:
        client.store("image-check", keys, rows)
        back = [np.zeros(256 << 10, np.uint8) for _ in rows]
        loaded = client.load_into("image-check", keys, back)
except AgentUnavailable as exc:
    print(exc)
    print("unavailable")
else:
    same = all(loaded) and all(np.array_equal(a, b) for a, b in zip(rows, back))
    print("intact" if same else "differs")
"""


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
    if not ok:
        raise SystemExit(1)


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tier_dir() -> Path:
    """A directory as the CSI plugin makes it (kvtier/csi/volumes.py): the root root's,
    pool/ and run/ the agent's, all of the tier's group, setgid, group-only."""
    from kvtier.csi.volumes import DIR_MODE, SUBDIRS

    base = Path(tempfile.mkdtemp(prefix="kvimg-"))
    base.chmod(0o755)
    volume = base / "vol"
    volume.mkdir()
    os.chown(volume, 0, UID)
    volume.chmod(DIR_MODE)
    for sub, mode in SUBDIRS.items():
        path = volume / sub
        path.mkdir()
        os.chown(path, UID, UID)  # the agent runs as UID, the tier's group is UID here
        path.chmod(mode)
    return base


def agent_config(name: str, pool_dir: str, capacity: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "runDir": "/var/run/kvtier/run",
        "host": {"capacity": capacity, "chunkBytes": "256Ki", "poolDir": pool_dir},
        "metrics": {"port": port, "host": "127.0.0.1"},
    }


def verify_running(image: str) -> None:
    help_run = podman("run", "--rm", image, "--help")
    check("kvtier --help", help_run.returncode == 0 and "agent" in help_run.stdout)
    ids = podman("run", "--rm", "--entrypoint", "sh", image, "-c", "id -u; id -g")
    check("runs as uid and gid 65532", ids.stdout.split() == [str(UID), str(UID)])
    base = tier_dir()
    try:
        port = free_port()
        config = base / "agent.yaml"
        config.write_text(
            yaml.safe_dump(agent_config("image", "/var/run/kvtier/pool", "64Mi", port))
        )
        config.chmod(0o644)
        mounts = [
            "-v",
            f"{base / 'vol'}:/var/run/kvtier",
            "-v",
            f"{config}:/etc/kvtier/agent.yaml:ro",
        ]
        checked = podman(
            "run", "--rm", *mounts, image, "agent", "--check", "--config", "/etc/kvtier/agent.yaml"
        )
        check(
            "kvtier agent --check on a sample config",
            checked.returncode == 0,
            checked.stderr[-300:],
        )
        _serve_and_stop(image, mounts, base, port)
        _refuse_oversized_pool(image, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _operator_without_cluster(image)
    _plugin_payload(image)


def _serve_and_stop(image: str, mounts: list[str], base: Path, port: int) -> None:
    started = podman(
        "run", "-d", "--network=host", *mounts, image, "agent", "--config", "/etc/kvtier/agent.yaml"
    )
    check("agent container started", started.returncode == 0, started.stderr[-300:])
    container = started.stdout.strip()
    try:
        deadline = time.monotonic() + 60
        metrics = ""
        while time.monotonic() < deadline and "kvtier_" not in metrics:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    metrics = r.read().decode()
            except OSError:
                time.sleep(0.5)
        check("agent serves /metrics", "kvtier_" in metrics)
        # More containers, as vLLM pods: root (vLLM's images) and an OpenShift-style uid, with
        # the tier's group; then one without it, which gets a miss while the agent serves on.
        for user, groups, expected in (
            ("0:0", ["--group-add", str(UID)], "intact"),
            ("1000710000:1000710000", ["--group-add", str(UID)], "intact"),
            ("1000710000:1000710000", [], "unavailable"),
        ):
            client = podman(
                "run",
                "--rm",
                "--network=none",
                "--user",
                user,
                *groups,
                "-v",
                f"{base / 'vol'}:/var/run/kvtier",
                "--entrypoint",
                "python",
                image,
                "-c",
                CLIENT,
            )
            said = (client.stdout + client.stderr).strip()
            check(
                f"a client as {user}{' with' if groups else ' without'} the tier's group: "
                f"{expected}",
                client.returncode == 0 and said.splitlines()[-1:] == [expected],
                said[-300:],
            )
        podman("stop", "-t", "20", container)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip()
        check("agent exits 0 on SIGTERM", code == "0", code)
    finally:
        podman("rm", "-f", container)


def _refuse_oversized_pool(image: str, base: Path) -> None:
    """Containers get a 64 MB /dev/shm: a 128Mi pool there must be refused at start, never
    a SIGBUS later."""
    config = base / "shm.yaml"
    config.write_text(yaml.safe_dump(agent_config("shm", "/dev/shm/kvtier", "128Mi", free_port())))
    config.chmod(0o644)
    run = podman(
        "run",
        "--rm",
        "-v",
        f"{base / 'vol'}:/var/run/kvtier",
        "-v",
        f"{config}:/etc/kvtier/agent.yaml:ro",
        image,
        "agent",
        "--config",
        "/etc/kvtier/agent.yaml",
        timeout=60,
    )
    said = run.stdout + run.stderr
    check(
        "a pool larger than the default 64 MB /dev/shm is refused at start",
        run.returncode not in (0, 135, -7) and "host.capacity" in said,
        said.strip().splitlines()[-1] if said.strip() else f"exit {run.returncode}",
    )


def _operator_without_cluster(image: str) -> None:
    run = podman("run", "--rm", "--network=none", image, "operator", timeout=120)
    said = (run.stdout + run.stderr).strip()
    check(
        "the operator without a cluster exits non-zero, saying why",
        run.returncode == 2 and "no Kubernetes credentials" in said and "Traceback" not in said,
        said.splitlines()[-1][:200] if said else "",
    )


# Lists the payload's files; then imports each of its modules with what vLLM's image lacks
# (vLLM itself included: this image has none) unimportable, and tries what must be absent.
PAYLOAD_CHECK = """
import importlib, json, os, sys
root, modules, blocked, absent = json.loads(sys.argv[1])
files = sorted(
    os.path.relpath(os.path.join(d, f), root)
    for d, _, names in os.walk(root) for f in names
)
for name in blocked:
    sys.modules[name] = None
sys.path.insert(0, root)
failed, needs_vllm, reachable = [], [], []
for name in modules:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == "vllm" or (exc.name or "").startswith("vllm."):
            needs_vllm.append(name)
        else:
            failed.append(f"{name}: {exc!r}")
    except BaseException as exc:
        failed.append(f"{name}: {exc!r}")
for name in absent:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not (exc.name and (name == exc.name or name.startswith(exc.name + "."))):
            reachable.append(name)
    except BaseException:
        reachable.append(name)
    else:
        reachable.append(name)
outside = sorted(
    f"{n}: {getattr(m, '__file__', None)}"
    for n, m in sys.modules.items()
    if m is not None and (n == "kvtier" or n.startswith("kvtier."))
    and not (getattr(m, "__file__", None) or "").startswith(root + os.sep)
)
print(json.dumps({"files": files, "failed": failed, "needs_vllm": needs_vllm,
                  "reachable": reachable, "outside": outside}))
"""


def _plugin_payload(image: str) -> None:
    """The plug-in payload (tools/plugin_payload.py): exactly its files, none of the agent,
    operator, CSI plugin, CLI or demo; its modules import with what vLLM's image lacks made
    unimportable (those of the plug-in that import vLLM itself need only vLLM); nothing
    outside it is reachable through it, though this image has all of kvtier installed."""
    expected = [str(path) for path in payload_files(REPO)]
    job = [PLUGIN_DIR, payload_modules(REPO), ["vllm", *NOT_IN_VLLM], NOT_IN_PAYLOAD]
    args = ["--network=none", "--entrypoint", "python", image, "-c", PAYLOAD_CHECK]
    run = podman("run", "--rm", *args, json.dumps(job))
    check(f"plug-in payload at {PLUGIN_DIR}", run.returncode == 0, run.stderr.strip()[-300:])
    found = json.loads(run.stdout.strip().splitlines()[-1])
    extra = sorted(set(found["files"]) - set(expected))
    missing = sorted(set(expected) - set(found["files"]))
    check(
        f"it holds exactly tools/plugin_payload.py's {len(expected)} files "
        f"({', '.join(PACKAGES + SHIMS)})",
        not extra and not missing,
        f"extra {extra[:8]}, missing {missing[:8]}",
    )
    check(
        "its modules import with what vLLM's image lacks unimportable",
        not found["failed"],
        "; ".join(found["failed"])[-300:],
    )
    vllm_side = sorted(
        m
        for m in found["needs_vllm"]
        if not (m == "kvtier.vllm" or m.startswith("kvtier.vllm.") or m in SHIMS)
    )
    check(
        "only the plug-in's own modules (kvtier.vllm, the old module path) need vLLM itself",
        not vllm_side,
        ", ".join(vllm_side),
    )
    check(
        "the agent, operator, CSI plugin, CLI, demo and benchmarks are not reachable from it",
        not found["reachable"] and not found["outside"],
        ", ".join(found["reachable"] + found["outside"])[-300:],
    )


def verify_archive(path: Path, version: str, revision: str) -> None:
    inspected = subprocess.run(
        ["skopeo", "inspect", "--config", f"oci-archive:{path}"],
        capture_output=True,
        text=True,
        check=False,
    )
    check("skopeo reads the OCI archive", inspected.returncode == 0, inspected.stderr[-200:])
    config = json.loads(inspected.stdout)["config"]
    labels = config.get("Labels") or {}
    check("user 65532:65532", config.get("User") == "65532:65532", str(config.get("User")))
    check(
        "entrypoint kvtier", config.get("Entrypoint") == ["kvtier"], str(config.get("Entrypoint"))
    )
    check(
        "labels: source, version, revision",
        labels.get("org.opencontainers.image.version") == version
        and labels.get("org.opencontainers.image.revision") == revision
        and bool(labels.get("org.opencontainers.image.source")),
        json.dumps(labels),
    )
    print(f"  archive {path}: {path.stat().st_size / 2**20:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("image", nargs="?")
    parser.add_argument("--archive", type=Path)
    parser.add_argument("--version")
    parser.add_argument("--revision")
    args = parser.parse_args()
    if args.archive:
        verify_archive(args.archive, args.version, args.revision)
        return 0
    verify_running(args.image)
    size = podman("image", "inspect", "--format", "{{.Size}}", args.image).stdout.strip()
    print(f"  image {args.image}: {int(size) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
