"""Pod Security Standards, as the API server's PodSecurity admission applies them, for
holding kvtier's pods to them without a cluster. Written from Kubernetes' documentation
("Pod Security Standards", policies `baseline` and `restricted`, latest version): each check
names the documented control it implements. Windows-only and annotation-era controls that
kvtier never touches (hostProcess, AppArmor annotations) are checked as fields only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Spec = dict[str, Any]

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def _containers(spec: Spec) -> Iterator[tuple[str, Spec]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            yield f"{kind}[{container.get('name')}]", container


def baseline(spec: Spec) -> list[str]:
    """Violations of the `baseline` policy by a pod spec."""
    found = []
    pod_sc = spec.get("securityContext") or {}
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("HostProcess: securityContext.windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"Host Namespaces: {field}")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            found.append(f"HostPath Volumes: volumes[{volume.get('name')}]")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"Sysctls: {sysctl.get('name')}")
    found += _selinux("securityContext", pod_sc)
    found += _seccomp_not_unconfined("securityContext", pod_sc)
    if (pod_sc.get("appArmorProfile") or {}).get("type") not in (
        None,
        "RuntimeDefault",
        "Localhost",
    ):
        found.append("AppArmor: securityContext.appArmorProfile")
    for where, container in _containers(spec):
        sc = container.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"HostProcess: {where}")
        if sc.get("privileged"):
            found.append(f"Privileged Containers: {where}")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            found.append(f"Capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"Host Ports: {where}")
        if sc.get("procMount") not in (None, "Default"):
            found.append(f"/proc Mount Type: {where}")
        if (sc.get("appArmorProfile") or {}).get("type") not in (
            None,
            "RuntimeDefault",
            "Localhost",
        ):
            found.append(f"AppArmor: {where}")
        found += _selinux(where, sc)
        found += _seccomp_not_unconfined(where, sc)
    return found


def _selinux(where: str, sc: Spec) -> list[str]:
    options = sc.get("seLinuxOptions") or {}
    if options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role"):
        return [f"SELinux: {where}.seLinuxOptions"]
    return []


def _seccomp_not_unconfined(where: str, sc: Spec) -> list[str]:
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        return [f"Seccomp: {where} is Unconfined"]
    return []


def restricted(spec: Spec) -> list[str]:
    """Violations of the `restricted` policy (which includes `baseline`) by a pod spec."""
    found = baseline(spec)
    pod_sc = spec.get("securityContext") or {}
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"Volume Types: volumes[{volume.get('name')}] is {sorted(kinds)}")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in (
        "RuntimeDefault",
        "Localhost",
    )
    if pod_sc.get("runAsUser") == 0:
        found.append("Running as Non-root user: securityContext.runAsUser is 0")
    for where, container in _containers(spec):
        sc = container.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"Privilege Escalation: {where} must set allowPrivilegeEscalation false")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot")):
            found.append(f"Running as Non-root: {where}")
        if sc.get("runAsUser") == 0:
            found.append(f"Running as Non-root user: {where} runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (seccomp in ("RuntimeDefault", "Localhost") or (seccomp is None and pod_seccomp)):
            found.append(f"Seccomp: {where} needs RuntimeDefault or Localhost")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"Capabilities: {where} must drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"Capabilities: {where} may add only NET_BIND_SERVICE")
    return found


LEVELS = {"baseline": baseline, "restricted": restricted}
