"""The client library under arbitrary arguments: buffers of any dtype, shape, size and
layout, keys and namespaces of any length. Every call either does what it says (rows come
back exact) or raises ValueError or AgentRefused before anything changes, and never leaves a
lease behind."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient, AgentRefused
from kvtier.client.gil import CONTENDED_SECONDS, SLOW_ROWS, GilWatch
from kvtier.client.reports import Reports, report_parts
from kvtier.local.agent import AgentProcess
from kvtier.shm.pool import SUM_CRC32
from tests.conftest import ROW
from tests.helpers import NS, key, row

DTYPES = [np.uint8, np.int16, np.float32, np.float64]


@st.composite
def buffers(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    count = draw(st.integers(0, (2 * ROW) // dtype.itemsize))
    array = np.arange(count, dtype=dtype)
    if draw(st.booleans()) and count >= 2:
        array = array[::2]  # not contiguous
    return array


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(buffers(), min_size=0, max_size=3),
    keys=st.lists(st.binary(min_size=0, max_size=1100), min_size=0, max_size=3),
    namespace=st.text(min_size=0, max_size=130),
)
def test_store_and_load_with_arbitrary_arguments(
    agent: AgentProcess, rows: list[np.ndarray], keys: list[bytes], namespace: str
) -> None:
    with AgentClient(agent.config.endpoint) as client:
        try:
            result = client.store(namespace, keys, rows)
        except (ValueError, AgentRefused):
            assert client.stats().host.leases == 0
            return
        assert result.stored + result.skipped == len(keys)
        outs = [np.empty_like(r) for r in rows]
        try:
            loaded = client.load_into(namespace, keys, outs)
        except (ValueError, AgentRefused):
            assert client.stats().host.leases == 0
            return
        for row, out, ok in zip(rows, outs, loaded, strict=True):
            assert not ok or np.array_equal(row, out)
        assert client.stats().host.leases == 0


def test_store_refuses_rows_of_unequal_size_before_asking(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        rows = [np.zeros(ROW, np.uint8), np.zeros(ROW // 2, np.uint8)]
        with pytest.raises(ValueError, match="equal size"):
            client.store("ns", [b"a", b"b"], rows)
        assert client.stats().host.leases == 0


def test_lookup_reports_are_cut_into_messages_the_agent_accepts() -> None:
    """A backlog of reported lookups never becomes one Looked message over the protocol's
    bounds (MAX_KEYS keys, MAX_KEYS requests), which the agent would drop unanswered."""
    requests = [np.arange(n, dtype=np.uint64) for n in [p.MAX_KEYS, 3, p.MAX_KEYS - 2, 1, 5]]
    parts = report_parts(requests)
    assert [len(part) for part in parts] == [1, 1, 2, 1]
    assert all(sum(len(r) for r in part) <= p.MAX_KEYS for part in parts)
    assert [r for part in parts for r in part] == requests  # every request, in order
    many = [np.zeros(1, np.uint64)] * (p.MAX_KEYS + 1)
    assert [len(part) for part in report_parts(many)] == [p.MAX_KEYS, 1]
    assert report_parts([]) == [[]]


def test_a_requests_keys_noted_over_a_step_are_reported_as_one_request() -> None:
    """The plug-in notes lookups key by key; the batcher reports each request's keys of one
    step as one request, beside whole requests and the bytes loaded without a lease."""
    reports = Reports(lambda: None)
    reports.key("ns", "a", 1)
    reports.key("ns", "b", 2)
    reports.key("ns", "a", 3)
    assert not reports.pending and reports.take() == []  # not before the step ends
    reports.end_step()
    reports.request("other", np.array([4], np.uint64))
    reports.loaded(100)
    assert reports.pending
    sent = [
        (m.namespace, m.sizes, np.frombuffer(m.digests, "<u8").tolist(), m.loaded_bytes)
        for m in reports.take()
    ]
    assert sent == [("ns", [2, 1], [1, 3, 2], 100), ("other", [1], [4], 0)]
    assert not reports.pending
    reports.loaded(5)  # bytes alone still go out
    assert [(m.namespace, m.sizes, m.loaded_bytes) for m in reports.take()] == [("-", [], 5)]
    reports.stop(1.0)


class _OldAllocate(msgspec.Struct, tag="allocate"):
    """Allocate as plug-ins that predate Allocate.status send it (deployed pods)."""

    namespace: str
    keys: list[bytes]
    nbytes: int
    parents: list[bytes | None] | None = None


class _OldLeaseReply(msgspec.Struct, tag="lease_reply"):
    """LeaseReply as those plug-ins decode it."""

    lease: int
    slots: list[int]
    where: list[int] = []
    generations: list[int] = []
    staging: list[int] = []


def test_store_outcomes_travel_out_of_band(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(0)], [row(0, ROW)])
        request = p.Allocate(NS, [key(0), key(1)], ROW, None, True)
        reply = client._call(request, p.LeaseReply)
        assert reply.status == [p.StoreStatus.EXISTS, p.StoreStatus.GRANTED]
        assert reply.slots[0] == p.NO_SLOT and reply.slots[1] >= 0
        client.abort(reply.lease)


def test_an_old_client_reads_store_outcomes_in_band(agent: AgentProcess) -> None:
    """A plug-in that predates LeaseReply.status, during a rolling upgrade: it asks without
    it and reads each key's outcome in `slots`, as it always did."""
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(0)], [row(0, ROW)])
        old_request = _OldAllocate(NS, [key(0), key(1)], ROW)
        reply = client._call(old_request, p.LeaseReply)  # type: ignore[arg-type]
        old = msgspec.msgpack.decode(p.encode(reply), type=_OldLeaseReply)
        assert old.lease and old.slots[0] == p.StoreCode.EXISTS and old.slots[1] >= 0
        client.abort(reply.lease)


def test_a_new_client_stores_through_an_agent_that_answers_in_band(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that predates Allocate.status reads a new client's Allocate without it
    (msgspec drops fields it does not know) and answers in band: the client still learns
    each key's outcome, and a store still skips what is held."""
    sent = p.encode(p.Allocate(NS, [key(0)], ROW, None, True))
    assert msgspec.msgpack.decode(sent, type=_OldAllocate) == _OldAllocate(NS, [key(0)], ROW)
    with AgentClient(agent.config.endpoint) as client:
        real = client._call

        def old_agent(request: Any, expect: type[Any]) -> Any:
            if isinstance(request, p.Allocate):  # what such an agent reads of it
                request = _OldAllocate(
                    request.namespace, request.keys, request.nbytes, request.parents
                )
            return real(request, expect)

        monkeypatch.setattr(client, "_call", old_agent)
        assert client.store(NS, [key(0)], [row(0, ROW)]).stored == 1
        grant = client.allocate(NS, [key(0), key(1)], ROW)
        assert grant.status == [p.StoreStatus.EXISTS, p.StoreStatus.GRANTED]
        assert grant.slots[0] == p.NO_SLOT and grant.slots[1] >= 0
        client.abort(grant.lease)
        result = client.store(NS, [key(0), key(1)], [row(0, ROW), row(1, ROW)])
        assert (result.stored, result.skipped) == (1, 1)


@pytest.mark.parametrize("agent_checks_crc", [True, False])
def test_while_the_gil_is_contended_a_store_sends_crc_sums_the_agent_checks(
    agent: AgentProcess, agent_checks_crc: bool
) -> None:
    """Once the client found its GIL contended (set here: whether a thread running Python
    makes numpy wait for the GIL depends on the OS scheduling that thread at the moment,
    which a loaded machine does not; `kvtier bench host` measures it, rows `1+py`), it
    CRC-sums its rows, says so in each Commit, and the agent checks them as CRCs: every
    chunk is published and loads back exact, none counted corrupt, through `store` and
    through `stage` with `commit`. An agent that predates CRC sums (no "crc32" in its
    hello) gets lane sums only."""
    keys = [key(i) for i in range(8)]
    rows = [row(i, ROW - 3) for i in range(8)]  # 12 pieces of 5 KiB and a part
    with AgentClient(agent.config.endpoint) as client:
        client.connect()
        assert client.hello is not None and "crc32" in client.hello.sums
        if not agent_checks_crc:
            client.hello.sums = []
        client.gil.until = time.monotonic() + 600
        assert client.store(NS, keys[:4], rows[:4]).stored == 4
        grant = client.allocate(NS, keys[4:], ROW - 3)
        staged = client.stage(grant, rows[4:], ROW - 3)
        assert staged.kinds == (bytes([SUM_CRC32]) * 4 if agent_checks_crc else b"")
        # lane sums may still be committed as a plain list, as `stage` once returned them
        client.commit(grant.lease, staged if agent_checks_crc else staged.sums)
        outs = [np.empty_like(r) for r in rows]
        assert client.load_into(NS, keys, outs) == [True] * len(keys)
        assert all(np.array_equal(o, r) for o, r in zip(outs, rows, strict=True))
        assert client.stats().host.corrupt == 0


def test_the_gil_counts_as_contended_after_slow_rows_in_a_row_and_for_longer_each_time() -> None:
    """Two lane-summed rows in a row of one thread, each slower than half a switch interval
    a block, open a window of CRC sums; a fast row in between, or another thread's slow row,
    does not; found again right after a window ends, the next window is twice as long, and
    found again later it is back to the first length."""
    gil, mib = GilWatch(), 1 << 20
    slow = 4 * sys.getswitchinterval() + 0.01  # a 1 MiB row whose 4 blocks waited
    now = 100.0
    for took in (slow, 0.0001, slow):  # a fast row breaks the run
        gil.lane_row(mib, now, now + took)
        now += 1
    assert not gil.contended(now)
    other = threading.Thread(target=gil.lane_row, args=(mib, now, now + slow))
    other.start()
    other.join()
    assert not gil.contended(now)  # that thread's row is not this one's run
    gil.lane_row(mib, now, now + slow)
    assert gil.contended(now + slow) and gil.window == CONTENDED_SECONDS
    now = gil.until + 0.1  # the window ended: the next look finds it so again at once
    for _ in range(SLOW_ROWS):
        gil.lane_row(mib, now, now + slow)
    assert gil.window == 2 * CONTENDED_SECONDS and gil.contended(gil.until - 0.01)
    now = gil.until + 100  # found so again only long after: the first length again
    for _ in range(SLOW_ROWS):
        gil.lane_row(mib, now, now + slow)
    assert gil.window == CONTENDED_SECONDS
