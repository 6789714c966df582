"""The host index's rules, without processes: leases pin, stores commit, leases expire."""

from __future__ import annotations

import shutil
import tempfile
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.agent.host.index import HostIndex, LeaseError
from kvtier.agent.host.policy import make_policy
from kvtier.agent.host.slots import KEY_WIDTH, RestingSlots, SlotMap
from kvtier.bench.host import agent_index_bytes
from kvtier.client.protocol import StoreCode, Where
from kvtier.shm.table import TableWriter, digests

EXISTS, BUSY, FULL = StoreCode.EXISTS, StoreCode.BUSY, StoreCode.FULL
MISS = Where.MISS


@pytest.fixture(params=["lru", "arc", "prefix"])
def index(request: pytest.FixtureRequest) -> HostIndex:
    return HostIndex(4, make_policy(request.param, 4))


FAR = 1e12


def store(index: HostIndex, *keys: bytes, client: str = "c") -> list[int]:
    grant = index.allocate(client, "ns", list(keys), 10, FAR)
    index.commit(grant.lease, client)
    return grant.slots


def test_uncommitted_chunk_is_not_readable(index: HostIndex) -> None:
    lease, slots, _, _ = index.allocate("c", "ns", [b"a"], 10, FAR)
    assert slots[0] >= 0
    assert index.lookup("ns", [b"a"]) == ([False], 0)
    assert index.begin_load("c", "ns", [b"a"], FAR) == (0, [MISS], [0], ())
    assert index.allocate("d", "ns", [b"a"], 10, FAR)[1] == [BUSY]
    index.commit(lease, "c")
    assert index.lookup("ns", [b"a"]) == ([True], 1)
    assert index.allocate("d", "ns", [b"a"], 10, FAR) == (0, [EXISTS], [0], ())


def test_lookup_prefix_and_namespaces(index: HostIndex) -> None:
    store(index, b"a", b"b", b"d")
    assert index.lookup("ns", [b"a", b"b", b"c", b"d"]) == ([True, True, False, True], 2)
    assert index.lookup("other-fingerprint", [b"a"]) == ([False], 0)
    assert dict(index.counters.namespaces) == {"ns": 3}


def test_leased_chunks_are_not_evicted(index: HostIndex) -> None:
    store(index, b"a", b"b", b"c", b"d")
    lease, slots, _, _ = index.begin_load("c", "ns", [b"a", b"b", b"c", b"d"], FAR)
    assert min(slots) >= 0
    assert index.allocate("c", "ns", [b"e"], 10, FAR) == (0, [FULL], [0], ())
    index.end_load(lease, "c")
    assert index.allocate("c", "ns", [b"e"], 10, FAR)[1][0] >= 0
    assert index.counters.evictions == 1


def test_eviction_reuses_slot_and_forgets_key(index: HostIndex) -> None:
    slots = store(index, b"a", b"b", b"c", b"d")
    new = store(index, b"e")
    assert new[0] in slots
    assert sum(index.lookup("ns", [b"a", b"b", b"c", b"d", b"e"])[0]) == 4


def test_aborted_store_frees_slots(index: HostIndex) -> None:
    lease, _, _, _ = index.allocate("c", "ns", [b"a", b"b"], 10, FAR)
    index.abort(lease, "c")
    assert index.free_slots == 4
    assert index.lookup("ns", [b"a"]) == ([False], 0)


def test_expired_leases_are_released(index: HostIndex) -> None:
    store(index, b"a")
    load, _, _, _ = index.begin_load("c", "ns", [b"a"], deadline=5.0)
    index.allocate("c", "ns", [b"x", b"y"], 10, deadline=5.0)
    assert index.expire(now=4.0) == []
    assert len(index.expire(now=6.0)) == 2
    assert index.leases == 0 and index.pinned_slots() == 0
    assert index.free_slots == 3
    with pytest.raises(LeaseError):  # an expired lease is reclaimed once, never again
        index.end_load(load, "c")
    assert index.expire(now=7.0) == []
    assert index.free_slots == 3 and index.pinned_slots() == 0
    assert index.lookup("ns", [b"a"]) == ([True], 1)


def test_release_client_frees_only_its_leases(index: HostIndex) -> None:
    store(index, b"a", b"b")
    index.begin_load("dead", "ns", [b"a"], FAR)
    index.allocate("dead", "ns", [b"x"], 10, FAR)
    kept, _, _, _ = index.begin_load("alive", "ns", [b"b"], FAR)
    assert len(index.release_client("dead")) == 2
    assert index.leases == 1 and index.pinned_slots() == 1
    index.end_load(kept, "alive")
    assert index.pinned_slots() == 0


def test_events_record_stores_and_evictions_per_namespace(index: HostIndex) -> None:
    store(index, b"a", b"b", b"c", b"d")
    first = index.events.since("ns", 0)
    assert first.stored == [b"a", b"b", b"c", b"d"] and first.evicted == []
    store(index, b"e")  # evicts one
    later = index.events.since("ns", first.seq)
    assert later.stored == [b"e"] and len(later.evicted) == 1 and not later.truncated
    assert index.events.since("other", 0).stored == []


def test_event_log_is_bounded_and_says_when_a_reader_fell_behind() -> None:
    from kvtier.agent.host.events import ChunkEvents

    events = ChunkEvents(per_namespace=3)
    for i in range(5):
        events.record("ns", b"%d" % i, removed=False)
    batch = events.since("ns", 0)
    assert batch.stored == [b"2", b"3", b"4"] and batch.truncated
    assert not events.since("ns", 2).truncated


def test_hits_applied_by_an_eviction_still_reach_take_touched(index: HostIndex) -> None:
    """An eviction applies pending hits to the policy first; the hit entries must still be
    handed to the secondary tiers (admission after N hits) afterwards."""
    store(index, b"a", b"b", b"c", b"d")
    index.lookup("ns", [b"a", b"b"])
    store(index, b"e")  # pool full: the eviction touches a and b first
    touched = index.take_touched()
    assert sorted(e.id[1] for e in touched) == [b"a", b"b"]
    assert all(e.hits == 1 for e in touched)
    assert index.take_touched() == []


def test_a_lease_is_used_only_by_its_holder_and_for_its_kind(index: HostIndex) -> None:
    store(index, b"a")
    load, _, _, _ = index.begin_load("c", "ns", [b"a"], FAR)
    lease, _, _, _ = index.allocate("c", "ns", [b"x"], 10, FAR)
    before = (index.leases, index.pinned_slots(), index.free_slots)
    with pytest.raises(LeaseError):
        index.commit(lease, "someone-else")
    with pytest.raises(LeaseError):
        index.end_load(load, "someone-else")
    with pytest.raises(ValueError, match="load lease"):
        index.commit(load, "c")
    with pytest.raises(ValueError, match="store lease"):
        index.end_load(lease, "c")
    assert (index.leases, index.pinned_slots(), index.free_slots) == before
    index.commit(lease, "c")
    index.end_load(load, "c")
    assert index.pinned_slots() == 0


def test_leases_and_generations_of_another_boot_never_match() -> None:
    first, second = (HostIndex(4, make_policy("lru", 4), boot) for boot in (1, 2))
    lease, _, generations, _ = first.allocate("c", "ns", [b"a"], 10, FAR)
    other, _, other_generations, _ = second.allocate("c", "ns", [b"b"], 10, FAR)
    assert lease != other and generations != other_generations
    with pytest.raises(LeaseError):
        second.commit(lease, "c")


def test_every_allocation_gets_a_new_generation(index: HostIndex) -> None:
    seen = set()
    for i in range(12):  # three times the slots: every slot is reused
        lease, _, generations, _ = index.allocate("c", "ns", [b"%d" % i], 10, FAR)
        index.commit(lease, "c")
        seen.add(generations[0])
    assert len(seen) == 12


def test_slot_of_an_expired_store_rests_before_reuse() -> None:
    index = HostIndex(2, make_policy("lru", 2), rest_seconds=10.0)
    _, resting, _, _ = index.allocate("slow", "ns", [b"a"], 10, deadline=5.0)
    assert len(index.expire(now=6.0)) == 1
    assert index.resting_slots == 1 and index.free_slots == 1
    for key in (b"b", b"c", b"d"):  # each evicts the one before rather than use the rest
        assert store(index, key) != resting
    index.expire(now=16.0)
    assert index.resting_slots == 0
    assert store(index, b"e") == resting


def test_resting_slots_come_out_once_their_rest_is_over() -> None:
    resting = RestingSlots()
    for slot, until in ((3, 5.0), (1, 2.0), (7, 5.0)):
        resting.add(slot, until)
    assert resting.due(1.0) == [] and len(resting) == 3
    assert resting.due(2.0) == [1]
    assert resting.due(9.0) == [3, 7] and len(resting) == 0


PLACES = (61, 62, 63, 0, 1)  # homes at the end of the 64-position map of 12 slots and past it


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 11), st.integers(0, 19)), max_size=120))
def test_slot_map_finds_exactly_the_slots_placed(ops: list[tuple[bool, int, int]]) -> None:
    """Hashes of a few homes, wrapping past the end of the map, build long colliding probe
    chains; after any mix of adds and removes (which shift chains back) every placed slot
    is found under its hash and tag in one batched find, and no other (hash, tag) finds
    anything."""
    hashes, tags = array("Q", [0]) * 12, np.zeros(12, np.uint64)
    table = SlotMap(12, hashes)
    names = [
        (variant << 6 | place, tag) for variant in range(2) for place in PLACES for tag in (0, 1)
    ]
    asked = np.array([h for h, _ in names], np.uint64)
    asked_tags = np.array([tag for _, tag in names], np.uint64)
    placed: dict[tuple[int, int], int] = {}
    for add, slot, name in ops:
        h, tag = names[name]
        if add and slot not in placed.values() and (h, tag) not in placed:
            hashes[slot], tags[slot] = h, tag
            table.add(slot)
            placed[h, tag] = slot
        elif not add and slot in placed.values():
            table.discard(slot)
            del placed[hashes[slot], int(tags[slot])]
        found = table.find(asked, lambda slots, rows: tags[slots] == asked_tags[rows])
        assert found.tolist() == [placed.get(name, -1) for name in names]


def _two_digests(namespace: str, keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Every key of every namespace under one of two digests: the map's probe chains
    collide, and keys share a digest outright."""
    return np.array([1 + len(key) % 2 for key in keys], np.uint64)


def _one_long_field(key: bytes) -> bytes:
    """Every key longer than the slot's field under one field: only the keys kept aside
    tell them apart."""
    return key.ljust(KEY_WIDTH, b"\0") if len(key) <= KEY_WIDTH else b"L" * KEY_WIDTH


LONG = (b"a" * 41, b"b" * 41, b"a" * 300)
KEYS = [
    (namespace, key)
    for namespace in ("ns", "other")
    for key in (b"k1", b"k12", bytes(32), bytes(31) + b"\1", bytes(36), b"x" * 40, *LONG)
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "hit", "remove"]), st.integers(0, 17))))
def test_index_agrees_with_a_dict_under_colliding_digests(ops: list[tuple[str, int]]) -> None:
    """LRU through the index against an ordered dict of keys, with every key under one of
    two digests and every long key under one key field: stores, evictions, hits and
    removals never lose a chunk, find one under another key or namespace, or evict another
    than least recently used; lookups by key, by digest and key_at agree with the dict."""
    index = HostIndex(4, make_policy("lru", 4))
    model: OrderedDict[tuple[str, bytes], None] = OrderedDict()
    with (
        mock.patch("kvtier.agent.host.slots.digests", _two_digests),
        mock.patch("kvtier.agent.host.slots.key_field", _one_long_field),
    ):
        for op, i in ops:
            namespace, key = chunk = KEYS[i]
            if op == "store" and chunk not in model:
                if len(model) == 4:
                    model.popitem(last=False)
                model[chunk] = None
                lease, _, _, _ = index.allocate("c", namespace, [key], 10, FAR)
                index.commit(lease, "c")
            elif op == "hit" and chunk in model:
                model.move_to_end(chunk)
                index.lookup(namespace, [key])
                index.touch()
            elif op == "remove" and chunk in model:
                del model[chunk]
                entry = index.get(namespace, key)
                assert entry is not None
                index.remove(entry)
            _agrees(index, model)


def _agrees(index: HostIndex, model: OrderedDict[tuple[str, bytes], None]) -> None:
    for namespace in ("ns", "other"):
        keys = [key for ns, key in KEYS if ns == namespace]
        assert index.missing(namespace, keys) == [k for k in keys if (namespace, k) not in model]
    held = [index.get(namespace, key) for namespace, key in model]
    assert [e.id for e in held if e is not None] == list(model)
    assert len({e.slot for e in held if e is not None}) == len(model) == index.chunks


def test_keys_longer_than_the_field_are_kept_whole() -> None:
    """Keys past KEY_WIDTH (the protocol allows 1,024 bytes) are told apart and named in
    full, however much they share."""
    index = HostIndex(4, make_policy("lru", 4))
    keys = [b"p" * 41, b"p" * 40 + b"q", b"p" * 1024, b"p" * 40]
    store(index, *keys)
    assert index.lookup("ns", [*keys, b"p" * 42]) == ([True] * 4 + [False], 4)
    load, slots, _, _ = index.begin_load("c", "ns", keys, FAR)
    assert [index.key_at(slot) for slot in slots] == [("ns", key) for key in keys]
    index.end_load(load, "c")
    assert index.ready_keys() == {"ns": set(keys)}
    store(index, b"e")  # evicts the first
    assert index.events.since("ns", 0).evicted == [keys[0]]


def test_lookup_by_digest_finds_only_published_chunks_of_its_namespace() -> None:
    """Clients report lookups they answered from the published table by digest: a hit is a
    chunk published under that digest in that namespace, never one being written, one of
    another namespace, or a chunk the table refused."""
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        table = TableWriter(directory / "t.index", 4, boot=1)
        index = HostIndex(4, make_policy("lru", 4), table=table)
        store(index, b"a")
        index.allocate("c", "ns", [b"w"], 10, FAR)
        asked = digests("ns", [b"a", b"w", b"z"])
        assert index.lookup_digests("ns", asked) == [True, False, False]
        assert index.lookup_digests("other", asked) == [False, False, False]
        lease, _, _, _ = index.allocate("c", "other", [b"a"], 10, FAR)
        index.commit(lease, "c")
        assert index.lookup_digests("other", digests("other", [b"a"])) == [True]
        assert index.lookup_digests("ns", digests("other", [b"a"])) == [False]
        assert (index.counters.lookups, index.counters.hits) == (8, 2)
        table.close()
    finally:
        shutil.rmtree(directory)


def test_index_keeps_within_128_bytes_a_chunk() -> None:
    """The agent's index (LRU), counting every object it keeps: the keys included."""
    assert agent_index_bytes("lru", 4096) <= 128


@given(st.lists(st.sampled_from(["adopt", "rest", "store"]), max_size=40))
@settings(max_examples=100, deadline=None)
def test_slots_taken_by_a_restart_are_never_handed_out(ops: list[str]) -> None:
    """Slots a restart takes out of the free ones by name, in any order (adopting the
    chunks the pool holds, resting those a writer may still copy into), are never handed
    to a store while taken; no two chunks share a slot; the free count stays true."""
    from kvtier.agent.chunk import ChunkHeader

    index = HostIndex(16, make_policy("lru", 16))
    resting: set[int] = set()
    for n, op in enumerate(ops):
        held = held_slots(index)
        unused = sorted(set(range(16)) - resting - held)
        if op == "store" or not unused:
            lease, slots, _, _ = index.allocate("c", "ns", [b"s%d" % n], 8, float("inf"))
            assert not set(slots) & resting
            if lease:
                index.commit(lease, "c")
        elif op == "adopt":
            index.adopt(ChunkHeader("ns", b"a%d" % n, 8, 1), unused[n * 7 % len(unused)], n + 1)
        else:
            index.rest(unused[n * 7 % len(unused)], until=float("inf"))
            resting.add(unused[n * 7 % len(unused)])
        assert len(held_slots(index)) == index.chunks  # one slot per chunk
        assert index.free_slots == 16 - index.chunks - len(resting)


def held_slots(index: HostIndex) -> set[int]:
    """Slots of the chunks the index holds."""
    entries = [index.get(ns, key) for ns, keys in index.ready_keys().items() for key in keys]
    return {entry.slot for entry in entries if entry is not None}
