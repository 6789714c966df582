"""Waiting for something another process does: the one poll-until-deadline loop that the
demo, the benchmarks and the tests share."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05
) -> T:
    """Call `predicate` until it returns something true, and return that; TimeoutError
    naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g} s")
        time.sleep(interval)
    return result


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0
