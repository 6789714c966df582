"""What agents of a tier say to each other over their peer endpoints (msgpack over ZMQ), and
how those channels are secured: CURVE with the tier's key pair, which the operator mounts
from a Secret (one it creates when the spec names none); a peer without a trusted key cannot
complete the handshake."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import msgspec
import zmq

RID = struct.Struct("<Q")  # request id, echoed in the reply


class Answer(StrEnum):
    """A holder's per-chunk answer to a fetch or a loan, and its refusal of a request."""

    SENT = "sent"
    ABSENT = "absent"
    BUSY = "busy"  # the holder lends too many slots already
    REFUSED = "refused"  # the request named (or came from) something that is not a member


class ChunkKeys(msgspec.Struct):
    """A message about some chunks of one namespace; each kind is a subclass with its tag
    (the fields stay first on the wire, before any the kind adds)."""

    namespace: str
    keys: list[bytes]


class Announce(ChunkKeys, tag="announce"):
    holder: str  # the holder's peer endpoint


class Withdraw(ChunkKeys, tag="withdraw"):
    """The holder no longer holds these keys (its pool evicted them)."""

    holder: str


class Damaged(ChunkKeys, tag="damaged"):
    """These chunks arrived failing their checksums: check your copies."""


class WhoHas(ChunkKeys, tag="who_has"):
    """Which members hold these keys? Asked of the keys' home; answered with one holder's
    peer endpoint per key (empty where none)."""


class Fetch(ChunkKeys, tag="fetch"):
    """Send these chunks over ZMQ: answered with one `Answer` per key (sent, absent, busy),
    then a header frame and a payload frame per chunk sent."""


class Stream(ChunkKeys, tag="stream"):
    """Send these chunks over the stream (`stream.py`): answered with a `Streamed`;
    `secret` (the request's AES-128 key) and `ticket` travel only over CURVE. `sealed`:
    encrypted as well as authenticated."""

    secret: bytes
    ticket: bytes
    sealed: bool = False


class Streamed(msgspec.Struct):
    port: int  # the holder's stream port; 0: it has none (ask with `Fetch`)
    statuses: list[str]  # an Answer per key
    pages: list[bytes]  # the packed header of each chunk sent, in order


class Holds(ChunkKeys, tag="holds"):
    """Direct mode: which of these keys does your pool hold?"""


class NixlHello(msgspec.Struct, tag="nixl_hello"):
    """Your NIXL agent metadata, please (empty when you have none, or when `asker`, the
    asking agent's peer endpoint, is not a live member of the tier connecting from that
    endpoint's address)."""

    asker: str = ""


class Lend(ChunkKeys, tag="lend"):
    """Lease these chunks' slots for NIXL READs; answered with a `Loan`."""


class Return(msgspec.Struct, tag="return"):
    lease: int


class Lent(msgspec.Struct, array_like=True):
    address: int
    header: bytes


class Loan(msgspec.Struct):
    lease: int
    agent: str  # the holder's NIXL agent: a restarted holder has a new one
    chunks: list[Lent | str]  # or Answer.ABSENT / Answer.BUSY
    sections: bytes = b""  # NIXL metadata of the lent bytes, registered for this loan only


PeerRequest = (
    Announce | Withdraw | WhoHas | Fetch | Stream | Holds | NixlHello | Lend | Return | Damaged
)
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(PeerRequest).decode
decode_loan = msgspec.msgpack.Decoder(Loan).decode
decode_streamed = msgspec.msgpack.Decoder(Streamed).decode
decode_statuses = decode_holders = msgspec.msgpack.Decoder(list[str]).decode


@dataclass(frozen=True)
class KeyRing:
    """This agent's CURVE key pair (it serves and dials with it) and the public keys it
    trusts: its own, plus those `trusted.keys` lists (one Z85 key a line) while a new pair is
    rolled out. A peer is let in, and dialled, only with a trusted key."""

    public: bytes
    secret: bytes
    trusted: frozenset[bytes]


def load_keys(directory: Path) -> KeyRing:
    public = (directory / "public.key").read_bytes().strip()
    secret = (directory / "secret.key").read_bytes().strip()
    extra = directory / "trusted.keys"
    listed = extra.read_bytes().split() if extra.exists() else []
    return KeyRing(public, secret, frozenset([public, *listed]))


def write_keys(directory: Path) -> bytes:
    """A new key pair (what the operator's Secret holds); returns the public key. The secret
    is created readable by its owner alone (whatever the umask) and never over an existing
    one (FileExistsError, nothing written); the public key beside it replaces any there.
    Should the public key not be written, the new secret goes too: no half pair is left."""
    public, secret = zmq.curve_keypair()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_new(directory / "secret.key", secret, 0o600)
    try:
        _write_new(directory / "public.key", public, 0o644, replace=True)
    except BaseException:
        (directory / "secret.key").unlink(missing_ok=True)
        raise
    return public


def _write_new(path: Path, data: bytes, mode: int, replace: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if replace else os.O_EXCL)
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
        os.write(fd, data)
    finally:
        os.close(fd)


def secure_client(sock: zmq.Socket[bytes], keys: KeyRing | None, server_key: bytes) -> None:
    """Dial with this agent's key pair a peer serving with `server_key`."""
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
        sock.curve_serverkey = server_key


class TrustedKeys:
    """The authenticator's check of a connecting peer's public key; refusals counted."""

    def __init__(self, trusted: frozenset[bytes]) -> None:
        self.trusted = trusted  # Z85, as the authenticator hands client keys over
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.trusted:
            return True
        self.refused += 1
        return False


_context: zmq.Context[zmq.Socket[bytes]] | None = None


def context() -> zmq.Context[zmq.Socket[bytes]]:
    """The peer tier's own ZMQ context, with an I/O thread per core (up to 4): CURVE
    encrypts and decrypts in the I/O threads, so with one (the default) every peer
    connection's bytes would go through a single core."""
    global _context
    if _context is None:
        _context = zmq.Context(io_threads=max(1, min(4, os.cpu_count() or 1)))
    return _context


def bind_on_pod_address(sock: zmq.Socket[bytes], address: str) -> str:
    """Bind `address` (`tcp://0.0.0.0:PORT`) on the pod's own address where POD_IP names it
    (the operator sets it: the port then listens on the pod network alone), an IPv6 one in
    brackets with the socket switched to IPv6; returns the endpoint to advertise."""
    pod_ip = os.environ.get("POD_IP", "")
    listen = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    if ":" in pod_ip:
        sock.ipv6 = True
    sock.bind(address.replace("0.0.0.0", listen) if listen else address)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound.replace("0.0.0.0", listen or socket.gethostname())
