"""Hostile requests for a live agent: malformed, oversized, of the wrong type, naming leases
and locks that are not the sender's. Every one must be refused (answered with an error, or,
one-way, dropped) without changing anything; a snapshot of the agent's state tells."""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient
from kvtier.shm.pool import PoolMap

LONG_NS = "n" * 300
WIDE_NS = "\u20ac" * 100  # 100 characters, 300 bytes
STATE = ("chunks", "leases", "pinned_slots", "free_slots", "evictions", "namespaces")


@dataclass(frozen=True)
class Hostile:
    """One request: its body, and whether it goes one-way (no reply expected)."""

    body: bytes
    one_way: bool = False
    what: str = ""


def snapshot(client: AgentClient, pool_path: Path) -> tuple[Any, ...]:
    """The index, leases and pool headers as a refused request must leave them."""
    stats = client.stats()
    pool = PoolMap.open(pool_path, populate=False)
    try:
        headers = hashlib.sha256()
        for slot in range(pool.geometry.slot_count):
            headers.update(pool.header(slot).tobytes())
    finally:
        pool.close()
    return (*tuple(getattr(stats.host, k) for k in STATE), headers.hexdigest())


def _msg(tag: str, **fields: Any) -> bytes:
    return msgspec.msgpack.encode({"type": tag, **fields})


def per_message_type(
    ns: str, slot_bytes: int, foreign: list[int], own_store: int, own_load: int
) -> Iterator[Hostile]:
    """Malformed and hostile variants of every request type: `foreign` are leases another
    client holds, `own_*` the sender's own leases, used with the other kind's request."""
    key = b"k"
    for name, lock in [
        ("../x", "a.lock"),
        ("a:b", "a.lock"),
        ("x" * 200, "a.lock"),
        ("ok", "../../etc/passwd"),
        ("ok", "a/b.lock"),
        ("ok", "none.lock"),
    ]:
        yield Hostile(_msg("hello", client=name, lock=lock), what=f"hello {name!r} {lock!r}")
    yield Hostile(_msg("hello", client="ok", lock="a.lock", protocol=1), what="old protocol")
    yield Hostile(_msg("hello", client=1, lock=2), what="hello types")
    for tag in ("lookup", "begin_load"):
        yield Hostile(_msg(tag, namespace=LONG_NS, keys=[key]), what=f"{tag} long ns")
        yield Hostile(_msg(tag, namespace=WIDE_NS, keys=[key]), what=f"{tag} wide ns")
        yield Hostile(_msg(tag, namespace=ns, keys=[b"k" * 2000]), what=f"{tag} long key")
        yield Hostile(_msg(tag, namespace=ns, keys=[b""]), what=f"{tag} empty key")
        yield Hostile(_msg(tag, namespace=ns, keys=[key] * (p.MAX_KEYS + 1)), what=f"{tag} keys")
        yield Hostile(_msg(tag, namespace=ns, keys=[1, 2]), what=f"{tag} key types")
        yield Hostile(_msg(tag, namespace=ns, keys=[key], source="s" * 600), what=f"{tag} source")
    for nbytes in (0, -1, slot_bytes + 1, 1 << 40, "many"):
        yield Hostile(
            _msg("allocate", namespace=ns, keys=[key], nbytes=nbytes), what=f"nbytes {nbytes}"
        )
    yield Hostile(
        _msg("allocate", namespace=LONG_NS, keys=[key, b"l", b"m"], nbytes=1), what="alloc long ns"
    )
    yield Hostile(_msg("allocate", namespace=WIDE_NS, keys=[key], nbytes=1), what="alloc wide ns")
    yield Hostile(
        _msg("allocate", namespace=ns, keys=[b"k" * 2000], nbytes=1), what="alloc long key"
    )
    bogus: list[Any] = [12345, -1, (1 << 64) - 1, "x"]
    for lease in [*foreign, own_load, *bogus]:
        yield Hostile(_msg("commit", lease=lease), what=f"commit {lease!r}")
    for tag, wrong_kind in (("abort", own_load), ("end_load", own_store)):
        for lease in [*foreign, wrong_kind, *bogus]:
            yield Hostile(_msg(tag, lease=lease), one_way=True, what=f"{tag} {lease!r}")
    yield Hostile(_msg("events", namespace=ns, after=-1), what="events after")
    yield Hostile(_msg("events", namespace=LONG_NS, after=0), what="events ns")
    yield Hostile(_msg("no-such-request"), what="unknown tag")
    yield Hostile(b"", what="empty body")
    yield Hostile(b"\xc1\xff\x00garbage", what="not msgpack")
    yield Hostile(msgspec.msgpack.encode([1, 2, 3]), what="not a map")
    yield Hostile(_msg("lookup", namespace=ns, keys=[key])[:-3], what="truncated")
    for sent in (b"\0" * 7, b"\0" * 16, "abcdefgh", [1]):  # one 8-byte digest a key, or none
        yield Hostile(_msg("lookup", namespace=ns, keys=[key], digests=sent), what="digests")


# Values each field must refuse.
_INVALID: dict[str, list[Any]] = {
    "namespace": [None, "", "x" * 5000, LONG_NS, WIDE_NS, 5, [], b"ns"],
    "keys": [None, [b""], [b"k" * 2000], "abc", [1], {}, [[b"a"]]],
    "nbytes": [0, -1, 1 << 63, "x", None, 2.5],
    "after": [-1, "x", None, (1 << 64) - 1],
    "client": ["", "a/b", "x" * 300, None, 3, "a:b"],
    "lock": ["", "../x.lock", None, "a", "a/b.lock", "missing.lock"],
}


def random_hostile(rng: random.Random, ns: str, leases: list[int]) -> Hostile:
    """A random request that must be refused: random bytes, an unknown tag, a lease that is
    not the sender's, or a valid shape with one field given a value it must refuse."""
    roll = rng.random()
    if roll < 0.1:
        return Hostile(rng.randbytes(rng.randrange(64)), what="random bytes")
    if roll < 0.2:
        return Hostile(_msg(rng.choice(["x", "Hello", "commit ", ""]), lease=1), what="tag")
    if roll < 0.4:
        tag = rng.choice(["commit", "abort", "end_load"])
        lease = rng.choice(leases) if leases and rng.random() < 0.5 else rng.randrange(1 << 62)
        return Hostile(_msg(tag, lease=lease), one_way=tag != "commit", what=f"{tag} {lease}")
    template: dict[str, Any] = rng.choice(
        [
            {"type": "lookup", "namespace": ns, "keys": [b"a"]},
            {"type": "allocate", "namespace": ns, "keys": [b"a"], "nbytes": 1},
            {"type": "begin_load", "namespace": ns, "keys": [b"a"]},
            {"type": "events", "namespace": ns, "after": 0},
            {"type": "hello", "client": "c", "lock": "c.lock"},
        ]
    )
    field = rng.choice([k for k in template if k != "type"])
    template[field] = rng.choice(_INVALID[field])
    return Hostile(msgspec.msgpack.encode(template), what=f"{template['type']} {field}")


def rid(n: int) -> bytes:
    return struct.pack("<Q", n + 1)
