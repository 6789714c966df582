"""The host index's rules, without processes: leases pin, stores commit, leases expire."""

from __future__ import annotations

import pytest

from kvtier.agent.index import BUSY, EXISTS, FULL, MISS, HostIndex
from kvtier.agent.policy import make_policy


@pytest.fixture(params=["lru", "arc"])
def index(request: pytest.FixtureRequest) -> HostIndex:
    return HostIndex(4, make_policy(request.param, 4))


FAR = 1e12


def store(index: HostIndex, *keys: bytes, client: str = "c") -> list[int]:
    lease, slots = index.allocate(client, "ns", list(keys), 10, FAR)
    index.commit(lease)
    return slots


def test_uncommitted_chunk_is_not_readable(index: HostIndex) -> None:
    lease, slots = index.allocate("c", "ns", [b"a"], 10, FAR)
    assert slots[0] >= 0
    assert index.lookup("ns", [b"a"]) == ([False], 0)
    assert index.begin_load("c", "ns", [b"a"], FAR) == (0, [MISS])
    assert index.allocate("d", "ns", [b"a"], 10, FAR)[1] == [BUSY]
    index.commit(lease)
    assert index.lookup("ns", [b"a"]) == ([True], 1)
    assert index.allocate("d", "ns", [b"a"], 10, FAR) == (0, [EXISTS])


def test_lookup_prefix_and_namespaces(index: HostIndex) -> None:
    store(index, b"a", b"b", b"d")
    assert index.lookup("ns", [b"a", b"b", b"c", b"d"]) == ([True, True, False, True], 2)
    assert index.lookup("other-fingerprint", [b"a"]) == ([False], 0)
    assert dict(index.counters.namespaces) == {"ns": 3}


def test_leased_chunks_are_not_evicted(index: HostIndex) -> None:
    store(index, b"a", b"b", b"c", b"d")
    lease, slots = index.begin_load("c", "ns", [b"a", b"b", b"c", b"d"], FAR)
    assert min(slots) >= 0
    assert index.allocate("c", "ns", [b"e"], 10, FAR) == (0, [FULL])
    index.end_load(lease)
    assert index.allocate("c", "ns", [b"e"], 10, FAR)[1][0] >= 0
    assert index.counters.evictions == 1


def test_eviction_reuses_slot_and_forgets_key(index: HostIndex) -> None:
    slots = store(index, b"a", b"b", b"c", b"d")
    new = store(index, b"e")
    assert new[0] in slots
    assert sum(index.lookup("ns", [b"a", b"b", b"c", b"d", b"e"])[0]) == 4


def test_aborted_store_frees_slots(index: HostIndex) -> None:
    lease, _ = index.allocate("c", "ns", [b"a", b"b"], 10, FAR)
    index.abort(lease)
    assert index.free_slots == 4
    assert index.lookup("ns", [b"a"]) == ([False], 0)


def test_expired_leases_are_released(index: HostIndex) -> None:
    store(index, b"a")
    load, _ = index.begin_load("c", "ns", [b"a"], deadline=5.0)
    index.allocate("c", "ns", [b"x", b"y"], 10, deadline=5.0)
    assert index.expire(now=4.0) == []
    assert len(index.expire(now=6.0)) == 2
    assert index.leases == 0 and index.pinned_slots() == 0
    assert index.free_slots == 3
    index.end_load(load)  # late end of an expired lease is harmless
    assert index.lookup("ns", [b"a"]) == ([True], 1)


def test_release_client_frees_only_its_leases(index: HostIndex) -> None:
    store(index, b"a", b"b")
    index.begin_load("dead", "ns", [b"a"], FAR)
    index.allocate("dead", "ns", [b"x"], 10, FAR)
    kept, _ = index.begin_load("alive", "ns", [b"b"], FAR)
    assert len(index.release_client("dead")) == 2
    assert index.leases == 1 and index.pinned_slots() == 1
    index.end_load(kept)
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
    from kvtier.agent.events import ChunkEvents

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
