"""Small randomly initialised models with a locally built word-level tokenizer, saved to a
directory: real models for vLLM to serve offline (no model hub is reachable here).

Three architectures cover what changes the KV path: Llama (grouped-query attention when
kv_heads < heads), Qwen2 (biases on the q/k/v projections) and Mistral (a sliding window,
which vLLM gives its own KV-cache spec).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "mistral")


def _config(arch: str, common: dict[str, Any], sliding_window: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)  # q/k/v projections with bias
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    raise ValueError(f"unknown architecture {arch!r}; one of {ARCHITECTURES}")


def build(
    directory: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    words: int = 400,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 1,
    kv_heads: int = 1,
    intermediate: int = 128,
    dtype: str = "float32",
    max_positions: int = 4096,
    sliding_window: int = 128,
    overwrite: bool = False,
) -> Path:
    """Defaults: tiny enough to start in seconds on a CPU (head size 64, which vLLM's CPU
    attention supports); the GPU check asks for a bigger one. `seed` picks the weights:
    the same shapes with another seed is another model at the same path (`overwrite`)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if (directory / "config.json").exists() and not overwrite:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    torch.manual_seed(seed)
    config = _config(
        arch,
        {
            "vocab_size": -(-(words + 3) // 64) * 64,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": max_positions,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": dtype,
        },
        sliding_window,
    )
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)  # peaky logits: greedy outputs depend on every input
    model.save_pretrained(directory, safe_serialization=True)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
