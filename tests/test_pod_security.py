"""kvtier's pods against Pod Security `restricted` (tests/pod_security.py, written from the
documented policy): every rule is shown to fail on a pod violating it, the agent's pod and
an injected restricted vLLM pod pass, and injection never adds a violation to any pod.
What the API server's PodSecurity admission itself decides is checked only on a cluster."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest

from kvtier.api.config import ConfigError
from kvtier.operator.builders import build_children
from kvtier.operator.webhook import mutate_pod
from tests.operator_fixtures import POD, SETTINGS, by_kind, tier
from tests.pod_security import baseline, restricted

COMPLIANT: dict[str, Any] = {
    "securityContext": {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    },
    "containers": [
        {
            "name": "app",
            "image": "x",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
    "volumes": [{"name": "data", "emptyDir": {}}],
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(COMPLIANT)
    return dict(jsonpatch.apply_patch(spec, [{"op": "add", "path": path, "value": value}]))


C = "/containers/0/securityContext"
VIOLATIONS = [
    # (path, value, control, also a baseline violation)
    ("/hostNetwork", True, "Host Namespaces", True),
    ("/hostPID", True, "Host Namespaces", True),
    ("/volumes/-", {"name": "h", "hostPath": {"path": "/"}}, "HostPath Volumes", True),
    (f"{C}/privileged", True, "Privileged Containers", True),
    (f"{C}/capabilities/add", ["SYS_ADMIN"], "Capabilities", True),
    ("/containers/0/ports", [{"containerPort": 80, "hostPort": 80}], "Host Ports", True),
    (f"{C}/procMount", "Unmasked", "/proc Mount Type", True),
    (f"{C}/seccompProfile", {"type": "Unconfined"}, "Seccomp", True),
    (f"{C}/seLinuxOptions", {"type": "spc_t"}, "SELinux", True),
    ("/securityContext/sysctls", [{"name": "kernel.msgmax", "value": "1"}], "Sysctls", True),
    (f"{C}/windowsOptions", {"hostProcess": True}, "HostProcess", True),
    ("/volumes/-", {"name": "n", "nfs": {"server": "s", "path": "/"}}, "Volume Types", False),
    (f"{C}/allowPrivilegeEscalation", True, "Privilege Escalation", False),
    ("/securityContext/runAsNonRoot", False, "Running as Non-root", False),
    ("/securityContext/runAsUser", 0, "Running as Non-root user", False),
    (f"{C}/runAsUser", 0, "Running as Non-root user", False),
    ("/securityContext/seccompProfile", {"type": "Unconfined"}, "Seccomp", True),
    (f"{C}/capabilities", {"drop": ["NET_RAW"]}, "Capabilities", False),
    (f"{C}/capabilities/add", ["CHOWN"], "Capabilities", False),
]


def test_a_compliant_pod_passes() -> None:
    assert restricted(COMPLIANT) == [] and baseline(COMPLIANT) == []


@pytest.mark.parametrize(
    ("path", "value", "control", "in_baseline"), VIOLATIONS, ids=[v[2] + v[0] for v in VIOLATIONS]
)
def test_every_rule_refuses_a_pod_that_breaks_it(
    path: str, value: Any, control: str, in_baseline: bool
) -> None:
    spec = with_change(path, value)
    assert any(v.startswith(control) for v in restricted(spec)), restricted(spec)
    assert any(v.startswith(control) for v in baseline(spec)) == in_baseline


def test_the_agent_pod_is_restricted_and_has_no_host_path() -> None:
    ds = by_kind(build_children(tier(), SETTINGS))["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert restricted(spec) == []
    assert "hostPath" not in json.dumps(ds)


def inject(pod: dict[str, Any]) -> dict[str, Any]:
    mutation = mutate_pod(pod, tier(), SETTINGS)
    assert mutation.injected
    return dict(jsonpatch.apply_patch(copy.deepcopy(pod), mutation.patch))


def test_a_restricted_vllm_pod_stays_restricted_when_injected() -> None:
    pod = copy.deepcopy(POD)
    pod["spec"]["securityContext"] = copy.deepcopy(COMPLIANT["securityContext"])
    pod["spec"]["containers"][0]["securityContext"] = copy.deepcopy(
        COMPLIANT["containers"][0]["securityContext"]
    )
    assert restricted(pod["spec"]) == []
    after = inject(pod)
    assert restricted(after["spec"]) == []
    assert "hostPath" not in json.dumps(after)


def test_injection_adds_no_violation_to_a_root_pod() -> None:
    """vLLM images run as root: such a pod is `baseline`, and injection keeps it there
    without adding a violation of either level."""
    before = copy.deepcopy(POD)
    after = inject(before)
    assert baseline(after["spec"]) == [] == baseline(before["spec"])
    assert set(restricted(after["spec"])) == set(restricted(before["spec"]))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"agent": {"image": "docker.io/attacker/kvtier:latest"}}, "spec.agent.image"),
        (
            {
                "tiers": [
                    {
                        "name": "fs",
                        "filesystem": {
                            "nfs": {"server": "10.0.0.66", "path": "/"},
                            "capacity": "1Ti",
                        },
                    }
                ]
            },
            "spec.tiers[0].filesystem.nfs.server",
        ),
    ],
)
def test_hostile_spec_fields_are_refused_naming_the_field(
    change: dict[str, Any], field: str
) -> None:
    resource = tier()
    resource["spec"].update(change)
    with pytest.raises(ConfigError) as refused:
        build_children(resource, SETTINGS)
    assert str(refused.value).startswith(field) or field in str(refused.value)
    pod = copy.deepcopy(POD)
    if "agent" in change:
        with pytest.raises(ConfigError):
            mutate_pod(pod, resource, SETTINGS)


def test_an_allowed_nfs_export_becomes_an_owned_claim_on_a_pre_bound_volume() -> None:
    resource = tier()
    resource["spec"]["tiers"] = [
        {
            "name": "nfs",
            "filesystem": {
                "nfs": {"server": "nfs.storage.svc.cluster.local", "path": "/exports/kv"},
                "capacity": "1Ti",
            },
        }
    ]
    children = by_kind(build_children(resource, SETTINGS))
    volume, claim = children["PersistentVolume"], children["PersistentVolumeClaim"]
    assert volume["spec"]["nfs"] == {
        "server": "nfs.storage.svc.cluster.local",
        "path": "/exports/kv",
    }
    assert volume["spec"]["claimRef"] == {
        "namespace": "inference",
        "name": claim["metadata"]["name"],
    }
    assert claim["spec"]["volumeName"] == volume["metadata"]["name"]
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "KVCacheTier"
    pod = children["DaemonSet"]["spec"]["template"]["spec"]
    assert {
        "name": "tier-nfs",
        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]},
    } in pod["volumes"]
    assert restricted(pod) == []


@pytest.mark.parametrize(
    "filesystem",
    [{"hostPath": {"path": "/etc"}, "capacity": "1Ti"}],
)
def test_a_host_path_tier_is_refused_by_the_schema(filesystem: dict[str, Any]) -> None:
    from tests.apiserver_rules import admit, load_crd

    resource = copy.deepcopy(tier())
    resource["spec"]["tiers"] = [{"name": "fs", "filesystem": filesystem}]
    errors = admit(load_crd("kvcachetier.yaml"), resource)[1]
    assert any(e.startswith("spec.tiers[0].filesystem:") for e in errors), errors


def test_an_allowed_registry_is_a_whole_path() -> None:
    """`allowedRegistries: [registry.corp.example]` allowed the image
    `registry.corp.example.attacker.io/evil`, whose host merely starts so."""
    settings = SETTINGS.model_copy(update={"allowed_registries": ["registry.corp.example"]})
    resource = tier()
    resource["spec"]["agent"] = {"image": "registry.corp.example.attacker.io/evil:1"}
    with pytest.raises(ConfigError, match=r"spec\.agent\.image"):
        build_children(resource, settings)
    resource["spec"]["agent"] = {"image": "registry.corp.example/kvtier:1"}
    assert build_children(resource, settings)


def test_the_injected_container_passes_a_compute_quota() -> None:
    """In a namespace whose ResourceQuota counts CPU and memory (requests and limits), the
    quota's admission, after the webhook, refuses any container that names none: the
    injected init container names both, so the pod is made as it would be without it."""
    after = inject(copy.deepcopy(POD))
    (plugin,) = [c for c in after["spec"]["initContainers"] if c["name"] == "kvtier-plugin"]
    for kind in ("requests", "limits"):
        assert set(plugin["resources"][kind]) >= {"cpu", "memory"}
