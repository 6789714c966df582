"""ARC against Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache" (FAST
2003), Figure 4: the paper's cases one by one, then its pseudocode written out literally and
compared list by list with the agent's ARC driven through the host index."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.agent.host.index import HostIndex
from kvtier.agent.host.policy import ARCPolicy

NS = "ns"


class PaperARC:
    """ARC(c) as printed in Figure 4, one `request(x)` per reference; lists are LRU → MRU."""

    def __init__(self, c: int) -> None:
        self.c = c
        self.p = 0.0
        self.t1: OrderedDict[str, None] = OrderedDict()
        self.t2: OrderedDict[str, None] = OrderedDict()
        self.b1: OrderedDict[str, None] = OrderedDict()
        self.b2: OrderedDict[str, None] = OrderedDict()

    def replace(self, x: str) -> None:
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            self.b1[self.t1.popitem(last=False)[0]] = None
        else:
            self.b2[self.t2.popitem(last=False)[0]] = None

    def request(self, x: str) -> None:
        if x in self.t1 or x in self.t2:  # Case I
            self.t1.pop(x, None)
            self.t2.pop(x, None)
            self.t2[x] = None
        elif x in self.b1:  # Case II
            d1 = 1.0 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(float(self.c), self.p + d1)
            self.replace(x)
            del self.b1[x]
            self.t2[x] = None
        elif x in self.b2:  # Case III
            d2 = 1.0 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(0.0, self.p - d2)
            self.replace(x)
            del self.b2[x]
            self.t2[x] = None
        else:  # Case IV
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == self.c:  # Case A
                if len(self.t1) < self.c:
                    self.b1.popitem(last=False)
                    self.replace(x)
                else:
                    self.t1.popitem(last=False)
            elif total >= self.c:  # Case B
                if total == 2 * self.c:
                    self.b2.popitem(last=False)
                self.replace(x)
            self.t1[x] = None


class IndexedARC:
    """The agent's ARC as the agent drives it: a lookup, then a store of a miss (REPLACE
    runs when the store takes a slot from a full pool; the chunk enters at commit)."""

    def __init__(self, c: int) -> None:
        self.arc = ARCPolicy(c)
        self.index = HostIndex(c, self.arc)
        self.evicted: list[str] = []

    def request(self, x: str) -> None:
        key = x.encode()
        hits, _prefix = self.index.lookup(NS, [key])
        if hits[0]:
            self.index.touch()
            return
        before = {k[1] for k in list(self.arc.t1) + list(self.arc.t2)}  # type: ignore[index]
        lease = self.index.allocate("c", NS, [key], 1, 1e18)[0]
        self.index.commit(lease, "c")
        after = {k[1] for k in list(self.arc.t1) + list(self.arc.t2)}  # type: ignore[index]
        self.evicted += sorted(k.decode() for k in before - after)

    def lists(self) -> tuple[list[str], ...]:
        return tuple(
            [k[1].decode() for k in lst]  # type: ignore[index]
            for lst in (self.arc.t1, self.arc.t2, self.arc.b1, self.arc.b2)
        )


def paper_lists(arc: PaperARC) -> tuple[list[str], ...]:
    return tuple(list(lst) for lst in (arc.t1, arc.t2, arc.b1, arc.b2))


def replay(c: int, refs: str) -> tuple[PaperARC, IndexedARC]:
    paper, ours = PaperARC(c), IndexedARC(c)
    for step, x in enumerate(refs):
        paper.request(x)
        ours.request(x)
        assert ours.lists() == paper_lists(paper), (step, x)
        assert ours.arc.p == paper.p, (step, x)
    return paper, ours


def test_case_i_hit_moves_to_mru_of_t2() -> None:
    _paper, ours = replay(4, "abca")
    assert ours.lists() == (["b", "c"], ["a"], [], [])


def test_case_iv_a_full_t1_drops_its_lru_without_a_ghost() -> None:
    _paper, ours = replay(3, "abcd")
    assert ours.lists() == (["b", "c", "d"], [], [], [])
    assert ours.evicted == ["a"]


def test_case_iv_a_and_b_fill_the_ghost_lists() -> None:
    # T1 full then shared with T2: evictions from T1 are remembered in B1.
    _paper, ours = replay(3, "abbcde")
    _t1, t2, b1, b2 = ours.lists()
    assert t2 == ["b"] and b1 and not b2


def test_case_ii_ghost_hit_in_b1_grows_p_before_replace() -> None:
    paper, ours = replay(4, "xyzaag")  # T1=[x,y,z] after a's promotion; g evicts x
    assert ours.evicted[-1] == "x" and "x" in ours.lists()[2]
    paper, ours = replay(4, "xyzaagx")  # x comes back from B1: p 0 -> 1, then REPLACE
    assert ours.arc.p == paper.p == 1.0
    assert ours.lists()[1][-1] == "x"


def test_case_iii_ghost_hit_in_b2_shrinks_p_and_the_tie_rule() -> None:
    # Before the last c: T1=[b], T2=[a,d], B2=[c], p=2. c comes back from B2: p drops to 1
    # first, so |T1| = p and, the chunk coming from B2, REPLACE takes T1's b (with p still
    # 2 it would take T2's a).
    paper, ours = replay(3, "adccbad")
    assert ours.lists() == (["b"], ["a", "d"], [], ["c"]) and ours.arc.p == 2.0
    paper, ours = replay(3, "adccbadc")
    assert ours.arc.p == paper.p == 1.0
    assert ours.evicted[-1] == "b"
    assert ours.lists() == ([], ["a", "d", "c"], ["b"], [])


def test_issue_hand_built_case_evicts_what_the_paper_evicts() -> None:
    """T1=[x,y,z], T2=[a], p=2, B1=[g]: a ghost hit on g. The paper adapts first (p=3), so
    |T1|=3 is not above p and REPLACE takes T2's LRU, a (adapting after REPLACE, or
    comparing with int(p), would evict x)."""
    arc = ARCPolicy(4)
    index = HostIndex(4, arc)
    for key in (b"x", b"y", b"z", b"a"):
        index.commit(index.allocate("c", NS, [key], 1, 1e18)[0], "c")
    index.lookup(NS, [b"a"])
    index.touch()
    arc.b1[(NS, b"g")] = None
    arc.p = 2.0
    assert [k[1] for k in arc.t1] == [b"x", b"y", b"z"]  # type: ignore[index]
    assert [k[1] for k in arc.t2] == [b"a"]  # type: ignore[index]

    lease = index.allocate("c", NS, [b"g"], 1, 1e18)[0]
    assert arc.p == 3.0
    assert index.get(NS, b"a") is None and index.get(NS, b"x") is not None
    assert (NS, b"a") in arc.b2
    index.commit(lease, "c")
    assert arc.p == 3.0  # adapted once, not again at commit
    assert list(arc.t2)[-1] == (NS, b"g")

    paper = PaperARC(4)
    paper.t1.update(dict.fromkeys("xyz"))
    paper.t2["a"] = None
    paper.b1["g"] = None
    paper.p = 2.0
    paper.request("g")
    assert paper.p == 3.0 and "a" in paper.b2 and list(paper.t1) == ["x", "y", "z"]


def test_ghost_hit_into_a_free_slot_adapts_at_insert() -> None:
    arc = ARCPolicy(4)
    arc.b1["g"] = None
    arc.on_insert("g")
    assert arc.p == 1.0 and list(arc.t2) == ["g"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcdefghij", max_size=120), st.integers(1, 6))
def test_matches_the_papers_pseudocode_step_by_step(refs: str, c: int) -> None:
    replay(c, refs)
