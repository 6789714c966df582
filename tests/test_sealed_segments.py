"""The one-copy store design `kvtier bench host` measures: a client's copy into a segment the
agent made, sealed by the kernel once the client let go of it (real memfds, two processes)."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench import sealed_segments as seg

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


@contextlib.contextmanager
def huge_pages(wanted: int) -> Iterator[int]:
    """At least `wanted` free 2 MiB pages where root may reserve them, for the test's length;
    yields how many are free."""
    before = int(NR_HUGEPAGES.read_text())
    short = wanted - seg.huge_pages_free()
    if short > 0 and os.geteuid() == 0:
        with contextlib.suppress(OSError):
            NR_HUGEPAGES.write_text(str(before + short))
    try:
        yield seg.huge_pages_free()
    finally:
        if int(NR_HUGEPAGES.read_text()) != before:
            NR_HUGEPAGES.write_text(str(before))


def test_a_sealed_segment_holds_the_clients_rows_and_nothing_writes_it_after() -> None:
    case = seg.measure(row=256 << 10, rows=8, rounds=2, huge=False)
    assert case["bytes_match"]
    assert case["seal_refused_while_mapped"]  # a client still mapping it: never published
    assert case["sealed_store_gbps"] > 0 and case["memcpy_gbps"] > 0


def test_a_segment_is_sealed_only_once_unmapped_and_then_refuses_writes() -> None:
    fd = seg.new_segment(1 << 20, huge=False)
    try:
        writable = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        assert not seg.seal(fd)
        writable.close()
        assert seg.seal(fd)
        assert not seg.writable_after_seal(fd, 1 << 20)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 2 << 20)  # sealed against growing, too
    finally:
        os.close(fd)


def test_segments_of_huge_pages_where_the_machine_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 MiB pages free the same store is measured on them and holds the same rows;
    without, `run` says how many it lacked instead of measuring."""
    with huge_pages(4) as free:
        if free >= 4:
            case = seg.measure(row=1 << 20, rows=2, rounds=2, huge=True)
            assert case["pages"] == "2 MiB" and case["bytes_match"]
            assert case["seal_refused_while_mapped"]
    monkeypatch.setattr(seg, "huge_pages_free", lambda: 0)
    report = seg.run(quick=True, rows_of=(32 << 20,))
    assert {c["pages"] for c in report["cases"]} == {"4 KiB"}
    assert report["huge_pages_free"] == 0 and report["huge_pages_needed"] == 64
