"""What agents of a tier say to each other over their peer endpoints (msgpack over ZMQ), and
how those channels are secured: CURVE with the cluster's key pair, which the operator mounts
from a Secret; a peer without it cannot complete the handshake."""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import zmq

RID = struct.Struct("<Q")  # request id, echoed in the reply
SENT, ABSENT, BUSY = "sent", "absent", "busy"  # BUSY: the holder lends too many slots already


class Announce(msgspec.Struct, tag="announce"):
    namespace: str
    keys: list[bytes]
    holder: str  # the holder's peer endpoint


class Withdraw(msgspec.Struct, tag="withdraw"):
    """The holder no longer holds these keys (its pool evicted them)."""

    namespace: str
    keys: list[bytes]
    holder: str


class Damaged(msgspec.Struct, tag="damaged"):
    """These chunks arrived failing their checksums: check your copies."""

    namespace: str
    keys: list[bytes]


class WhoHas(msgspec.Struct, tag="who_has"):
    namespace: str
    keys: list[bytes]


class Fetch(msgspec.Struct, tag="fetch"):
    """Send these chunks over ZMQ: answered with one status per key (`SENT`, `ABSENT`,
    `BUSY`), then a header frame and a payload frame per chunk sent."""

    namespace: str
    keys: list[bytes]


class Holds(msgspec.Struct, tag="holds"):
    """Direct mode: which of these keys does your pool hold?"""

    namespace: str
    keys: list[bytes]


class NixlHello(msgspec.Struct, tag="nixl_hello"):
    """Your NIXL agent metadata, please (empty when you have none)."""


class Lend(msgspec.Struct, tag="lend"):
    """Lease these chunks' slots for NIXL READs; answered with a `Loan`."""

    namespace: str
    keys: list[bytes]


class Return(msgspec.Struct, tag="return"):
    lease: int


class Lent(msgspec.Struct, array_like=True):
    address: int
    header: bytes


class Loan(msgspec.Struct):
    lease: int
    agent: str  # the holder's NIXL agent: a restarted holder has a new one
    chunks: list[Lent | str]  # or ABSENT / BUSY


PeerRequest = Announce | Withdraw | WhoHas | Fetch | Holds | NixlHello | Lend | Return | Damaged
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(PeerRequest).decode
decode_loan = msgspec.msgpack.Decoder(Loan).decode
decode_statuses = msgspec.msgpack.Decoder(list[str]).decode


def load_keys(directory: Path) -> tuple[bytes, bytes]:
    public = (directory / "public.key").read_bytes().strip()
    secret = (directory / "secret.key").read_bytes().strip()
    return public, secret


def write_keys(directory: Path) -> None:
    """A new cluster key pair (what the operator's Secret holds)."""
    public, secret = zmq.curve_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "public.key").write_bytes(public)
    (directory / "secret.key").write_bytes(secret)


def secure_client(sock: zmq.Socket[bytes], keys: tuple[bytes, bytes] | None) -> None:
    if keys is not None:
        public, secret = keys
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, public


class OnlyKey:
    def __init__(self, public: bytes) -> None:
        self.public = public  # Z85, as the authenticator hands client keys over

    def callback(self, domain: str, key: bytes) -> bool:
        return bool(key == self.public)
