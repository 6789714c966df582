"""A small randomly initialised Llama with a locally built word-level tokenizer, saved to a
directory: a real model for vLLM to serve offline (no model hub is reachable here)."""

from __future__ import annotations

import sys
from pathlib import Path


def build(
    directory: Path,
    *,
    words: int = 400,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 1,
    kv_heads: int = 1,
    intermediate: int = 128,
    dtype: str = "float32",
    max_positions: int = 4096,
) -> Path:
    """Defaults: tiny enough to start in seconds on a CPU (head size 64, which vLLM's CPU
    attention supports); the GPU check asks for a bigger one."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=-(-(words + 3) // 64) * 64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)  # peaky logits: greedy outputs depend on every input
    model.save_pretrained(directory, safe_serialization=True)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
