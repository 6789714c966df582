"""Uninstalling leaves nothing behind (docs/uninstall.md), with `kvtier operator` as its own
process against the emulated API server: a tier deleted after the operator stopped is gone at
once, whether the operator stopped gracefully (it removes its finalizer; a replica still
running adds it again), was killed (`kvtier operator release-finalizers`), or was stopped by
the chart's pre-delete hook (`--stop`); the NFS PersistentVolumes of a tier deleted while no
operator ran are deleted by the next operator to start."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.kube import FIELD_MANAGER, AsyncClient
from tests.kube_api import KubeAPI
from tests.operator_process import operator_process, wait_for

NS = "inference"
TIERS = f"/apis/kvtier.io/v1alpha1/namespaces/{NS}/kvcachetiers"
PVS = "/api/v1/persistentvolumes"
FINALIZER = "kvtier.io/operator"  # what users see on their tiers
OTHER = "example.com/keep"  # another controller's finalizer, which must stay
NFS = {"KVTIER_ALLOWED_NFS_SERVERS": "nfs.storage.svc.cluster.local"}


def tier(name: str, *, nfs: bool = False, finalizers: tuple[str, ...] = ()) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "vllm"}},
            "host": {"capacity": "8Gi", "chunkSize": "2Mi", "policy": "lru"},
        },
    }
    if finalizers:
        body["metadata"]["finalizers"] = list(finalizers)
    if nfs:
        body["spec"]["tiers"] = [
            {
                "name": "nfs",
                "filesystem": {
                    "nfs": {"server": "nfs.storage.svc.cluster.local", "path": f"/kv/{name}"},
                    "capacity": "1Ti",
                },
            }
        ]
    return body


def get(api: KubeAPI, path: str) -> dict[str, Any] | None:
    status, body = api.request("GET", path)
    return body if status == 200 else None


def finalizers(api: KubeAPI, name: str) -> list[str] | None:
    """The tier's finalizers; None when the tier does not exist."""
    body = get(api, f"{TIERS}/{name}")
    return None if body is None else list(body["metadata"].get("finalizers") or [])


def create(api: KubeAPI, body: dict[str, Any]) -> None:
    assert api.request("POST", TIERS, copy.deepcopy(body))[0] in (200, 201)


def delete(api: KubeAPI, name: str) -> None:
    assert api.request("DELETE", f"{TIERS}/{name}")[0] == 200


def volume(name: str) -> str:
    return f"{PVS}/kvtier-{NS}-{name}-nfs"


def cli(api: KubeAPI, *args: str, timeout: float = 60) -> subprocess.Popen[str]:
    env = {**os.environ, "KUBECONFIG": str(api.kubeconfig)}
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "operator", "release-finalizers", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return dict(json.loads(out))


def stop(proc: subprocess.Popen[bytes], how: signal.Signals = signal.SIGTERM) -> None:
    proc.send_signal(how)
    proc.wait(30)


def test_a_stopped_operator_leaves_no_finalizer_and_a_running_replica_adds_it_again(
    tmp_path: Path,
) -> None:
    with KubeAPI(tmp_path) as api:
        create(api, tier("llama"))
        create(api, tier("shared", finalizers=(OTHER,)))
        with (
            operator_process(api.kubeconfig, tmp_path, log_name="a.log") as (first, _),
            operator_process(api.kubeconfig, tmp_path, log_name="b.log") as (second, _),
        ):
            wait_for(lambda: FINALIZER in (finalizers(api, "llama") or []))
            wait_for(lambda: FINALIZER in (finalizers(api, "shared") or []))
            # One replica goes (a rolling update): it removes the finalizer as it stops ...
            stop(second)
            log = (tmp_path / "b.log").read_text()
            assert f"removed the finalizer {FINALIZER}" in log and f"{NS}/llama" in log
            # ... and the replica still running adds it again.
            wait_for(lambda: FINALIZER in (finalizers(api, "llama") or []))
            wait_for(lambda: FINALIZER in (finalizers(api, "shared") or []))
            # The last one goes (helm uninstall deletes the Deployment): nothing adds it.
            stop(first)
            assert first.returncode == 0
        assert finalizers(api, "llama") == []
        assert finalizers(api, "shared") == [OTHER]  # another controller's stays
        delete(api, "llama")
        assert finalizers(api, "llama") is None  # deleted at once, no operator needed


def test_after_a_crash_the_command_releases_the_tiers_and_the_next_operator_sweeps_volumes(
    tmp_path: Path,
) -> None:
    with KubeAPI(tmp_path) as api:
        create(api, tier("gone", nfs=True))
        create(api, tier("kept", nfs=True, finalizers=(OTHER,)))
        with operator_process(api.kubeconfig, tmp_path, env=NFS) as (operator, _):
            for name in ("gone", "kept"):
                wait_for(lambda n=name: FINALIZER in (finalizers(api, n) or []))
                wait_for(lambda n=name: get(api, volume(n)))
            stop(operator, signal.SIGKILL)  # no cleanup ran
        assert FINALIZER in (finalizers(api, "gone") or [])  # would strand the namespace

        report = finished(cli(api, "--json"))
        assert sorted(report["released"]) == [f"{NS}/gone", f"{NS}/kept"]
        assert report["stopped"] is None and report["deletedVolumes"] == []
        assert finalizers(api, "kept") == [OTHER]
        delete(api, "gone")
        assert finalizers(api, "gone") is None
        # Deleted without an operator: its cluster-wide volume is still there ...
        assert get(api, volume("gone")) is not None
        with operator_process(api.kubeconfig, tmp_path, env=NFS, log_name="next.log"):
            # ... until the next operator starts, which keeps the volumes of live tiers.
            wait_for(lambda: get(api, volume("gone")) is None)
            assert get(api, volume("kept")) is not None
            wait_for(lambda: FINALIZER in (finalizers(api, "kept") or []))


def test_the_pre_delete_hook_stops_the_operator_then_releases_what_is_left(
    tmp_path: Path,
) -> None:
    """`--stop` as the chart's hook runs it: the operator's Deployment scaled to zero, its
    pod (a real operator here, stopped as the Deployment controller and kubelet would stop
    it) gone before the finalizers are checked, so no operator adds them again."""
    deployments = "/apis/apps/v1/namespaces/kvtier-system/deployments"
    pods = "/api/v1/namespaces/kvtier-system/pods"
    labels = {"app.kubernetes.io/name": "kvtier-operator", "app.kubernetes.io/instance": "kv"}
    with KubeAPI(tmp_path) as api:
        create(api, tier("llama"))
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "kv-kvtier", "namespace": "kvtier-system"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "operator", "image": "kvtier"}]},
                },
            },
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "kv-kvtier-0", "namespace": "kvtier-system", "labels": labels},
            "spec": {"containers": [{"name": "operator", "image": "kvtier"}]},
        }
        assert api.request("POST", deployments, deployment)[0] in (200, 201)
        assert api.request("POST", pods, pod)[0] in (200, 201)
        with operator_process(api.kubeconfig, tmp_path) as (operator, _):
            wait_for(lambda: FINALIZER in (finalizers(api, "llama") or []))
            hook = cli(api, "--stop", "kvtier-system/kv-kvtier", "--timeout", "60", "--json")
            scaled = wait_for(
                lambda: (get(api, f"{deployments}/kv-kvtier") or {})["spec"]["replicas"] == 0
            )
            assert scaled
            assert hook.poll() is None  # still waiting for the pod
            stop(operator)  # the pod's SIGTERM
            assert api.request("DELETE", f"{pods}/kv-kvtier-0")[0] == 200
            report = finished(hook)
        assert report["stopped"] == "kvtier-system/kv-kvtier"
        assert finalizers(api, "llama") == []


def test_only_kvtiers_own_finalizer_is_removed_even_when_the_list_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSON patch tests the entry it removes: read before another controller removed
    an earlier finalizer, it is refused (422) and made again from the tier as it is now."""
    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        create(api, tier("llama", finalizers=("a.example/one", FINALIZER, "b.example/two")))
        stale = get(api, f"{TIERS}/llama")
        assert stale is not None
        status, _ = api.request(
            "PATCH",
            f"{TIERS}/llama",
            [{"op": "remove", "path": "/metadata/finalizers/0"}],
            "application/json-patch+json",
        )
        assert status == 200

        from kvtier.operator.uninstall import FINALIZER as NAMED
        from kvtier.operator.uninstall import remove_finalizer

        assert NAMED == FINALIZER

        async def release() -> bool:
            client = AsyncClient(field_manager=FIELD_MANAGER)
            try:
                return await remove_finalizer(client, stale)
            finally:
                await client.close()

        assert asyncio.run(release()) is True
        assert finalizers(api, "llama") == ["b.example/two"]
        assert asyncio.run(release()) is False  # nothing left to remove


def test_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "operator", "release-finalizers", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "usage: kvtier operator release-finalizers" in proc.stdout
    assert "--stop" in proc.stdout and "--json" in proc.stdout
