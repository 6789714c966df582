"""The prefix-aware policy: leaves first, least hit density first, admission control, ARC
until parents are known, and never worse than LRU where LRU is at its best or a scan floods
the pool."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.agent.host.index import HostIndex
from kvtier.agent.host.policy import ARCPolicy, PrefixPolicy, make_policy
from kvtier.agent.host.policy.prefix import _class
from kvtier.api.config import AgentConfig
from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient, AgentRefused
from kvtier.local.agent import AgentProcess
from kvtier.traces.replay import load_trace, replay
from kvtier.traces.tracegen import multi_turn
from kvtier.traces.tracegen import write as write_trace
from tests.conftest import ROW
from tests.helpers import key

NS = "ns"


def always(_chunk: object) -> bool:
    return True


def store(index: HostIndex, keys: list[bytes], parents: list[bytes | None] | None) -> None:
    lease = index.allocate("c", NS, keys, 1, 1e18, parents)[0]
    if lease:
        index.commit(lease, "c")


def chain(keys: list[bytes]) -> list[bytes | None]:
    return [None, *keys[:-1]]


def test_evicts_leaves_before_their_prefix() -> None:
    policy = PrefixPolicy(4)
    index = HostIndex(4, policy)
    store(index, [b"a", b"b", b"c"], chain([b"a", b"b", b"c"]))
    store(index, [b"x"], [None])
    index.lookup(NS, [b"x"])
    index.touch()
    # a is the oldest and as little used as b and c, but c and then b depend on it.
    assert policy.evict(always) == (NS, b"c")
    assert policy.evict(always) == (NS, b"b")
    assert policy.evict(always) == (NS, b"a")
    assert policy.evict(always) == (NS, b"x")


def test_shared_head_outlives_one_off_prompts() -> None:
    policy = PrefixPolicy(8)
    index = HostIndex(8, policy)
    for i in range(40):
        tail = b"t%d" % i
        _hits, prefix = index.lookup(NS, [b"sys", tail])
        index.touch()
        keys = [b"sys", tail][prefix:]
        store(index, keys, chain([b"sys", tail])[prefix:])
    assert index.get(NS, b"sys") is not None
    assert policy.describe()["tree"] is True


def test_pinned_leaves_are_skipped_and_a_full_pin_gives_none() -> None:
    policy = PrefixPolicy(3)
    for name, parent in ((b"a", None), (b"b", b"a"), (b"c", None)):
        policy.on_parents([((NS, name), None if parent is None else (NS, parent))])
        policy.on_insert((NS, name))
    assert policy.evict(lambda c: c != (NS, b"b")) == (NS, b"c")
    # Only b's parent a is unpinned: a leaf is pinned, so an inner chunk goes.
    assert policy.evict(lambda c: c == (NS, b"a")) == (NS, b"a")
    assert policy.evict(lambda c: False) is None
    assert len(policy) == 1


def test_evicted_chunk_that_returns_keeps_its_uses() -> None:
    policy = PrefixPolicy(2)
    policy.on_parents([((NS, b"x"), (NS, b"root"))])
    for name in (b"hot", b"x"):
        policy.on_insert((NS, name))
    for _ in range(3):
        policy.on_hit((NS, b"hot"))
    assert policy.evict(always) == (NS, b"x")
    assert policy.evict(always) == (NS, b"hot")
    policy.on_insert((NS, b"hot"))  # back with its history: 5 uses
    policy.on_insert((NS, b"new"))
    assert policy.evict(always) == (NS, b"new")


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="abcdefgh", max_size=80), st.integers(1, 5))
def test_without_parents_it_is_arc(refs: str, capacity: int) -> None:
    ours, arc = (
        HostIndex(capacity, PrefixPolicy(capacity)),
        HostIndex(capacity, ARCPolicy(capacity)),
    )
    for x in refs:
        for index in (ours, arc):
            key = x.encode()
            if not index.lookup(NS, [key])[0][0]:
                store(index, [key], None)
            index.touch()
        assert sorted(ours.missing(NS, [c.encode() for c in "abcdefgh"])) == sorted(
            arc.missing(NS, [c.encode() for c in "abcdefgh"])
        )
    assert ours.policy.describe()["tree"] is False


def test_switch_to_the_tree_keeps_residents() -> None:
    policy = PrefixPolicy(4)
    index = HostIndex(4, policy)
    store(index, [b"a", b"b"], None)
    index.lookup(NS, [b"a"])
    index.touch()
    store(index, [b"c", b"d"], [b"b", b"c"])  # the first parents: leave ARC
    assert policy.arc is None and len(policy) == 4
    victim = policy.evict(always)
    assert victim in {(NS, b"d"), (NS, b"a")}  # a leaf (a has no known children)
    assert victim != (NS, b"c") and victim != (NS, b"b")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), max_size=60),
    st.integers(2, 8),
)
def test_index_invariants_with_chains(requests: list[tuple[int, int]], capacity: int) -> None:
    """Random conversations through the index: the policy's residents are the index's."""
    policy = PrefixPolicy(capacity)
    index = HostIndex(capacity, policy)
    turns = [0] * 6
    for conversation, grow in requests:
        turns[conversation] += grow
        keys = [b"%d-%d" % (conversation, i) for i in range(turns[conversation])]
        _hits, prefix = index.lookup(NS, keys)
        index.touch()
        if prefix < len(keys):
            store(index, keys[prefix:], chain(keys)[prefix:])
        assert len(policy) == index.chunks <= capacity


def write(path: Path, requests: list[list[int]]) -> Path:
    records = [
        {"timestamp": i, "input_length": 512 * len(ids), "hash_ids": ids}
        for i, ids in enumerate(requests)
    ]
    return write_trace(path, records)


def scan_heavy(seed: int = 7) -> list[list[int]]:
    """A few system prompts with chats behind them, drowned in one-off long prompts."""
    rng = random.Random(seed)
    requests: list[list[int]] = []
    chats: list[list[int]] = []
    fresh = 10_000
    for _ in range(3000):
        if rng.random() < 0.6:  # a one-off document, 8-24 blocks
            requests.append(list(range(fresh, fresh + rng.randint(8, 24))))
            fresh += 24
        elif chats and rng.random() < 0.7:  # the next turn of a chat
            chat = rng.choice(chats)
            chat += list(range(fresh, fresh + rng.randint(1, 3)))
            fresh += 3
            requests.append(list(chat))
        else:  # a new chat behind one of 4 system prompts
            chat = [rng.randrange(4) * 10, *range(fresh, fresh + 2)]
            fresh += 2
            chats.append(chat)
            requests.append(list(chat))
    return requests


def test_scan_heavy_trace_never_worse_than_lru(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path / "scan.jsonl", scan_heavy()))
    for blocks in (32, 128, 512):
        lru = replay(trace, "lru", blocks).hit_rate
        prefix = replay(trace, "prefix", blocks).hit_rate
        assert lru is not None and prefix is not None
        assert prefix >= lru, (blocks, prefix, lru)


def test_selectable_by_name() -> None:
    assert isinstance(make_policy("prefix", 4), PrefixPolicy)


def test_agent_learns_parents_from_store_requests(
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
) -> None:
    agent = agent_factory(make_config(policy="prefix"))
    with AgentClient(agent.config.endpoint) as client:
        grant = client.allocate(NS, [key(0), key(1)], ROW)
        client.commit(grant.lease)
        assert client.stats().host.policy.state["tree"] is False  # no parents yet: ARC
        grant = client.allocate(NS, [key(2), key(3)], ROW, [key(1), key(2)])
        client.commit(grant.lease)
        assert client.stats().host.policy.state["tree"] is True
        with pytest.raises(AgentRefused):
            client.allocate(NS, [key(4), key(5)], ROW, [key(3)])  # one parent for two keys
        assert client.lookup(NS, [key(i) for i in range(4)]).prefix == 4


def test_an_agent_reads_an_allocate_without_parents() -> None:
    """A client that predates the field sends none; one that has it can talk to an agent
    that predates it (msgspec ignores unknown fields)."""
    old = msgspec.msgpack.encode({"type": "allocate", "namespace": NS, "keys": [b"k"], "nbytes": 1})
    request = msgspec.msgpack.decode(old, type=p.Request)
    assert isinstance(request, p.Allocate) and request.parents is None


def test_multi_turn_chat_trace_never_worse_than_lru(tmp_path: Path) -> None:
    records = multi_turn(seed=1, conversations=3000)
    assert records == multi_turn(seed=1, conversations=3000)  # the seed fixes the trace
    trace = load_trace(write_trace(tmp_path / "chats.jsonl", records))
    for blocks in (64, 256, 1024, 4096):
        lru = replay(trace, "lru", blocks).hit_rate
        prefix = replay(trace, "prefix", blocks).hit_rate
        assert lru is not None and prefix is not None
        assert prefix >= lru, (blocks, prefix, lru)


def test_admission_turns_one_off_documents_away() -> None:
    """Hot chains fill the pool; one-off documents arrive between them. Once the densities
    are learnt, a document is not stored (its first chunk is refused, and with it the rest,
    which could never be reached), and the hot chains keep hitting; LRU lets every document
    flush them."""
    results = {}
    for name in ("lru", "prefix"):
        index = HostIndex(8, make_policy(name, 8))
        hits = requests = 0
        for step in range(3000):
            if step % 2:
                keys = [b"doc%d-%d" % (step, i) for i in range(3)]
            else:
                c = (step // 2) % 4
                keys = [b"hot%d-0" % c, b"hot%d-1" % c]
            _hits, prefix = index.lookup(NS, keys)
            index.touch()
            if step >= 2000 and not step % 2:
                hits += prefix
                requests += len(keys)
            if prefix < len(keys):
                store(index, keys[prefix:], chain(keys)[prefix:])
        results[name] = (hits / requests, index.counters.full)
    assert results["lru"][0] < 0.2 and results["lru"][1] == 0
    assert results["prefix"][0] > 0.9
    assert results["prefix"][1] > 1000 and results["prefix"][1] % 3 == 0  # whole documents


def test_a_refused_chunk_asked_again_comes_back_a_class_higher() -> None:
    policy = PrefixPolicy(2)
    policy.on_parents([((NS, b"a"), (NS, b"root"))])
    policy.on_insert((NS, b"a"))
    policy.now = 10 * policy.capacity  # past the warm-up: admission is on
    policy._density[_class(1, 0)][0] = 0.0  # a new chunk of unknown pace is worth nothing
    assert policy.evict(always, (NS, b"new")) is None  # refused: worth no more than a
    assert policy.refused == 1
    policy.on_parents([((NS, b"child"), (NS, b"new"))])
    assert policy.evict(always, (NS, b"child")) is None  # its parent was refused
    # Asked for again, "new" would be used twice: a class worth more than a, so a goes.
    assert policy.evict(always, (NS, b"new")) == (NS, b"a")
    policy.on_insert((NS, b"new"))
    assert policy._state[(NS, b"new")][1] == 2  # refused once, then stored
