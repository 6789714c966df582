"""TTFT with kvtier reload vs recompute, on a machine with an NVIDIA GPU and the official
vllm wheel (`python e2e/gpu/ttft_check.py`). Prints JSON; without a GPU it prints why it
was skipped and exits 0.

One engine serves a model with the injected kvtier config (no CPU harness: vLLM's own
offloading worker). An 8k-token prompt is sent, vLLM's prefix cache and its own host tier
are reset, and the prompt is sent again: the second prefill loads from the node agent. A
fresh prompt of the same length measures recompute. The model is built locally (random
weights, Llama shape), since GPU machines here reach no model hub.
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


def build_model(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(8000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


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

    from kvtier.agent.config import parse_config
    from kvtier.agent.process import AgentProcess
    from kvtier.agent.transfer_config import build_kv_transfer_config

    os.environ.setdefault("PYTHONHASHSEED", "0")
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-gpu-", dir="/dev/shm"))
    try:
        model = build_model(scratch / "model")
        agent = parse_config(
            {
                "name": "gpu",
                "runDir": str(scratch / "run"),
                "host": {"capacity": "8Gi", "chunkBytes": "8Mi", "poolDir": str(scratch / "pool")},
                "metrics": {"enabled": False},
            }
        )
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
