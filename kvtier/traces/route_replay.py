"""`kvtier replay --nodes N --route prefix|random`: what a cache-aware router gains from the
nodes' KV event streams.

N nodes, each with a host pool and a node-local storage tier (LRU each, sized as shares of
the trace's distinct blocks, split evenly between the nodes). Every store and eviction on a
node is an event on its stream; the router keeps, per node, what the stream says the node
holds (as a router subscribed to `event_stream.py` does) and sends each request either to
the node showing the longest cached prefix among those not far above the least loaded
(`BALANCE`; ties: the node with fewest requests so far) or to a node at random. A request's
blocks hit as a prefix: pool first, then storage; what
misses is computed and stored on the node that served it. Reported: hit rate (prompt tokens)
per tier and per node, for each routing.
"""

from __future__ import annotations

import json
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvtier.traces.replay import Trace, load_trace

BALANCE = 1.25  # a node takes a request while at most 25 % (+8) above the least loaded


class _Lru:
    def __init__(self, capacity: int, on_change: Any) -> None:
        self.capacity = max(1, capacity)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self._on_change = on_change  # (block, removed): the node's event stream

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def touch(self, block: int) -> None:
        if block in self.blocks:
            self.blocks.move_to_end(block)
            return
        self.blocks[block] = None
        self._on_change(block, False)
        while len(self.blocks) > self.capacity:
            gone, _ = self.blocks.popitem(last=False)
            self._on_change(gone, True)


@dataclass
class _Node:
    pool: _Lru
    storage: _Lru
    requests: int = 0
    tokens: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"pool": 0, "storage": 0})


class _View:
    """A router's view of one node, from its stream: the blocks held on any tier, counted
    per tier (a block on both is held until both let it go)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.events = 0

    def change(self, block: int, removed: bool) -> None:
        self.events += 1
        count = self.held.get(block, 0) + (-1 if removed else 1)
        if count:
            self.held[block] = count
        else:
            self.held.pop(block, None)

    def prefix(self, blocks: list[int]) -> int:
        n = 0
        for block in blocks:
            if block not in self.held:
                break
            n += 1
        return n


def simulate(
    trace: Trace,
    nodes: int,
    route: str,
    pool_share: float = 0.1,
    storage_share: float = 0.4,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay `trace` over `nodes` nodes routed by `route` (prefix or random)."""
    unique = trace.unique_blocks
    views = [_View() for _ in range(nodes)]
    fleet = [
        _Node(
            _Lru(int(unique * pool_share / nodes), view.change),
            _Lru(int(unique * storage_share / nodes), view.change),
        )
        for view in views
    ]
    rng = random.Random(seed)
    for r in range(trace.requests):
        span = range(trace.starts[r], trace.starts[r + 1])
        blocks = [trace.nodes[i] for i in span]
        tokens = [trace.tokens[i] for i in span]
        if route == "prefix":
            # as routers weigh load beside the prefix: only nodes not far above the least
            # loaded are candidates
            least = min(n.requests for n in fleet)
            fair = [n for n in range(nodes) if fleet[n].requests <= least * BALANCE + 8]
            target = max(fair, key=lambda n: (views[n].prefix(blocks), -fleet[n].requests))
        else:
            target = rng.randrange(nodes)
        node = fleet[target]
        node.requests += 1
        node.tokens += sum(tokens)
        on_prefix = True
        for block, count in zip(blocks, tokens, strict=True):
            if on_prefix and block in node.pool:
                node.hits["pool"] += count
            elif on_prefix and block in node.storage:
                node.hits["storage"] += count
            else:
                on_prefix = False
            node.pool.touch(block)
            node.storage.touch(block)
    total = sum(n.tokens for n in fleet) or 1
    per_tier = {t: sum(n.hits[t] for n in fleet) / total for t in ("pool", "storage")}
    return {
        "route": route,
        "nodes": nodes,
        "requests": trace.requests,
        "hit_rate": sum(per_tier.values()),
        "per_tier": per_tier,
        "per_node": [
            {
                "requests": n.requests,
                "hit_rate": sum(n.hits.values()) / n.tokens if n.tokens else 0.0,
                "events": v.events,
            }
            for n, v in zip(fleet, views, strict=True)
        ],
    }


def compare(trace: Trace, nodes: int, routes: list[str], **kw: Any) -> dict[str, Any]:
    results = {route: simulate(trace, nodes, route, **kw) for route in routes}
    report: dict[str, Any] = {"routes": results}
    if "prefix" in results and "random" in results:
        report["gain"] = results["prefix"]["hit_rate"] - results["random"]["hit_rate"]
    return report


def main(args: Any) -> int:
    try:
        trace = load_trace(args.trace, args.block_size, args.limit)
    except (OSError, ValueError) as exc:  # TraceError included: file, line and field named
        print(exc, file=sys.stderr)
        return 2
    routes = ["prefix", "random"] if args.route == "both" else [args.route]
    if args.route == "prefix":
        routes.append("random")  # the baseline the gain is measured against
    report = compare(trace, args.nodes, routes)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for route, result in report["routes"].items():
        tiers = ", ".join(f"{t} {v:.1%}" for t, v in result["per_tier"].items())
        nodes = " ".join(f"{n['hit_rate']:.0%}({n['requests']})" for n in result["per_node"])
        print(f"{route:>6}: hit rate {result['hit_rate']:.1%} ({tiers}); per node {nodes}")
    if "gain" in report:
        print(f"prefix routing gains {report['gain']:+.1%} of prompt tokens over random")
    return 0
