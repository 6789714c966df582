"""The one-copy store design `kvtier bench host` measures: a client's copy into a segment the
agent made, sealed by the kernel once the client let go of it (real memfds, two processes)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Iterator

import pytest

from kvtier.bench import sealed_segments as seg

NR_HUGEPAGES = seg.HUGE_PAGES / "nr_hugepages"


@contextlib.contextmanager
def huge_pages(wanted: int) -> Iterator[None]:
    """At least `wanted` free 2 MiB pages for the test's length, reserved as root where
    they are short; the test skips (which fails CI, where it runs as root) otherwise."""
    before = int(NR_HUGEPAGES.read_text()) if NR_HUGEPAGES.exists() else 0
    short = wanted - seg.huge_pages_free()
    if short > 0 and os.geteuid() == 0:
        with contextlib.suppress(OSError):
            NR_HUGEPAGES.write_text(str(before + short))
    try:
        if seg.huge_pages_free() < wanted:
            pytest.skip(f"{wanted} free 2 MiB huge pages needed (root reserves them)")
        yield
    finally:
        if NR_HUGEPAGES.exists() and int(NR_HUGEPAGES.read_text()) != before:
            NR_HUGEPAGES.write_text(str(before))


@pytest.mark.parametrize("huge", [False, True], ids=["4KiB", "2MiB"])
def test_a_sealed_segment_holds_the_clients_rows_and_refuses_a_seal_while_mapped(
    huge: bool,
) -> None:
    """`measure` raises unless the first segment holds the client's rows and no write or
    resize gets through its seal; a client still mapping a segment writable is refused."""
    # one page for the segment, one for the private mapping it is read back through
    with huge_pages(2) if huge else contextlib.nullcontext():
        case = seg.measure(row=1 << 20, rows=2, rounds=2, huge=huge)
    assert case["pages"] == ("2 MiB" if huge else "4 KiB")
    assert case["seal_refused_while_mapped"]


def test_a_segment_is_sealed_only_once_unmapped_and_then_refuses_writes() -> None:
    size = 1 << 20
    fd = seg.new_segment(size, huge=False)
    try:
        writable = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        writable[:5] = b"hello"
        assert not seg.seal(fd, size)  # EBUSY: a writable mapping exists
        writable.close()
        assert seg.seal(fd, size)
        assert not seg.writable_after_seal(fd, size)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 2 * size)  # sealed against growing, too
        assert bytes(seg.read_back(fd, size)[:5]) == b"hello"
    finally:
        os.close(fd)


def test_a_segment_cut_before_its_seal_is_not_published() -> None:
    """A client holding the descriptor can shrink the segment before the seal; mapped at its
    length it would kill its reader with SIGBUS, so the seal reports it unusable."""
    size = 1 << 20
    fd = seg.new_segment(size, huge=False)
    try:
        os.ftruncate(fd, size // 2)
        assert not seg.seal(fd, size)
    finally:
        os.close(fd)


def test_a_seal_refused_for_another_reason_is_raised() -> None:
    fd = os.memfd_create("kvtier-test")  # made without MFD_ALLOW_SEALING
    try:
        with pytest.raises(PermissionError) as raised:
            seg.seal(fd, 0)
        assert raised.value.errno == errno.EPERM
    finally:
        os.close(fd)


def test_run_says_why_it_did_not_measure_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seg, "huge_pages_free", lambda: 0)
    report = seg.run(quick=True, rows_of=(32 << 20,))
    assert {c["pages"] for c in report["cases"]} == {"4 KiB"}
    assert report["huge_pages_not_measured"] == "0 free, 64 needed (vm.nr_hugepages)"
