"""The Helm chart rendered by the helm binary installed beside the interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvtier"
HELM = str(Path(sys.executable).parent / "helm")


def helm(*args: str) -> str:
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(*args: str) -> list[dict[str, Any]]:
    text = helm(
        "template", "kv", str(CHART), "--namespace", "kvtier-system", "--include-crds", *args
    )
    return [d for d in yaml.safe_load_all(text) if d]
