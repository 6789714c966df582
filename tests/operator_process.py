"""`kvtier operator` as its own process against an API server (emulated or real), as the
chart's Deployment runs it, for the operator tests and the conformance suite."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtier.local import wait as polling
from tests.conftest import free_port, wait_port

IMAGE = "registry.local/kvtier:test"


@contextlib.contextmanager
def running_operator(
    kubeconfig: Path, directory: Path, namespaces: tuple[str, ...] = ()
) -> Iterator[int]:
    """Runs the operator (every namespace, or only `namespaces`) with one-second timers;
    yields its webhook port. Its log is `directory/operator.log`."""
    with operator_process(kubeconfig, directory, namespaces) as (_, webhook_port):
        yield webhook_port


@contextlib.contextmanager
def operator_process(
    kubeconfig: Path,
    directory: Path,
    namespaces: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    log_name: str = "operator.log",
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """As `running_operator`, with more environment (`env`), yielding the process too, for
    tests that stop it themselves (SIGTERM as a pod's deletion sends it, or SIGKILL); it is
    stopped with SIGTERM at the end if still running."""
    webhook_port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "KVTIER_RECONCILE_INTERVAL_SECONDS": "1",
        "KVTIER_STATUS_INTERVAL_SECONDS": "1",
        "KVTIER_WEBHOOK_PORT": str(webhook_port),
        "KVTIER_IMAGE": IMAGE,
        **(env or {}),
    }
    args = [str(Path(sys.executable).parent / "kvtier"), "operator"]
    args += ["--health-port", str(free_port())]
    for namespace in namespaces:
        args += ["--namespace", namespace]
    with open(directory / log_name, "w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=directory)
        try:
            wait_port(webhook_port)
            yield proc, webhook_port
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(30)


def wait_for(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Polls `check` until it returns something true, which it returns."""
    return polling.wait_for(check, timeout, interval=0.1)
