"""The index the agent publishes in shared memory (shm_index.py), without an agent: the
table agrees with a dict under any sequence of publishes and withdrawals, digests agree
between the vectorised and the per-key function, and a reader racing a writer in another
process never reads an entry that is not one the writer published."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.shm import table as s


@given(st.lists(st.binary(min_size=1, max_size=80), min_size=1, max_size=60), st.text(max_size=8))
def test_vectorised_digests_equal_per_key_digests(keys: list[bytes], namespace: str) -> None:
    batch = s.digests(namespace, keys)
    assert [int(d) for d in batch] == [s.digest(namespace, k) for k in keys]
    assert all(int(d) != 0 for d in batch)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from([1, 7, 8, 9, 32, 40, 255, 256, 1022]),
    st.sampled_from([1, 15, 16, 300, 70_000]),
    st.integers(0, 2**32),
)
def test_digests_of_keys_of_one_length_equal_per_key_digests(
    length: int, count: int, seed: int
) -> None:
    """Keys of one length take the packed path (1 to 255 bytes) or the grouped one, for
    every msgpack array header (counts below 16, below 65,536, and above); a key of another
    length at any place (or two whose lengths make up for each other), bytes that look like
    the packed tags, or a key of another type give the same digests as the per-key
    function."""
    rng = np.random.default_rng(seed)
    tag = bytes([0xC4, length % 256])
    keys = [rng.bytes(length) for _ in range(count)]
    keys[rng.integers(count)] = (tag * length)[:length]
    picked = sorted({0, count - 1, count // 2})
    want = {i: s.digest("ns", keys[i]) for i in picked}
    assert {i: int(s.digests("ns", keys)[i]) for i in picked} == want
    assert int(s.digests("ns", tuple(keys))[count - 1]) == want[count - 1]
    for at in picked:
        for other in (keys[at][:-1] or b"x" * 2, keys[at] + tag, bytearray(keys[at])):
            changed = [*keys[:at], other, *keys[at + 1 :]]
            got = s.digests("ns", changed)
            assert int(got[at]) == s.digest("ns", bytes(other))
            assert [int(got[i]) for i in picked if i != at] == [want[i] for i in picked if i != at]
    if count > 2 and length > 1:  # one key a byte shorter, a later one a byte longer
        changed = [keys[0], keys[1][:-1], *keys[2:-1], keys[-1] + b"\xc4"]
        assert s.digests("ns", changed).tolist() == [s.digest("ns", k) for k in changed]


def test_digests_depend_on_namespace_and_length() -> None:
    assert s.digest("a", b"k") != s.digest("b", b"k")
    assert s.digest("a", b"k") != s.digest("a", b"k\0")


# Operations on a tiny table: its 16 homes crowd a few digests into long clusters, so
# removals shift entries back across many positions.
_ops = st.lists(
    st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=120
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_table_agrees_with_a_dict(ops: list[tuple[bool, int, int]]) -> None:
    path = Path(f"/dev/shm/kvtier-test-index-{os.getpid()}")
    writer = s.TableWriter(path, slot_count=8, boot=3)
    reader = s.TableReader(path)
    try:
        model: dict[int, tuple[int, int]] = {}
        for put, n, home in ops:
            # a digest with a chosen home position (low bits) and distinct high bits
            d = (n + 1) << 32 | home
            if put and d not in model and len(model) < 16:
                slot = len(model)
                assert writer.put(d, slot, 1000 + n)
                model[d] = (slot, 1000 + n)
            elif not put and d in model:
                writer.remove(d)
                del model[d]
            probe = np.array([(k + 1) << 32 | h for k in range(41) for h in range(4)], np.uint64)
            slots, gens = reader.find(probe)
            for d_, slot_, gen_ in zip(probe.tolist(), slots.tolist(), gens.tolist(), strict=True):
                want = model.get(d_)
                assert (slot_, gen_) == (want if want else (-1, 0))
                assert reader.find_one(d_) == (want if want else (-1, 0))
                assert reader.holds(d_) is (want is not None)
            assert reader.held(probe).tolist() == [d_ in model for d_ in probe.tolist()]
        assert writer.entries == len(model)
    finally:
        writer.close()
        reader.close()
        path.unlink(missing_ok=True)


def test_a_cluster_longer_than_the_probe_rounds_is_found_whole() -> None:
    """Keys of a few homes filling a cluster past the batched rounds' three windows: the
    last ones are found by `find_one`, and after removals from the middle (entries shifted
    back) every key left is found, and no removed one."""
    path = Path(f"/dev/shm/kvtier-test-index-long-{os.getpid()}")
    writer = s.TableWriter(path, slot_count=64, boot=5)
    reader = s.TableReader(path)
    try:
        model = {}
        for n in range(60):
            d = (n + 1) << 32 | (5 + n % 3)  # homes 5, 6 and 7
            assert writer.put(d, n, 500 + n)
            model[d] = (n, 500 + n)
        assert len(model) > 3 * s.WINDOW
        for removed in ((), range(10, 40, 3)):
            for n in removed:
                d = (n + 1) << 32 | (5 + n % 3)
                writer.remove(d)
                del model[d]
            probe = [(n + 1) << 32 | (5 + n % 3) for n in range(60)]
            slots, gens = reader.find(np.array(probe, np.uint64))
            got = list(zip(slots.tolist(), gens.tolist(), strict=True))
            assert got == [model.get(d, (-1, 0)) for d in probe]
            assert reader.held(np.array(probe, np.uint64)).tolist() == [d in model for d in probe]
    finally:
        writer.close()
        reader.close()
        path.unlink(missing_ok=True)


def test_a_second_chunk_with_a_taken_digest_is_not_published() -> None:
    path = Path("/dev/shm") / f"kvtier-test-index-dup-{os.getpid()}"
    writer = s.TableWriter(path, slot_count=8, boot=1)
    try:
        assert writer.put(77, 1, 10)
        assert not writer.put(77, 2, 20)
        assert s.TableReader(path).find_one(77) == (1, 10)
        assert writer.collisions == 1
    finally:
        writer.close()
        path.unlink(missing_ok=True)


def test_a_replaced_table_is_retired_and_a_closed_writer_is_not_alive() -> None:
    path = Path("/dev/shm") / f"kvtier-test-index-retire-{os.getpid()}"
    first = s.TableWriter(path, slot_count=8, boot=1)
    old = s.TableReader(path)
    assert old.alive() and not old.retired
    second = s.TableWriter(path, slot_count=8, boot=2)
    assert old.retired and s.TableReader(path).boot == 2
    first.close()
    assert not old.alive()
    second.close()
    path.unlink(missing_ok=True)


# --- a writer and readers in separate processes ---------------------------------------------

GEN = 1 << 40  # generation = GEN + digest's key number: a reader can tell what it read


def _churn(path: str, rounds: int, seed: int, started: Barrier) -> None:
    """Make the table, as an agent does, then publish and withdraw keys at random, each
    always with the slot and generation that belong to it, so any (digest, slot,
    generation) a reader sees can be checked."""
    rng = np.random.default_rng(seed)
    writer = s.TableWriter(Path(path), slot_count=300, boot=9)
    started.wait(timeout=120)  # the readers open the table it made
    live: set[int] = set()
    for _ in range(rounds):
        n = int(rng.integers(0, 600))
        d = s.digest("ns", b"key-%d" % n)
        if n in live:
            writer.remove(d)
            live.discard(n)
        elif len(live) < 256:
            writer.put(d, n, GEN + n)
            live.add(n)


def _read(path: str, rounds: int, started: Barrier, out: mp.Queue) -> None:  # type: ignore[type-arg]
    started.wait(timeout=120)
    reader = s.TableReader(Path(path))
    keys = [b"key-%d" % n for n in range(600)]
    ds = s.digests("ns", keys)
    never = s.digests("ns", [b"key-%d" % n for n in range(600, 900)])  # never published
    both = np.concatenate([ds, never])
    deadline = time.monotonic() + 120  # the writer may not have published anything yet
    while not (reader.find(ds)[0] >= 0).any() and time.monotonic() < deadline:
        time.sleep(0.005)
    bad = 0
    hits = 0
    for _ in range(rounds):
        slots, gens = reader.find(ds)
        for n, (slot, gen) in enumerate(zip(slots.tolist(), gens.tolist(), strict=True)):
            if slot >= 0:
                hits += 1
                bad += slot != n or gen != GEN + n
            one = reader.find_one(int(ds[n]))
            if one[0] >= 0:
                bad += one != (n, GEN + n)
        held = reader.held(both)
        bad += int(held[len(ds) :].sum())
        hits += int(held[: len(ds)].sum())
    out.put((bad, hits))


def test_readers_racing_a_writer_never_read_a_wrong_slot() -> None:
    path = Path("/dev/shm") / f"kvtier-test-index-race-{os.getpid()}"
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    started = ctx.Barrier(3)
    try:
        readers = [ctx.Process(target=_read, args=(str(path), 150, started, out)) for _ in range(2)]
        writer = ctx.Process(target=_churn, args=(str(path), 200_000, 5, started))
        for proc in (writer, *readers):
            proc.start()
        results = [out.get(timeout=300) for _ in readers]
        writer.join(300)
        for proc in readers:
            proc.join(60)
        assert writer.exitcode == 0
        assert sum(bad for bad, _ in results) == 0
        assert sum(hits for _, hits in results) > 0  # the readers saw the table populated
    finally:
        path.unlink(missing_ok=True)
