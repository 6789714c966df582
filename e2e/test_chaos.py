"""Chaos: the agent SIGKILLed at random while four client processes store and load, with the
filesystem tier filling up and its files damaged, the S3 endpoint cut or hung, and a fifth
process sending hostile requests.

Every chunk's bytes derive from its key, so any byte a client is handed that is not its
chunk's is counted. Passes when no client ever got a wrong byte, no control call took longer
than the client timeout plus 0.5 s, the agent never died of anything but the test's kills,
and a final pass over every key reads back only exact chunks. KVTIER_CHAOS_SECONDS sets the
duration (default 120); the figures are printed (run with -s to see them).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.api.config import AgentConfig, parse_config
from kvtier.client.connection import AgentClient, AgentUnavailable, Grant
from kvtier.local.agent import AgentProcess
from tests.agent_fuzz import random_hostile
from tests.conftest import AGENT_PYTHON, free_port, wait_port
from tests.faults import FaultProxy, Link

NS = "chaos-model-fp16"
KEYS = 161  # a multiple of 7: keys 7 apart have the same size
UNIT = 256 << 10  # chunks are 1 to 7 units: 256 KiB to 1.75 MiB
CHUNK_BYTES = 2 << 20
SLOTS = 24
CLIENTS = 4
TIMEOUT = 1.0
LEASE_SECONDS = 2.0
BOUND = TIMEOUT + 0.5
SECONDS = float(os.environ.get("KVTIER_CHAOS_SECONDS", "120"))
PYTHON = AGENT_PYTHON or sys.executable


def key(i: int) -> bytes:
    return b"chaos-%06d" % i


def size(i: int) -> int:
    return UNIT * (1 + i % 7)


def chunk(i: int) -> np.ndarray:
    words = np.arange(size(i) // 4, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(i)
    return words.view(np.uint8)


class _Timed:
    """A client whose control calls are timed: the longest is what the bound is about."""

    def __init__(self, client: AgentClient) -> None:
        self.client = client
        self.longest = 0.0

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.longest = max(self.longest, time.monotonic() - started)


def _store(timed: _Timed, rng: random.Random, counts: dict[str, int]) -> None:
    client = timed.client
    first = rng.randrange(KEYS)
    ids = [(first + 7 * j) % KEYS for j in range(rng.randint(1, 3))]  # one size per store
    grant: Grant = timed(client.allocate, NS, [key(i) for i in ids], size(first))
    if grant.lease and rng.random() < 0.02:
        time.sleep(LEASE_SECONDS + 0.5)  # a descheduled writer: it copies after its lease
        counts["late_writers"] += 1
    for j, i in enumerate(ids):
        if grant.slots[j] >= 0:  # into the staging area; the agent copies it into the pool
            np.copyto(client.staging_slot(grant.staging[j], size(i)), chunk(i))
    if grant.lease:
        timed(client.commit, grant.lease)
        counts["stored"] += sum(s >= 0 for s in grant.slots)


def _load(timed: _Timed, rng: random.Random, counts: dict[str, int]) -> None:
    client = timed.client
    ids = rng.sample(range(KEYS), rng.randint(1, 4))
    found = timed(client.lookup, NS, [key(i) for i in ids])
    counts["lookup_hits"] += sum(found.hits)
    grant: Grant = timed(client.begin_load, NS, [key(i) for i in ids])
    if not grant.lease:
        return
    if rng.random() < 0.02:
        time.sleep(LEASE_SECONDS + 0.5)  # a descheduled reader: its lease expires meanwhile
    try:
        for j, i in enumerate(ids):
            if grant.slots[j] < 0:
                continue
            out = np.empty(size(i), np.uint8)
            np.copyto(out, client.slot(grant.slots[j], size(i)))
            if not client.still_granted(grant, j):
                counts["stale_copies_refused"] += 1
                continue
            wrong = int(np.count_nonzero(out != chunk(i)))
            counts["loaded"] += 1
            counts["wrong_bytes"] += wrong
            counts["wrong_chunks"] += wrong > 0
    finally:
        client.end_load(grant.lease)


def client_loop(endpoint: str, worker: int, until: float, results: Any) -> None:
    rng = random.Random(worker)
    counts = dict.fromkeys(
        [
            "ops",
            "stored",
            "loaded",
            "lookup_hits",
            "unavailable",
            "wrong_bytes",
            "wrong_chunks",
            "stale_copies_refused",
            "late_writers",
        ],
        0,
    )
    timed = _Timed(AgentClient(endpoint, timeout=TIMEOUT))
    while time.time() < until:
        counts["ops"] += 1
        try:
            (_store if rng.random() < 0.5 else _load)(timed, rng, counts)
        except AgentUnavailable:
            counts["unavailable"] += 1
            time.sleep(0.05)
    timed.client.close()
    results.put({**counts, "worker": worker, "longest_call": timed.longest})


def hostile_loop(endpoint: str, until: float, results: Any) -> None:
    """Malformed and foreign requests, a few hundred a second, through every restart."""
    import zmq

    rng = random.Random(0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sent = 0
    while time.time() < until:
        message = random_hostile(rng, NS, [rng.randrange(1 << 62)])
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([b"\1" * 8, message.body], flags=zmq.NOBLOCK)
            sent += 1
        while sock.poll(0):
            sock.recv_multipart()
        time.sleep(0.003)
    sock.close()
    results.put({"hostile_messages": sent})


@pytest.fixture
def s3_endpoint(scratch: Path) -> Iterator[str]:
    """moto's S3 server from the kvtier environment (boto3 and moto are not vLLM's) and a
    bucket on it."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(PYTHON).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        make_bucket = (
            "import boto3, sys; boto3.client('s3', endpoint_url=sys.argv[1], "
            "region_name='us-east-1', aws_access_key_id='chaos', "
            "aws_secret_access_key='chaos').create_bucket(Bucket='chaos')"
        )
        subprocess.run([PYTHON, "-c", make_bucket, endpoint], check=True)
        yield endpoint
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def small_fs(scratch: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs for the filesystem tier, so the disk really fills up (needs root)."""
    mount = scratch / "fs-tier"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def chaos_config(scratch: Path, fs: Path, s3: str) -> AgentConfig:
    credentials = scratch / "s3-credentials"
    credentials.mkdir()
    (credentials / "accessKeyId").write_text("chaos")
    (credentials / "secretAccessKey").write_text("chaos")
    return parse_config(
        {
            "name": "chaos",
            "runDir": str(scratch / "run"),
            "host": {
                "capacity": SLOTS * (CHUNK_BYTES + 4096) + 4096,
                "chunkBytes": CHUNK_BYTES,
                "poolDir": str(scratch / "pool"),
            },
            "tiers": [
                {
                    "name": "fs",
                    "filesystem": {
                        "path": str(fs),
                        "capacity": "16Mi",
                        "fsync": False,
                        "scanIntervalSeconds": 1,
                    },
                },
                {
                    "name": "s3",
                    "objectStore": {
                        "endpoint": s3,
                        "bucket": "chaos",
                        "capacity": "64Mi",
                        "timeoutSeconds": 1,
                        "retries": 0,
                        "credentialsDir": str(credentials),
                    },
                },
            ],
            "metrics": {"enabled": False},
            "leaseTimeoutSeconds": LEASE_SECONDS,
            "tierBudgetSeconds": 0.5,
            "reapIntervalSeconds": 0.2,
        }
    )


class Faults:
    """Cuts and hangs the S3 link, damages the filesystem tier's files and fills its
    volume, each at random moments."""

    def __init__(self, proxy: FaultProxy, fs: Path, rng: random.Random) -> None:
        self.proxy, self.fs, self.rng = proxy, fs, rng
        self.counts = {"s3_down": 0, "s3_hung": 0, "fs_damaged": 0, "fs_filled": 0}
        self._next_link = self._next_damage = self._next_fill = time.monotonic()
        self._filler: Path | None = None

    def step(self) -> None:
        now = time.monotonic()
        if now >= self._next_link:
            link = self.rng.choice([Link.UP, Link.UP, Link.DOWN, Link.HUNG])
            self.proxy.set(link)
            if link is not Link.UP:
                self.counts[f"s3_{link.value}"] += 1
            self._next_link = now + self.rng.uniform(2, 6)
        if now >= self._next_damage:
            self._damage()
            self._next_damage = now + self.rng.uniform(1, 3)
        if now >= self._next_fill:
            self._fill()
            self._next_fill = now + self.rng.uniform(5, 15)

    def _damage(self) -> None:
        files = [p for p in self.fs.rglob("*") if p.is_file() and len(p.name) == 2 * len(key(0))]
        if files:
            victim = self.rng.choice(files)
            with contextlib.suppress(OSError), open(victim, "r+b") as f:
                f.seek(4096 + self.rng.randrange(UNIT))
                f.write(b"\xff\x00\xff\x00")
            self.counts["fs_damaged"] += 1

    def _fill(self) -> None:
        if self._filler is not None:
            self._filler.unlink(missing_ok=True)
            self._filler = None
            return
        self._filler = self.fs / "filler"
        with contextlib.suppress(OSError), open(self._filler, "wb") as f:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        self.counts["fs_filled"] += 1

    def clear(self) -> None:
        self.proxy.set(Link.UP)
        if self._filler is not None:
            self._filler.unlink(missing_ok=True)


@pytest.mark.timeout(SECONDS + 180)
def test_agent_killed_at_random_under_load_and_tier_faults(
    scratch: Path, small_fs: Path, s3_endpoint: str
) -> None:
    target = urllib.parse.urlsplit(s3_endpoint)
    proxy = FaultProxy((target.hostname or "127.0.0.1", target.port or 80))
    config = chaos_config(scratch, small_fs, proxy.endpoint)
    agent = AgentProcess(config, python=AGENT_PYTHON).start()
    rng = random.Random(18)
    faults = Faults(proxy, small_fs, rng)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    until = time.time() + SECONDS
    workers = [
        ctx.Process(target=client_loop, args=(config.endpoint, w, until, results))
        for w in range(CLIENTS)
    ]
    workers.append(ctx.Process(target=hostile_loop, args=(config.endpoint, until, results)))
    kills = crashes = 0
    try:
        for w in workers:
            w.start()
        next_kill = time.monotonic() + rng.uniform(1.5, 4)
        while time.time() < until:
            faults.step()
            if time.monotonic() >= next_kill:
                assert agent.proc is not None
                crashes += agent.proc.poll() is not None  # died of something else
                agent.kill()
                kills += 1
                agent.start()
                next_kill = time.monotonic() + rng.uniform(1.5, 4)
            time.sleep(0.05)
        outcome = [results.get(timeout=60) for _ in workers]
        hostile = next(o for o in outcome if "hostile_messages" in o)
        outcome.remove(hostile)
        for w in workers:
            w.join(30)
        faults.clear()
        final = _final_pass(config)
    finally:
        for w in workers:
            w.kill()
        agent.stop()
        proxy.close()
    totals = {
        k: sum(o[k] for o in outcome) for k in outcome[0] if k not in ("worker", "longest_call")
    }
    figures = {
        "seconds": SECONDS,
        "kills": kills,
        "crashes": crashes,
        **totals,
        "longest_call_s": round(max(o["longest_call"] for o in outcome), 3),
        "final": final,
        "faults": faults.counts,
        **hostile,
    }
    print("chaos figures:", json.dumps(figures))
    assert crashes == 0, "the agent died of something other than the test's kills"
    assert totals["wrong_bytes"] == 0 and final["wrong_bytes"] == 0
    assert figures["longest_call_s"] <= BOUND, f"a call took {figures['longest_call_s']} s"
    assert totals["loaded"] > 0 and totals["stored"] > 0 and kills >= SECONDS / 8


def _final_pass(config: AgentConfig) -> dict[str, int]:
    """Every key read back once the faults stop: what the agent serves must be exact."""
    loaded = wrong = 0
    with AgentClient(config.endpoint, timeout=5) as client:
        for i in range(KEYS):
            out = np.empty(size(i), np.uint8)
            if client.load_into(NS, [key(i)], [out]) == [True]:
                loaded += 1
                wrong += int(np.count_nonzero(out != chunk(i)))
    return {"loaded": loaded, "wrong_bytes": wrong}
