"""TTFT with kvtier reload vs recompute, on a machine with an NVIDIA GPU and the official
vllm wheel (`python e2e/gpu/ttft_check.py`). Prints JSON; without a GPU it prints why it
was skipped and exits 0.

One engine serves a model with the injected kvtier config (no CPU harness: vLLM's own
offloading worker). An 8k-token prompt is sent, vLLM's prefix cache and its own host tier
are reset, and the prompt is sent again: the second prefill loads from the node agent. A
fresh prompt of the same length measures recompute. The model is built locally (random
weights, Llama-1B shape), since GPU machines here reach no model hub.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
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


def ttft(llm: object, prompt: str) -> float:
    from vllm import SamplingParams

    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # type: ignore[attr-defined]
    return time.perf_counter() - started


def main() -> int:
    reason = gpu_available()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 0
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.api.transfer_config import build_kv_transfer_config
    from kvtier.local.agent import AgentProcess, scratch_config

    os.environ.setdefault("PYTHONHASHSEED", "0")
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-gpu-", dir="/dev/shm"))
    try:
        from kvtier.local.engines.tiny_model import build

        model = build(
            scratch / "model",
            words=8000,
            hidden=2048,
            layers=16,
            heads=16,
            kv_heads=4,
            intermediate=5632,
            dtype="bfloat16",
            max_positions=16384,
        )
        agent = scratch_config(scratch, "gpu", "8Gi", "8Mi")
        kv = build_kv_transfer_config(agent, cpu_bytes_to_use=2 << 30)
        with AgentProcess(agent, python=os.environ.get("KVTIER_AGENT_PYTHON")):
            llm = LLM(
                model=str(model),
                max_model_len=16384,
                enforce_eager=True,
                kv_transfer_config=KVTransferConfig(**kv),
            )
            words = [f"w{(i * 37) % 8000}" for i in range(8192)]
            prompt, other = " ".join(words), " ".join(reversed(words))
            ttft(llm, "w1 w2 w3")  # warm-up
            cold = ttft(llm, prompt)
            time.sleep(2)  # let the stores reach the agent
            llm.reset_prefix_cache(reset_connector=True)
            reload = ttft(llm, prompt)
            recompute = ttft(llm, other)
        print(
            json.dumps(
                {
                    "prompt_tokens": len(words),
                    "ttft_cold_s": cold,
                    "ttft_kvtier_reload_s": reload,
                    "ttft_recompute_s": recompute,
                    "speedup_vs_recompute": recompute / reload,
                }
            )
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
