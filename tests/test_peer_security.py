"""The peer tier trusts no one it cannot authenticate as a live member of its tier: peers
without a trusted CURVE key never get an answer, a request naming an address outside the
tier never makes the agent dial it, NIXL metadata goes only to members; and a new key pair
is rolled out, or authentication switched on, without breaking the tier.

The refusals are checked by speaking the peer protocol directly to an agent's endpoint, so
each case is exercised whatever the keys' homes are."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from kvtier.agent.tiers.nixl_path import available
from kvtier.agent.tiers.peer.wire import (
    RID,
    Announce,
    Answer,
    Lend,
    Lent,
    NixlHello,
    Return,
    WhoHas,
    decode_loan,
    encode,
    load_keys,
    write_keys,
)
from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import load_exact, wait_for
from tests.conftest import ROW
from tests.helpers import NS, key, row
from tests.peer_helpers import node_config, peer_stats

StartAgent = Callable[[AgentConfig], AgentProcess]
FAST = {"membershipSeconds": 0.5, "staleFloorSeconds": 3.0, "announceTtlSeconds": 6.0}
_rids = itertools.count(1)


def ask(
    endpoint: str,
    message: msgspec.Struct,
    curve: tuple[bytes, bytes, bytes] | None = None,
    wait: float = 1.5,
) -> list[bytes] | None:
    """One request to a peer endpoint as an arbitrary process would send it: `curve` is
    (public, secret, server key) or None for a plain socket. The reply's frames after the
    request id, or None when nothing came back within `wait` seconds."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
        sock.connect(endpoint)
        rid = RID.pack(next(_rids))
        sock.send_multipart([rid, encode(message)])
        if not sock.poll(int(wait * 1000)):
            return None
        frames = sock.recv_multipart()
        assert frames[0] == rid
        return frames[1:]
    finally:
        sock.close(linger=0)


def endpoint_of(scratch: Path, node: str) -> str:
    return str(json.loads((scratch / "registry" / f"{node}.json").read_text())["endpoint"])


def stored(client: AgentClient, ids: list[int]) -> None:
    client.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])


def test_peers_without_a_trusted_key_are_refused(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    keys = scratch / "curve"
    write_keys(keys)
    ring = load_keys(keys)
    holder = agent_factory(node_config(make_config, scratch, "holder", keys, **FAST))
    target = endpoint_of(scratch, "holder")
    with AgentClient(holder.config.endpoint) as producer:
        stored(producer, [0])
    who_has = WhoHas(NS, [key(0)])
    # The tier's own key pair is answered: the refusals below are not a dead endpoint.
    assert ask(target, who_has, (ring.public, ring.secret, ring.public)) is not None

    other_public, other_secret = zmq.curve_keypair()
    refusals = {
        "no key at all": None,
        "another tier's key pair": (other_public, other_secret, other_public),
        "the server's key, but no trusted client key": (other_public, other_secret, ring.public),
        "the trusted public key without its secret": (ring.public, other_secret, ring.public),
    }
    for case, curve in refusals.items():
        assert ask(target, who_has, curve) is None, case
    with AgentClient(holder.config.endpoint) as producer:
        # the authenticator saw the untrusted client key and said no
        assert peer_stats(producer).peer.refused_handshakes >= 1


def test_an_agent_with_another_key_is_not_a_member(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """A node whose key the tier does not trust, in the same registry, shares nothing in
    either direction, and naming it (or being named by it) as a source is refused."""
    keys, foreign = scratch / "curve", scratch / "foreign"
    write_keys(keys)
    write_keys(foreign)
    a = agent_factory(node_config(make_config, scratch, "node-a", keys, **FAST))
    b = agent_factory(node_config(make_config, scratch, "node-b", keys, **FAST))
    stranger = agent_factory(node_config(make_config, scratch, "stranger", foreign, **FAST))
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 3)
    with AgentClient(a.config.endpoint) as producer:
        stored(producer, list(range(6)))
    with AgentClient(b.config.endpoint) as member:
        wait_for(lambda: member.lookup(NS, [key(i) for i in range(6)]).where == [1] * 6)
        assert sorted(member.stats().peers) == [endpoint_of(scratch, "node-a")]
    with AgentClient(stranger.config.endpoint) as outsider:
        assert outsider.stats().peers == []
        source = endpoint_of(scratch, "node-a")
        assert outsider.lookup(NS, [key(0)], source=source).where == [-1]
        assert load_exact(outsider, [0, 1]) == [False, False]
        assert peer_stats(outsider).peer.refused_sources == 1


def test_a_forged_source_or_holder_is_never_dialled(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """`kvtier_source` can be set by an end user through vLLM's API, and an announcement can
    name any holder: an endpoint that is not a live member of the tier is refused and
    counted, and the agent never connects to it (nor sends anyone else there)."""
    keys = scratch / "curve"
    write_keys(keys)
    ring = load_keys(keys)
    a = agent_factory(node_config(make_config, scratch, "node-a", keys, **FAST))
    b = agent_factory(node_config(make_config, scratch, "node-b", keys, **FAST))
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(1.0)
    forged = f"tcp://127.0.0.1:{trap.getsockname()[1]}"
    ids = [900, 901]
    with AgentClient(b.config.endpoint) as asker:
        assert asker.lookup(NS, [key(i) for i in ids], source=forged).where == [-1, -1]
        outs = [np.zeros(ROW, np.uint8) for _ in ids]
        assert asker.load_into(NS, [key(i) for i in ids], outs, source=forged) == [False] * 2
        assert peer_stats(asker).peer.refused_sources == 2
        # An announcement naming the forged holder, sent with the tier's own key to every
        # member (so whichever is the keys' home gets it), is refused there.
        for node in ("node-a", "node-b"):
            reply = ask(
                endpoint_of(scratch, node),
                Announce(NS, [key(i) for i in ids], forged),
                (ring.public, ring.secret, ring.public),
                wait=0.3,
            )
            assert reply is None  # one-way
        time.sleep(0.5)
        assert asker.lookup(NS, [key(i) for i in ids]).where == [-1, -1]
        refused = 0
        for config in (a.config, b.config):
            with AgentClient(config.endpoint) as client:
                refused += peer_stats(client).peer.refused_requests
        assert refused == 2
    with pytest.raises(TimeoutError):
        trap.accept()  # nobody ever connected to the forged address
    trap.close()


def test_nixl_metadata_goes_only_to_members(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """NIXL metadata is published nowhere (not in the registry) and given over the
    authenticated channel only to a live member asking from its own address."""
    keys = scratch / "curve"
    write_keys(keys)
    ring = load_keys(keys)
    data_path = "nixl" if available() else "zmq"
    agent_factory(node_config(make_config, scratch, "node-a", keys, dataPath=data_path, **FAST))
    agent_factory(node_config(make_config, scratch, "node-b", keys, dataPath=data_path, **FAST))
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    record = json.loads((scratch / "registry" / "node-a.json").read_text())
    assert set(record) == {"node", "endpoint", "curveKey", "status"}
    assert record["curveKey"] == ring.public.decode()
    target, member = endpoint_of(scratch, "node-a"), endpoint_of(scratch, "node-b")
    keyed = (ring.public, ring.secret, ring.public)
    for asker in ("", "tcp://127.0.0.1:1", "ipc:///tmp/not-a-member"):
        assert ask(target, NixlHello(asker), keyed) == [b"", Answer.REFUSED.encode()], asker
    assert ask(target, NixlHello(member), None) is None  # no key: no answer at all
    answer = ask(target, NixlHello(member), keyed)
    assert answer is not None and len(answer) == 1
    assert bool(answer[0]) == (data_path == "nixl")


def shares(scratch: Path, source: AgentProcess, target: AgentProcess, ids: list[int]) -> list[bool]:
    """Chunks stored on `source` are found through the directory and loaded intact on
    `target`."""
    with AgentClient(source.config.endpoint) as producer:
        stored(producer, ids)
    with AgentClient(target.config.endpoint) as consumer:
        wait_for(lambda: consumer.lookup(NS, [key(i) for i in ids]).where == [1] * len(ids))
        return load_exact(consumer, ids)


def set_keys(directory: Path, pair: Path, trusted: list[Path]) -> None:
    """What the Secret holds, as an agent that starts now reads it."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for name in ("public.key", "secret.key"):
        shutil.copy(pair / name, directory / name)
    listed = [(p / "public.key").read_bytes() for p in trusted]
    if listed:
        (directory / "trusted.keys").write_bytes(b"\n".join(listed) + b"\n")


def test_a_key_rotation_keeps_every_pair_of_agents_talking(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """The documented rotation (docs/upgrading.md), one agent restarted at a time as a
    DaemonSet rolls: (1) the new public key is added to trusted.keys, (2) the new pair
    replaces the old one, which stays trusted, (3) the old key is dropped. After every single
    restart both agents fetch each other's chunks."""
    old, new = scratch / "old", scratch / "new"
    write_keys(old)
    write_keys(new)
    dirs = {n: scratch / f"keys-{n}" for n in ("node-a", "node-b")}
    for d in dirs.values():
        set_keys(d, old, [])
    agents: dict[str, AgentProcess] = {
        n: agent_factory(node_config(make_config, scratch, n, d, **FAST)) for n, d in dirs.items()
    }
    ids = itertools.count(0, 2)

    def both_ways() -> None:
        a, b = agents["node-a"], agents["node-b"]
        first, second = next(ids), next(ids)
        assert shares(scratch, a, b, [first]) == [True]
        assert shares(scratch, b, a, [second]) == [True]

    both_ways()
    steps: list[tuple[Path, list[Path]]] = [(old, [new]), (new, [old]), (new, [])]
    for pair, trusted in steps:
        for node, directory in dirs.items():
            set_keys(directory, pair, trusted)
            agents[node].stop()
            agents[node].start()
            both_ways()
    for node in dirs:
        record = json.loads((scratch / "registry" / f"{node}.json").read_text())
        assert record["curveKey"] == (new / "public.key").read_text().strip()


def test_switching_on_authentication_rolls_without_errors(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """The rolling upgrade from an unauthenticated tier: while some agents have keys and
    some do not, the two groups do not talk (misses, at once, never errors or wrong bytes);
    once every agent has restarted with the keys, they share again."""
    keys = scratch / "curve"
    write_keys(keys)

    def start(node: str, with_keys: bool) -> AgentProcess:
        return agent_factory(
            node_config(make_config, scratch, node, keys if with_keys else None, **FAST)
        )

    a, b = start("node-a", False), start("node-b", False)
    assert shares(scratch, a, b, [0]) == [True]
    a.stop()
    a = start("node-a", True)
    with AgentClient(a.config.endpoint) as producer:
        stored(producer, [1])
    time.sleep(2 * FAST["membershipSeconds"] + 1.0)
    with AgentClient(b.config.endpoint) as unkeyed:
        assert unkeyed.lookup(NS, [key(1)]).where == [-1]
        started = time.monotonic()
        assert load_exact(unkeyed, [1]) == [False]
        assert time.monotonic() - started < 3
        assert peer_stats(unkeyed).counts.read_errors == 0
        assert unkeyed.stats().peers == []  # the keyed agent is not its member
    b.stop()
    b = start("node-b", True)
    assert shares(scratch, a, b, [2]) == [True]
    assert shares(scratch, b, a, [3]) == [True]


@pytest.mark.skipif(not available(), reason="NIXL is not installed")
def test_a_member_reads_over_nixl_only_the_slots_lent_to_it(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """A member (this test process, registered in the tier's registry with the tier's key)
    gets the holder's NIXL connection details, no registered memory; a loan registers just
    the lent bytes: they can be READ, the slot's header page and the next slot cannot."""
    import nixl_cu12._api as nixl

    keys = scratch / "curve"
    write_keys(keys)
    ring = load_keys(keys)
    holder = agent_factory(
        node_config(make_config, scratch, "holder", keys, dataPath="nixl", **FAST)
    )
    with AgentClient(holder.config.endpoint) as producer:
        stored(producer, [0, 1])
        wait_for(lambda: peer_stats(producer).counts.writebacks == 2)
    target = endpoint_of(scratch, "holder")
    me = "tcp://127.0.0.1:1"
    record = {
        "node": "probe",
        "endpoint": me,
        "curveKey": ring.public.decode(),
        "status": {"heartbeat": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    (scratch / "registry" / "probe.json").write_text(json.dumps(record))
    keyed = (ring.public, ring.secret, ring.public)
    # answered once the holder has read the new member (at most twenty re-reads a second)
    hello = wait_for(lambda: (h := ask(target, NixlHello(me), keyed)) and h[0] and h)

    agent = nixl.nixl_agent("probe", nixl.nixl_agent_config(backends=["UCX"]))
    buffer = np.zeros(2 * ROW, np.uint8)
    base = int(buffer.ctypes.data)
    agent.register_memory([(base, buffer.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(hello[0])
    remote = remote.decode() if isinstance(remote, bytes) else str(remote)

    def read(address: int, nbytes: int, patience: float = 5.0) -> str:
        """The transfer's end state, or the error NIXL refused it with (NOT_FOUND also while
        the connection is set up: retried for `patience` seconds)."""
        deadline = time.monotonic() + patience
        while True:
            try:
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs([(base, nbytes, 0)], "DRAM"),
                    agent.get_xfer_descs([(address, nbytes, 0)], "DRAM"),
                    remote,
                )
                state = agent.transfer(handle)
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(handle)
                agent.release_xfer_handle(handle)
                return str(state)
            except Exception as exc:
                if time.monotonic() > deadline:
                    return str(exc)
                time.sleep(0.05)

    reply = ask(target, Lend(NS, [key(0)]), keyed)
    assert reply is not None
    loan = decode_loan(reply[0])
    (lent,) = loan.chunks
    assert isinstance(lent, Lent) and loan.sections
    agent.add_remote_agent(loan.sections)
    assert read(lent.address, ROW) == "DONE"
    assert np.array_equal(buffer[:ROW], row(0, ROW))
    # connected now: a refusal is final
    assert "NOT_FOUND" in read(lent.address - 4096, 4096, 0.2)  # the slot's header page
    assert "NOT_FOUND" in read(lent.address + ROW, ROW, 0.2)  # past the lent bytes
    ask(target, Return(loan.lease), keyed, wait=0.2)
    with AgentClient(holder.config.endpoint) as producer:
        wait_for(lambda: peer_stats(producer).peer.lent == 0)


def test_the_peer_port_listens_on_the_pods_address_only(
    make_config: Callable[..., AgentConfig], scratch: Path
) -> None:
    """Bound to all addresses (the operator's `tcp://0.0.0.0:PORT`) with POD_IP set, as in
    a pod: the agent listens on that address alone, and advertises it."""
    port = 5557 + os.getpid() % 1000
    config = node_config(make_config, scratch, "pod", None, bind=f"tcp://0.0.0.0:{port}")
    with AgentProcess(config, prefix=["env", "POD_IP=127.0.0.1"]) as agent:
        assert agent.proc is not None
        assert endpoint_of(scratch, "pod") == f"tcp://127.0.0.1:{port}"
        listening = subprocess.run(
            ["ss", "-Hltnp"], check=True, capture_output=True, text=True
        ).stdout.splitlines()
        mine = [line.split()[3] for line in listening if f"pid={agent.pid}," in line]
        assert f"127.0.0.1:{port}" in mine
        assert f"0.0.0.0:{port}" not in mine and f"*:{port}" not in mine
