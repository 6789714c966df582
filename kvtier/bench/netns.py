"""Network namespaces as "nodes": each gets its own address on a private bridge, so agents
reach each other over real interfaces with distinct IPs, as on separate machines (the peer
tests and `kvtier bench peers`).

A namespace `<prefix>-sw` holds the bridge; each node namespace has one end of a veth pair
with its address, the other end is plugged into the bridge. Needs root (`ip netns`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def supported() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _wait_carrier(namespace: str, timeout: float = 10.0) -> None:
    """Until the namespace's eth0 has a carrier: a process started before it (UCX, which
    lists the usable interfaces once) would see only loopback."""
    deadline = time.monotonic() + timeout
    while True:
        state = subprocess.run(
            ["ip", "-n", namespace, "-o", "link", "show", "eth0"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        if "LOWER_UP" in state and "NO-CARRIER" not in state:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{namespace}: eth0 has no carrier: {state}")
        time.sleep(0.05)


@contextmanager
def nodes(count: int, subnet: str = "10.213.0") -> Iterator[list[tuple[str, str]]]:
    """`count` namespaces joined by a bridge: [(namespace, address)], removed afterwards."""
    prefix = f"kvt{os.getpid() % 100000}"
    switch = f"{prefix}-sw"
    made = [switch]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        found = []
        for i in range(1, count + 1):
            ns, address = f"{prefix}-n{i}", f"{subnet}.{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}")
            _ip("-n", ns, "link", "set", f"port{i}", "netns", switch)
            _ip("-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            found.append((ns, address))
        for ns, _ in found:
            _wait_carrier(ns)
        yield found
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def run_in(namespace: str, *command: str) -> list[str]:
    """`command` as run inside `namespace` (a prefix for subprocesses)."""
    return ["ip", "netns", "exec", namespace, *command]
