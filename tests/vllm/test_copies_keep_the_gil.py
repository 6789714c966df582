"""The plug-in's load copies never let go of the GIL, under vLLM's own numpy.

In vLLM's scheduler process the engine thread runs Python while a request waits for its KV;
a copy thread that lets go of the GIL waits out that thread's switch interval to take it
back (`kvtier.shm.pool.copy_held`). Here the other thread is kept waiting for a switch
interval of a minute: it runs while the copy runs only if the copy lets go of the GIL."""

from __future__ import annotations

import gc
import mmap
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.shm.pool import HELD_PIECE, copy_held

TURNS = 1000


def turns_taken_meanwhile(work: Callable[[], object]) -> int:
    """How many turns a thread that wants the GIL took while `work` ran on this one."""
    turns = [0]
    go = threading.Event()

    def other() -> None:
        go.wait()
        for _ in range(TURNS):
            turns[0] += 1

    thread = threading.Thread(target=other)
    thread.start()
    interval = sys.getswitchinterval()
    gc.collect()  # an earlier test's garbage, finalized mid-copy, may let go of the GIL
    gc.disable()
    sys.setswitchinterval(60.0)
    try:
        # a thread already waiting for the GIL waits out the interval it started with: let
        # each take its turn, so that every later wait is a minute long
        time.sleep(0.05)
        go.set()  # the other thread now wants the GIL, which this one holds
        work()
        taken = turns[0]
    finally:
        sys.setswitchinterval(interval)
        gc.enable()
        thread.join()
    return taken


def test_the_probe_sees_a_call_that_lets_go_of_the_gil() -> None:
    assert turns_taken_meanwhile(lambda: time.sleep(0.05)) == TURNS


def mapped(nbytes: int) -> np.ndarray:
    """A shared mapping, as vLLM's host buffer and the agent's pool are."""
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


@pytest.mark.parametrize("nbytes", [128 << 10, 4 * HELD_PIECE + 100])
def test_load_copies_keep_the_gil_where_numpy_lets_go_of_it(nbytes: int) -> None:
    src, dst = mapped(nbytes), mapped(nbytes)
    src[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    for _ in range(5):
        assert turns_taken_meanwhile(lambda: copy_held(dst, src)) == 0
    assert np.array_equal(dst, src)


def test_the_probe_sees_numpy_copies_of_mapped_rows_let_go_of_the_gil() -> None:
    """What the loads were before: numpy's copies between mapped buffers. Each lets go of the
    GIL for its copy; rows of 8 MiB give the waiting thread time to wake and take it."""
    src, dst = mapped(8 << 20), mapped(8 << 20)
    assert turns_taken_meanwhile(lambda: [np.copyto(dst, src) for _ in range(10)]) == TURNS
