"""Reloaded KV gives the same greedy tokens as recomputed KV, as vLLM's offloading CI
checks: a fixed set of prompts, for three architectures (grouped-query attention, q/k/v
biases, a sliding window) in two dtypes, through kvtier with the injected (canonical)
layout. For each, one engine computes and stores, a fresh engine reloads; the first is the
recompute reference. Runs under the vLLM environment (`make e2e`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.engines import HITS, kv_config, run_engines
from kvtier.api.config import AgentConfig
from kvtier.local.agent import AgentProcess
from kvtier.local.engines.tiny_model import ARCHITECTURES, build

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
# Shapes per architecture: head size 64 (what vLLM's CPU attention supports); Llama with
# 4 query heads over 2 KV heads; Mistral's window shorter than every prompt.
SHAPES = {
    "llama": {"hidden": 256, "heads": 4, "kv_heads": 2},
    "qwen2": {"hidden": 128, "heads": 2, "kv_heads": 1},
    "mistral": {"hidden": 128, "heads": 2, "kv_heads": 2, "sliding_window": 96},
}


def prompt(length: int, stride: int, start: int = 0) -> list[int]:
    """Token ids of the tiny models' words (ids 3..402): no tokenizer in the way (vLLM
    loads Qwen2's own tokenizer class for a Qwen2 config, whatever the directory holds)."""
    return [3 + (start + i * stride) % 400 for i in range(length)]


# Held fixed: lengths across block boundaries (32-token blocks), two sharing a prefix.
PROMPTS = [
    prompt(100, 3),
    prompt(200, 7, 5),
    prompt(200, 7, 5) + prompt(60, 11),
    prompt(330, 13, 1),
]
MAX_TOKENS = 24


@pytest.mark.timeout(2400)
def test_reload_gives_the_tokens_of_recompute(
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
) -> None:
    agent = make_config(capacity="96Mi", chunkBytes="128Ki")
    agent_factory(agent)
    runs, cases = [], []
    for arch in ARCHITECTURES:
        model = build(REPO / ".scratch" / f"accuracy-{arch}", arch=arch, **SHAPES[arch])
        for dtype in DTYPES:
            run = {
                "model": str(model),
                "dtype": dtype,
                "kv_transfer_config": kv_config(agent),
                "prompts": PROMPTS,
                "max_tokens": MAX_TOKENS,
            }
            runs += [run, run]  # recompute (and store), then reload in a fresh engine
            cases.append(f"{arch}/{dtype}")
    results = run_engines(runs, timeout=2400).results

    for case, recompute, reload in zip(cases, results[::2], results[1::2], strict=True):
        tokens = sum(map(len, recompute["passes"][0]))
        print(f"{case}: {reload['metrics'][HITS]:.0f} prompt tokens reloaded, {tokens} compared")
        assert reload["metrics"][HITS] > 0, case  # the reload really loaded
        assert reload["passes"][0] == recompute["passes"][0], case
        # a random-weight model may end an output at EOS: the comparison must still cover
        # most of the tokens asked for, not be emptied by it
        assert tokens >= 3 * MAX_TOKENS * len(PROMPTS) // 4, case
