"""One vLLM engine process: serve prompts offline with a given --kv-transfer-config, some
passes with vLLM's prefix cache reset in between, and print outputs and cache metrics as
JSON. Runs under the vLLM environment's Python."""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-transfer-config", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of prompts")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=args.model,
        block_size=32,
        max_model_len=2048,
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**json.loads(args.kv_transfer_config)),
    )
    prompts = json.loads(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    passes = []
    for n in range(args.passes):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        passes.append([list(o.outputs[0].token_ids) for o in outputs])
        if n + 1 < args.passes:
            llm.reset_prefix_cache()
    metrics = {
        m.name: m.value
        for m in llm.get_metrics()
        if "prefix_cache" in m.name and hasattr(m, "value")
    }
    print("RESULT " + json.dumps({"passes": passes, "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
