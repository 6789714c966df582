"""Whether another thread of this process holds up the GIL, as a client's stores show it.

A client's lane sums of its staged rows (shm/pool.py: copy_summed) let go of the GIL a block
at a time; beside a thread running Python without a pause (vLLM's engine thread, in the
process where the plug-in copies) each one then waits out that thread's switch interval to
take it back. Rows that took that long tell the client to CRC-sum its rows for a while,
holding the GIL. Besides the standard library it imports only shm.pool: the vLLM plug-in
uses it.
"""

from __future__ import annotations

import sys
import threading

from kvtier.shm.pool import COPY_BLOCK

CONTENDED_SECONDS = 2.0  # rows are CRC-summed this long once the GIL was found contended,
CONTENDED_MAX = 64.0  # twice as long each time it is found so again right after
SLOW_ROWS = 2  # lane-summed rows in a row, of one thread, too slow to be anything else


def _contended(nbytes: int) -> float:
    """How long a lane-summed row may take before it counts as slow: half the interpreter's
    switch interval per block (a row whose sums wait for the GIL waits about one interval a
    block, 5 ms), plus 1 GB/s (lane sums alone run at over 10 on the slowest machine this
    ran on). A thread merely preempted meanwhile (a busy node) seldom passes it twice."""
    blocks = -(-nbytes // COPY_BLOCK)
    return blocks * sys.getswitchinterval() / 2 + nbytes / 1e9


class GilWatch:
    """Whether another thread of this process holds up the GIL, as a client's lane-summed
    rows show it: once SLOW_ROWS of one thread's rows in a row were slow, rows are
    CRC-summed for a window (shm/pool.py: copy_summed). Each time rows are found slow again
    right after a window ended, the next one is twice as long (up to CONTENDED_MAX): each
    look costs SLOW_ROWS rows' waits, a second at rows of 32 MiB. Threads share the window
    and count their own rows (the plug-in's copy threads share one client)."""

    def __init__(self) -> None:
        self.until = 0.0
        self.window = CONTENDED_SECONDS
        self._runs = threading.local()

    def contended(self, now: float) -> bool:
        return now < self.until

    def lane_row(self, nbytes: int, began: float, now: float) -> None:
        """A lane-summed row of `nbytes` staged from `began` to `now` (monotonic)."""
        runs = getattr(self._runs, "slow", 0) + 1 if now - began > _contended(nbytes) else 0
        if runs >= SLOW_ROWS:
            runs = 0
            again = began - self.until < self.window
            self.window = min(2 * self.window, CONTENDED_MAX) if again else CONTENDED_SECONDS
            self.until = now + self.window
        self._runs.slow = runs
