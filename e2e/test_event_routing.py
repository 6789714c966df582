"""A router fed by the agents' KV event streams places each request on the node that holds
its prefix, and the engine there hits. Two agents stand in for two nodes (no shared tier:
a node holds only what its own engines stored); each publishes its stream and names it in
its report (KVCacheNode status.events, here the registry's file), where the router finds it.
The router is written as llm-d's is: it subscribes to every node's stream (vLLM's own event
classes decode it), computes each request's block hashes from its tokens with vLLM's
hashing, and sends the request to the node whose stream shows the longest cached prefix.
Real vLLM engines (CPU) warm one prompt family on each node, then serve each family's
follow-up where the router sends it. Runs under the vLLM environment (`make e2e`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from e2e.engines import HITS, REPO, kv_config, run_engines
from kvtier.api.config import AgentConfig
from kvtier.local.agent import AgentProcess
from kvtier.local.engines.tiny_model import build
from kvtier.local.wait import wait_for

BLOCK = 32  # the engines' block size, one offloaded chunk each
CACHED = 10  # full blocks a follow-up shares with its family's first prompt


def family(seed: int) -> tuple[list[int], list[int]]:
    """A prompt and its follow-up: the same first CACHED blocks, different tails (token ids
    of the tiny model's word-level vocabulary, w0..w399 are 3..402)."""
    shared = [3 + (i * 7 + seed * 131) % 400 for i in range(CACHED * BLOCK)]
    first = shared + [3 + (i * 11 + seed) % 400 for i in range(20)]
    follow = shared + [3 + (i * 17 + seed * 3) % 400 for i in range(2 * BLOCK + 5)]
    return first, follow


def node(make_config: Callable[..., AgentConfig], scratch: Path, name: str) -> AgentConfig:
    return make_config(
        {
            "name": name,
            "runDir": str(scratch / f"run-{name}"),
            "report": {
                "target": "file",
                "directory": str(scratch / "registry"),
                "node": name,
                "intervalSeconds": 0.5,
                "minIntervalSeconds": 0.2,
            },
            "events": {
                "enabled": True,
                "bind": "tcp://127.0.0.1:*",  # the ports chosen are read from the report
                "replayBind": "tcp://127.0.0.1:*",
            },
        },
        poolDir=str(scratch / f"pool-{name}"),
        capacity="48Mi",
        chunkBytes="64Ki",
    )


class Router:
    """What each node's stream shows it holds (any medium), and the node to send a request
    to. Joins as a vLLM-format subscriber does: SUB, then a replay from sequence 0, which
    an agent answers with its holdings."""

    def __init__(self, streams: dict[str, dict[str, Any]]) -> None:
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        self._types = (AllBlocksCleared, BlockRemoved, BlockStored)
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._ctx = zmq.Context()
        self.held: dict[str, set[int]] = {n: set() for n in streams}
        self._subs: dict[str, zmq.Socket[bytes]] = {}
        for name, stream in streams.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(stream["endpoint"])
            self._subs[name] = sub
            time.sleep(0.2)
            replay = self._ctx.socket(zmq.DEALER)
            replay.connect(stream["replayEndpoint"])
            replay.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert replay.poll(10_000), f"{name}'s replay socket did not answer"
                _, _, seq, payload = replay.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                self._apply(name, payload)
            replay.close(0)

    def _apply(self, name: str, payload: bytes) -> None:
        cleared, removed, stored = self._types
        for event in self._decode(payload).events:
            if isinstance(event, cleared):
                self.held[name].clear()
            elif isinstance(event, stored):
                self.held[name].update(event.block_hashes)
            elif isinstance(event, removed):
                self.held[name].difference_update(event.block_hashes)

    def read(self) -> None:
        for name, sub in self._subs.items():
            while sub.poll(100):
                _, _, payload = sub.recv_multipart()
                self._apply(name, payload)

    def cached(self, name: str, hashes: list[int]) -> int:
        """Blocks of the request's prefix the node holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.held[name]:
            n += 1
        return n

    def route(self, hashes: list[int]) -> str:
        self.read()
        return max(self.held, key=lambda name: self.cached(name, hashes))

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close(0)
        self._ctx.term()


def block_hashes(tokens: list[int], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The request's block hashes as vLLM computes them (sha256, NONE_HASH from the engines'
    PYTHONHASHSEED), as the 64-bit integers its KV events carry."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # what run_engines gives the engines
    kv_cache_utils.init_none_hash(sha256)
    out: list[int] = []
    parent = None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start : start + BLOCK])
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))  # vLLM's int hashes
    return out


@pytest.mark.timeout(900)  # four engine start-ups in two processes, about two minutes
def test_a_request_routed_by_the_event_streams_hits_where_they_show_its_prefix(
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = str(build(REPO / ".scratch" / "tiny-llama"))
    configs = {name: node(make_config, scratch, name) for name in ("node-a", "node-b")}
    for config in configs.values():
        agent_factory(config)

    def reported() -> dict[str, dict[str, Any]] | None:
        records = [json.loads(p.read_text()) for p in (scratch / "registry").glob("*.json")]
        streams = {r["node"]: r["status"].get("events") for r in records}
        return streams if len(streams) == 2 and all(streams.values()) else None

    streams = wait_for(
        reported, 20, "both reports name a stream"
    )  # where a router finds them: the nodes' reports
    assert all(s["endpoint"].startswith("tcp://127.0.0.1:") for s in streams.values())

    (first_a, follow_a), (first_b, follow_b) = family(1), family(2)
    warm = run_engines(
        [
            {"model": model, "kv_transfer_config": kv_config(configs[n]), "prompts": [p]}
            for n, p in (("node-a", first_a), ("node-b", first_b))
        ]
    )
    assert all(r["metrics"][HITS] == 0 for r in warm.results)  # nothing cached before

    router = Router(streams)
    try:
        requests = {
            "a": block_hashes(follow_a, monkeypatch),
            "b": block_hashes(follow_b, monkeypatch),
        }
        # the stores are written back after each request ends: wait until both show
        wait_for(
            lambda: (
                router.route(requests["a"]) == "node-a"
                and router.cached("node-a", requests["a"]) >= CACHED
                and router.cached("node-b", requests["b"]) >= CACHED
            ),
            20,
            "both streams show their node's prompt",
        )
        routes = {r: router.route(h) for r, h in requests.items()}
        scores = {r: {n: router.cached(n, h) for n in configs} for r, h in requests.items()}
    finally:
        router.close()
    assert routes == {"a": "node-a", "b": "node-b"}
    assert scores == {"a": {"node-a": CACHED, "node-b": 0}, "b": {"node-a": 0, "node-b": CACHED}}

    served = run_engines(
        [
            {"model": model, "kv_transfer_config": kv_config(configs[routes[r]]), "prompts": [p]}
            for r, p in (("a", follow_a), ("b", follow_b))
        ]
    )
    hits = [result["metrics"][HITS] for result in served.results]
    print(f"routes {routes}, blocks cached per node {scores}, prefix tokens hit {hits}")
    assert hits == [CACHED * BLOCK] * 2  # what the stream showed: the shared blocks, all
