"""vLLM engines, one after another in one process: each serves prompts offline with its
own settings and --kv-transfer-config, some passes with vLLM's prefix cache reset in
between, and prints its outputs and cache metrics as one JSON line. Each engine is shut
down before the next starts, so the next has nothing but what kvtier holds. The engine core
runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a core process of its own would
import vLLM afresh for every engine, about three quarters of an engine's start-up here. Runs under
the vLLM environment's Python.

`--runs` is a JSON list of objects: model, kv_transfer_config, prompts (texts, or lists of
token ids, which need no tokenizer), and optionally dtype, block_size, hf_overrides, passes,
max_tokens, logprobs (how many of each output token's top candidates to return, with their
log-probabilities) and kv_transfer_params (what a P/D proxy adds to each request).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from typing import Any


def serve(run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=run["model"],
        block_size=run.get("block_size", 32),
        max_model_len=2048,
        dtype=run.get("dtype", "float32"),
        enforce_eager=True,
        disable_log_stats=False,
        hf_overrides=run.get("hf_overrides"),
        kv_transfer_config=KVTransferConfig(**run["kv_transfer_config"]),
    )
    # What a P/D proxy adds to a decode request: where the prefill side's KV is.
    transfer = run.get("kv_transfer_params")
    extra = {"kv_transfer_params": transfer} if transfer else None
    params = SamplingParams(
        max_tokens=run.get("max_tokens", 16),
        temperature=0.0,
        logprobs=run.get("logprobs"),
        extra_args=extra,
    )
    prompts: list[Any] = [
        p if isinstance(p, str) else TokensPrompt(prompt_token_ids=p) for p in run["prompts"]
    ]
    passes, candidates = [], []
    try:
        for n in range(run.get("passes", 1)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            passes.append([list(o.outputs[0].token_ids) for o in outputs])
            candidates.append([top_candidates(o.outputs[0].logprobs) for o in outputs])
            if n + 1 < run.get("passes", 1):
                llm.reset_prefix_cache()
        metrics = {
            m.name: m.value
            for m in llm.get_metrics()
            if "prefix_cache" in m.name and hasattr(m, "value")
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"passes": passes, "candidates": candidates, "metrics": metrics}


def top_candidates(logprobs: Any) -> list[dict[str, float]]:
    """Per output token, its top candidates' ids (as JSON keys) and log-probabilities;
    empty when the run asked for none."""
    return [{str(t): p.logprob for t, p in step.items()} for step in logprobs or []]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="JSON list of engine runs")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for run in json.loads(args.runs):
        print("RESULT " + json.dumps(serve(run)), flush=True)


if __name__ == "__main__":
    main()
