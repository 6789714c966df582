"""`kvtier bench ttft` on a machine with an NVIDIA GPU and the official vllm wheel
(`python e2e/gpu/ttft_check.py [--quick]`): the same engines, prompts, checks and table as on
CPU, with vLLM's own GPU worker (no CPU harness) and a Llama-1B shape in bfloat16 built
locally with random weights (GPU machines here reach no model hub), prompts of 1k to 16k
tokens. Prints the table, writes the JSON to .scratch/bench/ttft-gpu.json and prints it as
the last line (with the kvtier reload at 8k tokens up front); without a GPU it prints why it
was skipped and exits 0. Unattended in well under 8 minutes on one H200 (most of it is four
engine start-ups and building the model).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def gpu_available() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm is not installed"
    return None


def main() -> int:
    reason = gpu_available()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 0
    # The engines and the agent run as child processes: they import kvtier from this tree.
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    from kvtier.bench import ttft, vllm_ttft

    quick = "--quick" in sys.argv[1:]
    result = {
        "benchmark": "ttft",
        "quick": quick,
        **vllm_ttft.run(quick, gpu=True, agent_python=os.environ.get("KVTIER_AGENT_PYTHON")),
    }
    try:
        from rich.console import Console

        ttft.render(result, Console(width=100))
    except ImportError:
        print(ttft.plain_table(result))
    out = REPO / ".scratch" / "bench" / "ttft-gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    at_8k = {(r["tokens"], r["way"]): r for r in result["rows"]}.get((8192, ttft.KVTIER))
    if at_8k is not None:
        result = {
            "ttft_kvtier_reload_s": at_8k["ttft_p50_s"],
            "speedup_vs_recompute": at_8k["speedup_vs_recompute"],
            **result,
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
