"""A tiny, randomly initialised Llama with a locally built tokenizer, saved to a directory:
a real model for vLLM to serve offline, small enough to start in seconds on a CPU."""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(400)]


def build(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)  # peaky logits: greedy outputs depend on every input
    model.save_pretrained(directory, safe_serialization=True)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
