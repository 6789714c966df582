"""Synthetic Mooncake-format traces for `kvtier replay`, reproducible from a seed.

`multi_turn` has the shape of ShareGPT chats served behind a few system prompts: new
conversations arrive at random, each runs for a number of turns (geometric, about three on
average, as in ShareGPT V3), a turn adds a user message and then the reply to the history,
and the user thinks between turns. A turn's prompt is the whole history, so its full blocks
repeat the previous turn's; the last, partial block is new each turn (its tokens change).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChatShape:
    block_size: int = 512
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (300, 2500)
    user_tokens_median: float = 80.0  # log-normal, as ShareGPT's message lengths
    reply_tokens_median: float = 250.0
    mean_turns: float = 3.3
    arrivals_per_s: float = 3.0  # new conversations
    think_s: float = 60.0  # mean pause between a reply and the next user message


def _lognormal(rng: random.Random, median: float, sigma: float = 0.9) -> int:
    return max(1, int(rng.lognormvariate(math.log(median), sigma)))


def multi_turn(
    seed: int, conversations: int, shape: ChatShape = ChatShape()
) -> list[dict[str, Any]]:
    """Records (`timestamp` ms, `input_length`, `hash_ids`) sorted by arrival."""
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    systems = [
        (rng.randint(*shape.system_tokens), [next(next_id) for _ in range(8)])
        for _ in range(shape.system_prompts)
    ]
    records: list[dict[str, Any]] = []
    start = 0.0
    for _ in range(conversations):
        start += rng.expovariate(shape.arrivals_per_s)
        system_tokens, system_ids = systems[rng.randrange(len(systems))]
        full = system_tokens // shape.block_size
        ids = list(system_ids[:full])  # full blocks shared with every chat behind the prompt
        length = system_tokens
        now = start
        turns = 1 + int(rng.expovariate(1 / max(shape.mean_turns - 1, 1e-9)))
        for _turn in range(turns):
            length += _lognormal(rng, shape.user_tokens_median)
            while len(ids) < length // shape.block_size:
                ids.append(next(next_id))
            partial = [next(next_id)] if length % shape.block_size else []
            records.append(
                {"timestamp": int(now * 1000), "input_length": length, "hash_ids": ids + partial}
            )
            reply = _lognormal(rng, shape.reply_tokens_median)
            length += reply
            now += reply / 50 + rng.expovariate(1 / shape.think_s)  # decode, then think
    records.sort(key=lambda r: r["timestamp"])
    return records


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    """Records as Mooncake-format JSONL at `path` (gzip when it ends in .gz)."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path
