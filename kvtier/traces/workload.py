"""A synthetic multi-turn chat workload with the shape that makes KV caching pay: a few
system prompts shared by many conversations, and conversations whose prompts grow by each
turn's exchange, so every turn's prompt extends the previous one.

Chunk keys chain like vLLM's block hashes (each key hashes its parent key and its tokens), so
a shared prefix yields shared keys. A chunk's row bytes are derived from its key, which lets
every load be checked byte for byte.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvtier.shm.pool import Bytes

ROOT_KEY = b"\0" * 16


@dataclass(frozen=True)
class WorkloadShape:
    chunk_tokens: int = 256
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (1024, 2048)
    user_tokens: tuple[int, int] = (64, 384)
    reply_tokens: tuple[int, int] = (64, 320)
    vocab: int = 32000


def chunk_keys(tokens: list[int], chunk_tokens: int) -> list[bytes]:
    """Keys of the full chunks of a prompt, each chained to its predecessor."""
    keys = []
    parent = ROOT_KEY
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        block = np.asarray(tokens[start : start + chunk_tokens], dtype=np.int32).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


def row_for(key: bytes, nbytes: int) -> Bytes:
    """The row a chunk holds: its key repeated, so a load can be verified without a copy of
    everything ever stored."""
    pattern = np.frombuffer(key, dtype=np.uint8)
    return np.resize(pattern, nbytes)


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    prompt: list[int]


def conversation_turns(
    shape: WorkloadShape, seed: int, conversations: int, turns: int
) -> Iterator[Turn]:
    """Turns of several conversations, interleaved round-robin as a serving engine sees them."""
    shared = random.Random(0)
    systems = [
        [shared.randrange(shape.vocab) for _ in range(shared.randint(*shape.system_tokens))]
        for _ in range(shape.system_prompts)
    ]
    rng = random.Random(seed)
    histories = [list(systems[rng.randrange(len(systems))]) for _ in range(conversations)]
    for turn in range(turns):
        for conv, history in enumerate(histories):
            history.extend(
                rng.randrange(shape.vocab) for _ in range(rng.randint(*shape.user_tokens))
            )
            yield Turn(conv, turn, list(history))
            history.extend(
                rng.randrange(shape.vocab) for _ in range(rng.randint(*shape.reply_tokens))
            )
