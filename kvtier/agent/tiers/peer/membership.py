"""Who belongs to a peer tier: the agents the registry lists with a fresh heartbeat and a key
this agent trusts (or, during the rolling upgrade from an unauthenticated tier, no key on
either side). Keys are homed among these members, and only these are asked, dialled or
answered.

Threading: `live` may be called from any thread; it swaps whole immutable values, so readers
of `members` and `member_set` see one membership or the next, never a mix.
"""

from __future__ import annotations

import datetime as dt
import time

from kvtier.agent.report.registry import Member, Registry
from kvtier.agent.tiers.peer.wire import KeyRing


class Membership:
    def __init__(
        self,
        me: str,
        registry: Registry,
        keys: KeyRing | None,
        stale_after: float,
        reread_seconds: float,
    ) -> None:
        """`stale_after`: seconds without a heartbeat after which an agent counts as gone;
        `reread_seconds`: how long a read of the registry is used."""
        self.me = me
        self._registry = registry
        self._keys = keys
        self._stale_after = stale_after
        self._reread_seconds = reread_seconds
        self._server_keys: dict[str, bytes] = {}  # member endpoint -> the key it serves with
        self.members: list[str] = [me]
        self.member_set: frozenset[str] = frozenset(self.members)
        self._read_at = -float("inf")

    def live(self, fresh_within: float | None = None) -> list[str]:
        """Agents with a fresh heartbeat, re-read from the registry every `reread_seconds`
        (or when older than `fresh_within`; the Kubernetes registry answers from its watch,
        the file registry reads the directory)."""
        now = time.monotonic()
        limit = self._reread_seconds if fresh_within is None else fresh_within
        if now - self._read_at > limit:
            cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=self._stale_after)
            fresh = [
                m
                for m in self._registry.members()
                if (m.heartbeat is None or m.heartbeat > cutoff) and self._reachable(m)
            ]
            self._server_keys = {m.endpoint: (m.curve_key or "").encode() for m in fresh}
            self.members = sorted({m.endpoint for m in fresh} | {self.me})
            self.member_set = frozenset(self.members)
            self._read_at = now
        return self.members

    def _reachable(self, member: Member) -> bool:
        """Whether this agent can talk to `member`: both authenticated, with a key this
        agent trusts, or both not (during the rolling upgrade from an unauthenticated tier
        the two kinds form separate groups, each with its own directory, and miss the other's
        chunks until the roll-out ends)."""
        if self._keys is None:
            return not member.curve_key
        return member.curve_key is not None and member.curve_key.encode() in self._keys.trusted

    def is_member(self, endpoint: str) -> bool:
        """Whether `endpoint` is a live agent of this tier; one not known yet makes the
        membership be re-read (at most twenty times a second), so a node that just joined is
        not refused for long."""
        if endpoint in self.member_set:
            return True
        self.live(fresh_within=min(0.05, self._reread_seconds))
        return endpoint in self.member_set

    def server_key(self, endpoint: str) -> bytes:
        """The CURVE key `endpoint` serves with, as its report says (b"" when unknown)."""
        return self._server_keys.get(endpoint, b"")

    def peers(self) -> list[str]:
        """The other live agents' peer endpoints (as last read)."""
        return [m for m in self.members if m != self.me]
