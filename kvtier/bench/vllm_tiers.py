"""`kvtier bench vllm`, the part that runs under the vLLM environment's Python.

The same rows go through vLLM's own TieringOffloadingManager twice in one run: once with
kvtier as the secondary tier (agent on this machine, pool on /dev/shm), once with vLLM's
native `fs` tier on a tmpfs directory. Store = complete_store until every cascade job has
finished; load = lookups after a primary reset until every chunk is promoted and HIT.
Then the plug-in's per-key lookup as vLLM's scheduler makes it (`KVTierSecondaryTier.lookup`
in this process, against an agent whose pool holds half the keys asked, without and with a
secondary tier), one key at a time and 1k keys in a row, next to a bare dict lookup of the
same keys timed alike and one bare ipc round trip measured in the same run.
Prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

from kvtier.api.config import AgentConfig
from kvtier.api.pool_layout import PAGE
from kvtier.bench.vllm_scheduler import Engine, chunk_key, chunk_row, kvtier_extra_config
from kvtier.local.agent import AgentProcess, scratch_config

MiB = 1 << 20


def measure(engine: Engine, chunks: int, rounds: int) -> dict[str, float]:
    stores, loads = [], []
    size = chunks * engine.row
    for r in range(rounds):
        ids = list(range(r * chunks, (r + 1) * chunks))
        ctx, keys = engine.begin_store(ids)
        started = time.perf_counter()
        engine.finish_store(ctx, keys)
        stores.append(size / (time.perf_counter() - started) / 1e9)
        engine.reset_primary()
        started = time.perf_counter()
        answers, _ = engine.lookup(ids)
        loads.append(size / (time.perf_counter() - started) / 1e9)
        if any(a.name != "HIT" for a in answers):
            raise RuntimeError(f"not every chunk came back: {answers}")
        sample = [ids[0], ids[-1]]
        for i, row in zip(sample, engine.read(sample), strict=True):
            if not np.array_equal(row, chunk_row(i, engine.row)):
                raise RuntimeError("a promoted row differs from the stored one")
        engine.reset_primary()
    return {"store_gbps": statistics.median(stores), "load_gbps": statistics.median(loads)}


LOOKUP_ROW = PAGE
PACE_SECONDS = 0.002  # between scheduler steps
STEP_KEYS = 256  # keys of one request (an 8k-token prompt of 32-token chunks), half held


def _percentiles(ns: list[int]) -> dict[str, float]:
    ns = sorted(ns)
    return {
        "p50_us": ns[len(ns) // 2] / 1e3,
        "p99_us": ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3,
    }


def _request(
    tier: Any, name: str, held: list[Any], fresh: Any, n: int, rng: random.Random
) -> tuple[ReqContext, list[Any]]:
    """A new request of `n` keys, half of them held, in a random order, their positions
    recorded in its context as vLLM's scheduler does before it looks them up."""
    ctx = ReqContext(req_id=name)
    tier.on_new_request(ctx)
    keys = rng.sample(held, n // 2) + [chunk_key(next(fresh)) for _ in range(n - n // 2)]
    rng.shuffle(keys)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, 32 * (i + 1))
    return ctx, keys


def tier_lookups(tier: Any, held: list[Any], steps: int, batches: int) -> dict[str, Any]:
    """`tier.lookup(key, ctx)` as the scheduler calls it: a new request each step asking
    STEP_KEYS keys (then vLLM's end of step, and the request finished), each call timed on
    its own; a dict lookup of the same keys timed alike in the same steps; then batches of
    1k keys in one request, each batch timed whole."""
    clock = time.perf_counter_ns
    rng = random.Random(0)
    fresh = iter(range(10**9, 2 * 10**9))
    table = dict.fromkeys(held, True)
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    per_key: list[int] = []
    per_dict: list[int] = []
    answers: dict[str, int] = {}
    for step in range(steps):
        ctx, keys = _request(tier, f"bench-{step}", held, fresh, STEP_KEYS, rng)
        for key in keys:
            t = clock()
            table.get(key)
            per_dict.append(clock() - t)
            t = clock()
            answer = tier.lookup(key, ctx)
            per_key.append(clock() - t)
            answers[answer.name] = answers.get(answer.name, 0) + 1
        tier.on_schedule_end(end)
        tier.on_request_finished(ctx)
        time.sleep(PACE_SECONDS)
    whole: list[int] = []
    whole_dict: list[int] = []
    for b in range(batches):
        ctx, keys = _request(tier, f"bench-1k-{b}", held, fresh, 1024, rng)
        t = clock()
        for key in keys:
            table.get(key)
        whole_dict.append(clock() - t)
        lookup = tier.lookup
        t = clock()
        for key in keys:
            lookup(key, ctx)
        whole.append(clock() - t)
        tier.on_schedule_end(end)
        tier.on_request_finished(ctx)
        time.sleep(PACE_SECONDS)
    return {
        "per_key": _percentiles(per_key),
        "per_key_dict": _percentiles(per_dict),
        "batch_1k": _percentiles(whole),
        "batch_1k_dict": _percentiles(whole_dict),
        "answers": answers,
    }


def manager_lookups(engine: Engine, steps: int) -> dict[str, Any]:
    """vLLM's `TieringOffloadingManager.lookup` per key, as its scheduler calls it, beside
    the tier's own `lookup` in the same steps: on keys no tier holds (a held one would
    start a promotion), STEP_KEYS a request, so each call runs the CPU tier's lookup, the
    manager's metrics and the tier's."""
    clock = time.perf_counter_ns
    fresh = iter(range(3 * 10**9, 4 * 10**9))
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    times: dict[str, list[int]] = {"manager": [], "tier": []}
    calls = {"manager": engine.manager.lookup, "tier": engine.tier.lookup}
    for step in range(steps):
        for who, lookup in calls.items():
            ctx = ReqContext(req_id=f"bench-{who}-{step}")
            engine.tier.on_new_request(ctx)
            keys = [chunk_key(next(fresh)) for _ in range(STEP_KEYS)]
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, 32 * (i + 1))
            for key in keys:
                t = clock()
                lookup(key, ctx)
                times[who].append(clock() - t)
            engine.tier.on_schedule_end(end)
            engine.tier.on_request_finished(ctx)
        time.sleep(PACE_SECONDS)
    return {who: _percentiles(ns) for who, ns in times.items()}


def lookup_agent(scratch: Path, name: str, held: int, tiers: list[dict[str, Any]]) -> AgentConfig:
    """An agent of LOOKUP_ROW chunks with room for `held` of them, and `tiers`."""
    extra: dict[str, Any] = {"tiers": tiers} if tiers else {}
    return scratch_config(
        scratch / name, name, PAGE + (held + 64) * (LOOKUP_ROW + PAGE), LOOKUP_ROW, **extra
    )


def lookup_latency(quick: bool, agent_python: str, scratch: Path) -> dict[str, Any]:
    """Per-key and 1k lookups through the plug-in, without and with a secondary tier (a
    filesystem tier on tmpfs: the pool's misses then go to the agent on vLLM's lookup
    thread, answering RETRY here)."""
    held_n, steps, batches = (1024, 40, 40) if quick else (4096, 200, 200)
    out: dict[str, Any] = {}
    fs = {"name": "fs", "filesystem": {"path": str(scratch / "fs"), "capacity": "64Mi"}}
    for label, tiers in (("pool_only", []), ("with_tier", [fs])):
        agent = lookup_agent(scratch, f"lookup-{label.replace('_', '-')}", held_n, tiers)
        with AgentProcess(agent, python=agent_python):
            engine = Engine(
                kvtier_extra_config(agent, 512, LOOKUP_ROW), row=LOOKUP_ROW, step_sleep=0.001
            )
            try:
                ids = list(range(held_n))
                for start in range(0, held_n, 256):
                    engine.store(ids[start : start + 256])
                engine.reset_primary()
                held = [chunk_key(i) for i in ids]
                freeze_gc_heap()  # as vLLM's engine core does once it has started
                try:
                    out[label] = tier_lookups(engine.tier, held, steps, batches)
                    if label == "pool_only":
                        out["manager"] = manager_lookups(engine, steps)
                finally:
                    gc.unfreeze()
            finally:
                engine.close()
    return out


def ipc_rtt(agent_python: str, reps: int) -> dict[str, float]:
    """`kvtier bench host`'s bare ipc round trip, run by the agent's Python (the host
    bench's module needs what only that environment has)."""
    code = (
        "import json; from kvtier.bench.host import ipc_round_trip; "
        f"print(json.dumps(ipc_round_trip({reps})))"
    )
    proc = subprocess.run(
        [agent_python, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    rtt: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return rtt


def lookup_figures(quick: bool, agent_python: str, scratch: Path) -> dict[str, Any]:
    rtt = ipc_rtt(agent_python, 200 if quick else 1000)
    lookups = lookup_latency(quick, agent_python, scratch)
    pool, tier = lookups["pool_only"], lookups["with_tier"]
    return {
        "lookup": lookups,
        "lookup_per_key_p50_us": pool["per_key"]["p50_us"],
        "lookup_per_key_p99_us": pool["per_key"]["p99_us"],
        "lookup_per_key_p50_us_with_tier": tier["per_key"]["p50_us"],
        "lookup_per_key_p99_us_with_tier": tier["per_key"]["p99_us"],
        "dict_lookup_p50_us": pool["per_key_dict"]["p50_us"],
        "dict_lookup_p99_us": pool["per_key_dict"]["p99_us"],
        "lookup_1k_p50_us": pool["batch_1k"]["p50_us"],
        "lookup_1k_p99_us": pool["batch_1k"]["p99_us"],
        "lookup_1k_p99_us_with_tier": tier["batch_1k"]["p99_us"],
        "ipc_rtt_p50_us": rtt["p50_us"],
        "ipc_rtt_p99_us": rtt["p99_us"],
        "lookup_1k_p99_ratio_vs_ipc_rtt": pool["batch_1k"]["p99_us"] / rtt["p99_us"],
        "manager_lookup_miss_p50_us": lookups["manager"]["manager"]["p50_us"],
        "tier_lookup_miss_p50_us": lookups["manager"]["tier"]["p50_us"],
    }


def run(quick: bool, agent_python: str) -> dict[str, Any]:
    row, chunks, rounds = MiB, (64 if quick else 256), (2 if quick else 3)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir="/dev/shm"))
    try:
        agent = scratch_config(scratch, "bench-vllm", PAGE + (chunks + 8) * (row + PAGE), row)
        with AgentProcess(agent, python=agent_python):
            engine = Engine(kvtier_extra_config(agent, chunks, row), row=row, step_sleep=0.001)
            try:
                kvtier = measure(engine, chunks, rounds)
            finally:
                engine.close()
        native_extra = {
            "cpu_bytes_to_use": chunks * row,
            "secondary_tiers": [{"type": "fs", "root_dir": str(scratch / "native-fs")}],
        }
        engine = Engine(native_extra, row=row, step_sleep=0.001)
        try:
            native = measure(engine, chunks, rounds)
        finally:
            engine.close()
        lookups = lookup_figures(quick, agent_python, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "row_bytes": row,
        "chunks": chunks,
        "kvtier_store_gbps": kvtier["store_gbps"],
        "kvtier_load_gbps": kvtier["load_gbps"],
        "native_fs_store_gbps": native["store_gbps"],
        "native_fs_load_gbps": native["load_gbps"],
        "store_ratio_vs_native_fs": kvtier["store_gbps"] / native["store_gbps"],
        "load_ratio_vs_native_fs": kvtier["load_gbps"] / native["load_gbps"],
        **lookups,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--agent-python", required=True)
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.agent_python)))


if __name__ == "__main__":
    main()
