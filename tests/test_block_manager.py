"""BlockManager: lifecycle, dedup, admission, policies, and hypothesis state-machine invariants."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from connector.block_manager import BlockManager


def test_store_lookup_load_cycle_and_dedup():
    m = BlockManager(4)
    p = m.prepare_store(["a", "b", "c"])
    assert p.slots == [0, 1, 2]
    assert m.lookup(["a", "b"]) == 0  # not ready before complete
    assert m.prepare_store(["a", "d"]).hashes == ["d"]  # a in flight: deduplicated
    m.complete_store(["a", "b", "c"])
    assert m.lookup(["a", "b", "c", "x"]) == 3
    assert m.lookup(["b"]) == 1 and m.lookup(["x", "a"]) == 0  # prefix semantics
    assert m.prepare_load(["a", "b"]) == [0, 1]
    m.complete_load(["a", "b"])
    assert m.counters.hit_blocks == 4 and m.counters.loaded_blocks == 2
    assert ("stored", "a") in m.take_events() and m.take_events() == []


def test_failed_store_is_never_a_hit():
    m = BlockManager(2)
    m.prepare_store(["a"])
    m.complete_store(["a"], success=False)
    assert m.lookup(["a"]) == 0 and m.used == 0 and m.counters.failed_stores == 1


def test_lru_eviction_skips_pinned_blocks():
    m = BlockManager(2)
    m.prepare_store(["a", "b"])
    m.complete_store(["a", "b"])
    m.prepare_load(["a"])  # a pinned
    p = m.prepare_store(["c"])
    assert p.evicted == ["b"] and p.slots == [1]
    m.complete_store(["c"])
    p = m.prepare_store(["d"])  # a pinned, c newest but only candidate
    assert p.evicted == ["c"]
    m.complete_load(["a"])
    assert m.lookup(["a"]) == 1


def test_no_room_when_everything_is_pinned():
    m = BlockManager(1)
    m.prepare_store(["a"])
    p = m.prepare_store(["b"])  # a still being stored
    assert p.hashes == [] and m.counters.store_rejected == 1


def test_admission_threshold():
    m = BlockManager(4, admit_after=2)
    assert m.prepare_store(["a"]).hashes == []
    m.lookup(["a"])
    assert m.prepare_store(["a"]).hashes == []
    m.lookup(["a"])
    assert m.prepare_store(["a"]).hashes == ["a"]


def test_arc_prefers_frequent_blocks():
    m = BlockManager(3, policy="arc")
    for h in "abc":
        m.prepare_store([h])
        m.complete_store([h])
    for _ in range(3):
        m.prepare_load(["a"])
        m.complete_load(["a"])  # a moves to the frequency list
    m.prepare_store(["d"])
    assert m.is_ready("a")  # a recency-only block went first


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockManager(0)
    with pytest.raises(ValueError):
        BlockManager(2, policy="fifo")
    m = BlockManager(2)
    with pytest.raises(KeyError):
        m.prepare_load(["zz"])
    with pytest.raises(RuntimeError):
        m.complete_store(["zz"])


def test_grow_capacity():
    m = BlockManager(1)
    m.prepare_store(["a"])
    assert m.prepare_store(["b"]).hashes == []
    m.set_capacity(3)
    assert m.prepare_store(["b", "c"]).slots == [1, 2]


class ManagerMachine(RuleBasedStateMachine):
    """Random interleavings of the lifecycle against the four invariants."""

    def __init__(self):
        super().__init__()
        self.cap = 4
        self.m = BlockManager(self.cap, policy="arc" if id(self) % 2 else "lru")
        self.storing = {}   # hash -> slot, store in flight
        self.loading = []   # list of hash tuples in flight
        self.data = {}      # slot -> hash written there (simulated bytes)
        self.evicted = set()
        self.stored = set()

    keys = st.sampled_from([f"h{i}" for i in range(8)])

    @rule(hs=st.lists(keys, min_size=1, max_size=4, unique=True))
    def store(self, hs):
        p = self.m.prepare_store(hs)
        for h in p.evicted:
            assert h not in self.storing and all(h not in l for l in self.loading), "evicted in-flight block"
            self.evicted.add(h)
            self.stored.discard(h)
        for h, s in zip(p.hashes, p.slots):
            assert s not in {v for v in self.storing.values()}, "slot handed out twice"
            self.storing[h] = s

    @precondition(lambda self: self.storing)
    @rule(ok=st.booleans(), data=st.data())
    def finish_store(self, ok, data):
        h = data.draw(st.sampled_from(sorted(self.storing)))
        s = self.storing.pop(h)
        if ok:
            self.data[s] = h
            self.stored.add(h)
            self.evicted.discard(h)
        self.m.complete_store([h], ok)

    @rule(hs=st.lists(keys, min_size=1, max_size=4, unique=True))
    def lookup_and_load(self, hs):
        n = self.m.lookup(hs)
        for h in hs[:n]:
            assert h in self.stored, "hit on a block that is not fully stored"
        if n:
            slots = self.m.prepare_load(hs[:n])
            for h, s in zip(hs[:n], slots):
                assert self.data[s] == h, "load would read another block's bytes"
            self.loading.append(tuple(hs[:n]))

    @precondition(lambda self: self.loading)
    @rule()
    def finish_load(self):
        self.m.complete_load(list(self.loading.pop(0)))

    @invariant()
    def capacity_never_exceeded(self):
        assert self.m.used <= self.cap
        assert len(set(b.slot for b in self.m.blocks.values())) == self.m.used

    @invariant()
    def stored_blocks_retrievable_or_evicted_with_event(self):
        for h in self.stored:
            assert self.m.is_ready(h)
        evs = {h for kind, h in self.m.events if kind == "evicted"}
        assert self.evicted <= evs


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
