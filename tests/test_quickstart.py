"""The quickstart's vLLM Deployment is what it says: selected and injected by the webhook for
the tier the quickstart applies (examples/host-only.yaml), and within Pod Security
`restricted` (tests/pod_security.py) before and after injection, while the image's usual
root pod passes only `baseline`; and the uninstall steps the docs show exist."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import yaml

from kvtier.operator.webhook import mutate_pod, selects
from tests.apiserver_rules import admit, load_crd
from tests.operator_fixtures import SETTINGS
from tests.pod_security import baseline, restricted

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "docs" / "quickstart.md"
UNINSTALL = REPO / "docs" / "uninstall.md"


def yaml_blocks(path: Path) -> list[dict[str, Any]]:
    """The objects of the ```yaml blocks of a Markdown file (indented blocks included)."""
    text = path.read_text()
    found = []
    for indent, body in re.findall(r"^( *)```yaml\n(.*?)^\1```", text, re.M | re.S):
        lines = [line[len(indent) :] for line in body.splitlines()]
        found += [d for d in yaml.safe_load_all("\n".join(lines)) if d]
    return found


def quickstart_deployment() -> dict[str, Any]:
    (deployment,) = [o for o in yaml_blocks(QUICKSTART) if o.get("kind") == "Deployment"]
    return deployment


def quickstart_tier() -> dict[str, Any]:
    resource = yaml.safe_load((REPO / "examples" / "host-only.yaml").read_text())
    resource["metadata"].update(namespace="inference", uid="0f1e-uid", generation=1)
    stored, errors = admit(load_crd("kvcachetier.yaml"), resource)
    assert errors == []
    return stored


def pod_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """The pod the Deployment's ReplicaSet creates, as the webhook sees it."""
    template = copy.deepcopy(deployment["spec"]["template"])
    metadata = {**template["metadata"], "name": "vllm-0", "namespace": "inference"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def injected(pod: dict[str, Any]) -> dict[str, Any]:
    mutation = mutate_pod(pod, quickstart_tier(), SETTINGS)
    assert mutation.injected, mutation
    return dict(jsonpatch.apply_patch(copy.deepcopy(pod), mutation.patch))


def test_the_quickstart_pod_is_restricted_before_and_after_injection() -> None:
    deployment = quickstart_deployment()
    kubernetes_validate.validate(deployment, "1.33", strict=True)
    pod = pod_of(deployment)
    tier = quickstart_tier()
    assert selects(tier["spec"]["podSelector"], pod["metadata"]["labels"])
    assert restricted(pod["spec"]) == []
    after = injected(pod)
    assert restricted(after["spec"]) == [] and baseline(after["spec"]) == []
    (vllm,) = [c for c in after["spec"]["containers"] if c["name"] == "vllm"]
    assert any(str(a).startswith("--kv-transfer-config") for a in vllm["args"])


def test_the_quickstart_pod_can_write_its_caches_as_its_uid() -> None:
    """Not root: HOME (where vLLM, Hugging Face, Triton and FlashInfer keep their caches)
    is a writable emptyDir, USER names the uid, and /dev/shm is larger than the runtime's."""
    spec = pod_of(quickstart_deployment())["spec"]
    assert spec["securityContext"]["runAsUser"] not in (None, 0)
    (vllm,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts[env["HOME"]]] and env["USER"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_the_images_usual_root_pod_is_baseline_only() -> None:
    """What the quickstart says of a pod without the securityContext: `restricted` refuses it
    naming the container, `baseline` admits it, also once injected."""
    pod = pod_of(quickstart_deployment())
    del pod["spec"]["securityContext"]
    for container in pod["spec"]["containers"]:
        del container["securityContext"]
    assert any("containers[vllm]" in v for v in restricted(pod["spec"]))
    after = injected(pod)
    assert baseline(pod["spec"]) == [] == baseline(after["spec"])


def test_the_docs_link_the_uninstall_steps_and_their_command_exists() -> None:
    assert "(uninstall.md)" in QUICKSTART.read_text()
    assert "(docs/uninstall.md)" in (REPO / "README.md").read_text()
    text = UNINSTALL.read_text()
    flags = set(re.findall(r"kvtier operator release-finalizers[^\n`]*", text))
    assert flags
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "operator", "release-finalizers", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for line in flags:
        for flag in re.findall(r"--[a-z-]+", line):
            assert flag in proc.stdout, (flag, line)
