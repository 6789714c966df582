"""One vLLM engine of the P/D scenario (e2e/test_peer_pd.py): serves its prompts offline,
each request carrying the `kv_transfer_params` a P/D proxy gives the decode side, and prints
its outputs and cache metrics as one JSON line. Runs under the vLLM environment's Python,
inside the network namespace of its node."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def serve(run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=run["model"],
        block_size=32,
        max_model_len=2048,
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**run["kv_transfer_config"]),
    )
    # What a P/D proxy adds to the decode request: where the prefill side's KV is.
    extra = (
        {"kv_transfer_params": run["kv_transfer_params"]} if run.get("kv_transfer_params") else None
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, extra_args=extra)
    try:
        outputs = llm.generate(run["prompts"], params, use_tqdm=False)
        metrics = {
            m.name: m.value
            for m in llm.get_metrics()
            if "prefix_cache" in m.name and hasattr(m, "value")
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True, help="JSON engine run")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    print("RESULT " + json.dumps(serve(json.loads(args.run))), flush=True)


if __name__ == "__main__":
    main()
