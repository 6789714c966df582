"""The GPU check script runs anywhere: with a GPU it measures, without one it says why not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "gpu" / "ttft_check.py"


def test_gpu_check_reports_skip_or_figures() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skipped" in result:
        assert result["skipped"] in {
            "no CUDA GPU",
            "torch is not installed",
            "vllm is not installed",
        }
    else:
        assert result["ttft_kvtier_reload_s"] > 0 and result["speedup_vs_recompute"] > 0
