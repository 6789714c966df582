"""A multi-turn chat trace, written and replayed through a live agent with real rows, for the
tests that then look at what the agent saw (its access log, its replay report)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.replay import Trace, load_trace, replay_agent
from kvtier.tracegen import multi_turn, write
from tests.conftest import ROW


def chats_replayed(
    endpoint: str, path: Path, seed: int, conversations: int
) -> tuple[Trace, dict[str, Any]]:
    """The chats of `seed` written to `path` and replayed through the agent at `endpoint`:
    the trace as loaded back, and the replay's report."""
    trace = load_trace(write(path, multi_turn(seed=seed, conversations=conversations)))
    return trace, replay_agent(trace, endpoint, ROW)
