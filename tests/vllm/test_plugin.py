"""kvtier loaded by vLLM's own TieringOffloadingSpec, through the injected config."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtier.api.config import AgentConfig
from kvtier.api.fingerprint import differing_components
from kvtier.bench.vllm_scheduler import ROW, Engine, chunk_key, chunk_row
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from kvtier.vllm.tier import KVTierSecondaryTier
from tests.vllm.conftest import engine_of

HIT, MISS, RETRY, PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)
MakeEngine = Callable[..., Engine]
StartAgent = Callable[[AgentConfig], AgentProcess]


def test_factory_loads_the_tier_from_the_injected_config(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent_factory(agent_config)
    engine = engines(agent_config)
    tier_config = engine.extra_config["secondary_tiers"][0]
    assert SecondaryTierFactory.get_tier_class(tier_config) is KVTierSecondaryTier
    assert isinstance(engine.tier, KVTierSecondaryTier)


def test_store_reset_lookup_promote_byte_identical(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent_factory(agent_config)
    engine = engines(agent_config)
    ids = list(range(6))
    engine.store(ids)
    with AgentClient(agent_config.endpoint) as client:
        assert client.stats().host.chunks == 6
    engine.reset_primary()
    answers, trace = engine.lookup(ids)
    # host hits are answered in the first scheduler step, from the index the agent
    # publishes, and promotion into vLLM's buffer starts at once
    assert trace[0] == [PENDING] * 6
    assert answers == [HIT] * 6
    for i, row in zip(ids, engine.read(ids), strict=True):
        assert np.array_equal(row, chunk_row(i))


def test_two_engines_share_chunks_through_one_agent(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent_factory(agent_config)
    first, second = engines(agent_config), engines(agent_config)
    first.store([10, 11, 12])
    answers, _ = second.lookup([10, 11, 12, 13])
    assert answers == [HIT, HIT, HIT, MISS]
    assert all(
        np.array_equal(row, chunk_row(i))
        for i, row in zip([10, 11, 12], second.read([10, 11, 12]), strict=True)
    )


def test_other_fingerprint_gets_no_hits_and_is_reported(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent_factory(agent_config)
    fp16, bf16 = engines(agent_config), engines(agent_config, dtype="bfloat16")
    fp16.store([1, 2])
    answers, _ = bf16.lookup([1, 2])
    assert answers == [MISS, MISS]
    bf16.store([3])
    with AgentClient(agent_config.endpoint) as client:
        namespaces = client.stats().host.namespaces
    assert sorted(namespaces.values()) == [1, 2]
    assert set(namespaces) == {fp16.tier.namespace, bf16.tier.namespace}
    # what `kubectl kvtier explain-miss` reports: same model, other KV-cache dtype
    assert differing_components(list(namespaces)) == ["dtype"]


def test_namespace_isolation_separates_engines(
    agent_config: AgentConfig, agent_factory: StartAgent, vllm_config: Any
) -> None:
    from kvtier.bench.vllm_scheduler import kvtier_extra_config

    agent_factory(agent_config)
    made = []
    for scope in ("team-a", "team-b"):
        extra = kvtier_extra_config(agent_config, 16)
        extra["secondary_tiers"][0]["scope"] = scope
        made.append(engine_of(vllm_config, extra))
    try:
        made[0].store([7])
        assert made[1].lookup([7])[0] == [MISS]
        assert made[0].tier.namespace != made[1].tier.namespace
    finally:
        for engine in made:
            engine.close()


def test_agent_killed_mid_job_then_restarted(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent = agent_factory(agent_config)
    engine = engines(agent_config, timeout_seconds=0.5)
    engine.store([1, 2, 3])
    engine.reset_primary()
    agent.kill()
    started = time.monotonic()
    answers, _ = engine.lookup([1, 2, 3])
    assert answers == [MISS] * 3  # a miss, promptly, and no exception into vLLM
    assert time.monotonic() - started < 10
    engine.store([4])  # the cascade to kvtier fails cleanly; vLLM's own tier keeps it
    assert engine.lookup([4])[0] == [HIT]

    agent_factory(agent_config)  # same pool file: the restarted agent re-indexes it
    engine.reset_primary()
    answers, _ = engine.lookup([1, 2, 3])
    assert answers == [HIT] * 3
    assert all(
        np.array_equal(row, chunk_row(i))
        for i, row in zip([1, 2, 3], engine.read([1, 2, 3]), strict=True)
    )


def collect_events(engine: Engine, want: int, timeout: float = 30.0) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + timeout
    while sum(len(e.keys) for e in events) < want and time.monotonic() < deadline:
        engine.step()
        events += engine.tier.take_events()
        time.sleep(0.05)
    return events


def test_kv_events_report_the_whole_nodes_stores_and_evictions(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent_factory(agent_config)
    engine, neighbour = engines(agent_config), engines(agent_config)
    engine.store([1, 2])
    neighbour.store([3])  # another engine on the node: its chunk is news to this one too
    stored = collect_events(engine, 3)
    assert sorted(bytes(k) for e in stored for k in e.keys) == sorted(
        bytes(chunk_key(i)) for i in (1, 2, 3)
    )
    assert all(e.medium is Medium.CPU and not e.removed for e in stored)
    with AgentClient(agent_config.endpoint) as client:  # fill the pool: 1, 2, 3 go
        slots = client.stats().host.slots
        client.store(
            engine.tier.namespace,
            [b"filler-%d" % i for i in range(slots)],
            [np.zeros(engine.row, np.uint8)] * slots,
        )
    events = collect_events(engine, slots + 3)
    removed = {bytes(k) for e in events if e.removed for k in e.keys}
    assert removed == {bytes(chunk_key(i)) for i in (1, 2, 3)}


def test_store_jobs_report_bytes(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    agent_factory(agent_config)
    engine = engines(agent_config)
    engine.store([1, 2])
    stats = engine.tier.get_stats()
    assert stats is not None
    values = stats.data["data"]
    assert values["vllm:kvtier_store_bytes"][()] == 2 * engine.rows.shape[1]
    assert values["vllm:kvtier_agent_available"][()] == 1.0


def test_direct_mode_from_kv_transfer_params(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    scratch: Path,
    vllm_config: Any,
) -> None:
    """P/D: the decode engine's request names the prefill node's agent in its
    kv_transfer_params; the decode node's agent fetches the chunks from it."""
    import json

    from kvtier.bench.vllm_scheduler import kvtier_extra_config

    def node(name: str) -> AgentConfig:
        return make_config(
            {
                "name": name,
                "runDir": str(scratch / f"run-{name}"),
                "tiers": [{"name": "peers", "peer": {"bind": "tcp://127.0.0.1:*"}}],
                "report": {
                    "target": "file",
                    # one registry for the tier: a source is asked only if it is a member
                    "directory": str(scratch / "registry"),
                    "node": name,
                    "intervalSeconds": 0.5,
                    "minIntervalSeconds": 0.2,
                },
            },
            chunkBytes=ROW,
            poolDir=str(scratch / f"pool-{name}"),
        )

    prefill_agent, decode_agent = node("prefill"), node("decode")
    agent_factory(prefill_agent)
    agent_factory(decode_agent)
    source = json.loads((scratch / "registry" / "prefill.json").read_text())["endpoint"]
    prefill = engine_of(vllm_config, kvtier_extra_config(prefill_agent, 16))
    decode = engine_of(vllm_config, kvtier_extra_config(decode_agent, 16))
    try:
        prefill.store([1, 2, 3])
        time.sleep(0.5)  # the prefill agent seals the chunks (checksums travel with them)
        answers, _ = decode.lookup([1, 2, 3], params={"kvtier_source": source})
        assert answers == [HIT] * 3
        assert all(
            np.array_equal(r, chunk_row(i))
            for i, r in zip([1, 2, 3], decode.read([1, 2, 3]), strict=True)
        )
    finally:
        prefill.close()
        decode.close()


def test_stores_name_each_chunks_predecessor(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    """From the end-token positions vLLM records per request: the chunk before each stored
    one in the same request and KV group, also across lookups and earlier stores."""
    from vllm.v1.kv_offload.base import make_offload_key

    agent_factory(agent_config)
    tier = engines(agent_config).tier
    assert isinstance(tier, KVTierSecondaryTier)

    class Request:
        req_id = "r1"

        def __init__(self) -> None:
            self.positions: dict[bytes, int] = {}

        def get_offload_key_position(self, key: bytes) -> int | None:
            return self.positions.get(bytes(key))

    request = Request()
    keys = [make_offload_key(b"h%d" % i, 0) for i in range(5)]
    other_group = make_offload_key(b"h9", 1)
    for i, k in enumerate(keys):
        request.positions[bytes(k)] = 16 * (i + 1)
    request.positions[bytes(other_group)] = 8
    parents = tier._chains.parents
    assert parents([bytes(keys[0]), bytes(keys[1])], request) == [None, bytes(keys[0])]
    # A later store of the same request: its first chunk follows the last one seen.
    assert parents([bytes(k) for k in keys[2:]], request) == [bytes(k) for k in keys[1:4]]
    assert parents([bytes(other_group)], request) is None
    tier.on_request_finished(request)  # type: ignore[arg-type]
    assert parents([bytes(keys[3])], request) is None  # forgotten, nothing before
    assert parents([bytes(keys[4])], request) == [bytes(keys[3])]


def test_kv_events_name_every_tier_and_the_node_as_owner(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    engines: MakeEngine,
    scratch: Path,
) -> None:
    """A chunk written back to the node's filesystem tier reaches vLLM as a STORAGE event
    beside the pool's CPU one; both carry the node as `ownership` (vLLM 0.32 and 0.33 have
    the field), so a router counts one owner for every engine on the node."""
    from vllm.v1.kv_offload.base import Locality

    config = make_config(
        {
            "tiers": [
                {"name": "fs", "filesystem": {"path": str(scratch / "fs"), "capacity": "16Mi"}}
            ],
            "report": {"node": "node-a"},
        },
        chunkBytes=ROW,
    )
    agent_factory(config)
    engine = engines(config)
    engine.store([1, 2])
    want = {bytes(chunk_key(i)) for i in (1, 2)}
    expected = {(Medium.CPU, Locality.LOCAL): want, (Medium.STORAGE, Locality.LOCAL): want}
    events: list[Any] = []
    by_medium: dict[Any, set[bytes]] = {}
    deadline = time.monotonic() + 30.0
    while by_medium != expected and time.monotonic() < deadline:  # the fs tier writes behind
        events += collect_events(engine, 1, timeout=1.0)
        by_medium = {}
        for e in events:
            if not e.removed:
                by_medium.setdefault((e.medium, e.locality), set()).update(map(bytes, e.keys))
    assert by_medium == expected
    assert {e.ownership for e in events} == {"node-a"}
