"""Scheduler-side block manager for the host pool: pure Python, no GPU.

Keys are block hashes (any hashable; vLLM's are bytes). Each stored block
occupies one slot of the host pool. Lifecycle:

    lookup(hashes)                -> how many leading blocks are ready (a hit)
    prepare_load(hashes)          -> slots to read; pins them (ref count)
    complete_load(hashes)         -> unpins
    prepare_store(hashes)         -> StorePlan: new slots to write (dedup:
                                     blocks already stored or in flight are
                                     skipped); may evict unpinned ready blocks
    complete_store(hashes, ok)    -> ready (hit-able) if ok, else dropped
    reset()                       -> forgets every block, in flight or not
                                     (the caller's transfers of that era must
                                     be finished or waited for before the
                                     slots are written again)

Invariants (checked by tests/test_block_manager.py with hypothesis):
  * no more than `capacity` slots are ever in use;
  * a block that is not fully stored is never reported as a hit;
  * a block being loaded or stored is never evicted or handed out;
  * every stored block is retrievable or was evicted with an event.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from typing import Hashable, Iterable, Iterator, Optional, Protocol, Sequence


class EvictionPolicy(Protocol):
    """victims(): the candidates, best first, as a LIVE view (no copy: eviction is O(1) per
    victim however large the pool): the caller stops iterating once it has removed a key."""

    def touch(self, key: Hashable) -> None: ...
    def insert(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def victims(self) -> Iterable[Hashable]: ...
    def clear(self) -> None: ...


class LRUPolicy:
    """Least recently used first (an OrderedDict: oldest first; touch/insert/remove O(1))."""

    def __init__(self) -> None:
        self._od: OrderedDict = OrderedDict()

    def touch(self, key: Hashable) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        self._od[key] = None
        self._od.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._od.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._od)  # live: the caller stops after a remove (EvictionPolicy)

    def clear(self) -> None:
        self._od.clear()


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha): recency list T1, frequency list T2,
    ghost lists B1/B2 steer the target size p of T1."""

    def __init__(self, capacity: int) -> None:
        self.c = max(1, capacity)
        self.p = 0
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    def touch(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        if key in self.b1:
            self.p = min(self.c, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.c:
                ghost.popitem(last=False)

    def remove(self, key: Hashable) -> None:
        # an eviction: remember it in the matching ghost list
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None

    def victims(self) -> Iterator[Hashable]:
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        return chain(first, second)  # live: the caller stops after a remove (EvictionPolicy)

    def clear(self) -> None:
        self.p = 0
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()


@dataclass
class _Block:
    slot: int
    ready: bool = False
    refs: int = 0  # in-flight loads + the store while not ready


@dataclass
class StorePlan:
    """What a store must write: `hashes[i]` goes to host slot `slots[i]`."""

    hashes: list
    slots: list
    evicted: list = field(default_factory=list)


@dataclass
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    failed_stores: int = 0
    loaded_blocks: int = 0
    evictions: int = 0
    store_rejected: int = 0  # no room: every candidate was pinned


class BlockManager:
    """Maps block hashes to host-pool slots.

    Args:
      capacity: slots in the host pool (may grow later with `set_capacity`,
        e.g. while a lazily pinned pool registers its chunks).
      policy: "lru" or "arc", or an EvictionPolicy instance.
      admit_after: store a block only after it was looked up this many times
        (0: store everything, and no lookup is counted).
      block_bytes: size of one block, for byte counters.
      seen_limit: most admission counts kept (admit_after > 0 only); the least recently
        looked-up key's count goes first, as vLLM's CPU manager bounds its own
        (max_tracker_size). Why a bound: a key that misses and is never stored (its request
        aborted, its store refused or dropped by a reset) would otherwise stay counted for
        the life of the engine, a few hundred bytes per such key, without end in a server.
    """

    def __init__(self, capacity: int, policy: str | EvictionPolicy = "lru", admit_after: int = 0,
                 block_bytes: int = 0, seen_limit: int = 64_000) -> None:
        if seen_limit < 1:
            raise ValueError(f"seen_limit must be at least 1, got {seen_limit}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least one block, got {capacity}")
        self.capacity = capacity
        self.block_bytes = block_bytes
        self.admit_after = admit_after
        if policy == "lru":
            policy = LRUPolicy()
        elif policy == "arc":
            policy = ARCPolicy(capacity)
        elif isinstance(policy, str):
            raise ValueError(f"unknown eviction policy {policy!r}; use 'lru' or 'arc'")
        self.policy = policy
        self.blocks: dict = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.seen: OrderedDict = OrderedDict()  # key -> lookups that missed (admit_after > 0), LRU order
        self.seen_limit = seen_limit
        self.events: list = []  # ("stored" | "evicted", hash)
        self.counters = Counters()
        self.evictable = 0  # ready blocks no load holds: a full pool of pinned ones refuses in O(1)

    # ---------------------------------------------------------------- queries
    def lookup(self, hashes: Sequence[Hashable]) -> int:
        """Number of leading blocks that are stored and ready."""
        self.counters.lookups += 1
        n = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.ready:
                break
            n += 1
        if self.admit_after:
            seen = self.seen
            for h in hashes[n:]:
                c = seen.pop(h, 0) + 1  # re-inserted last: the most recently looked up
                if len(seen) >= self.seen_limit:
                    seen.popitem(last=False)
                seen[h] = c
        self.counters.hit_blocks += n
        self.counters.miss_blocks += len(hashes) - n
        return n

    def is_ready(self, h: Hashable) -> bool:
        b = self.blocks.get(h)
        return b is not None and b.ready

    def slot_of(self, h: Hashable) -> Optional[int]:
        b = self.blocks.get(h)
        return None if b is None else b.slot

    @property
    def used(self) -> int:
        return len(self.blocks)

    # ---------------------------------------------------------------- loads
    def prepare_load(self, hashes: Sequence[Hashable]) -> list[int]:
        """Pins ready blocks for reading; returns their slots."""
        slots = []
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.ready:
                for h2 in hashes[: len(slots)]:  # undo
                    b2 = self.blocks[h2]
                    b2.refs -= 1
                    self.evictable += not b2.refs
                raise KeyError(f"block {h!r} is not stored and ready")
            self.evictable -= not b.refs
            b.refs += 1
            self.policy.touch(h)
            slots.append(b.slot)
        return slots

    def complete_load(self, hashes: Sequence[Hashable]) -> None:
        for h in hashes:
            b = self.blocks[h]
            if b.refs <= 0:
                raise RuntimeError(f"complete_load without prepare_load for {h!r}")
            b.refs -= 1
            self.evictable += not b.refs
        self.counters.loaded_blocks += len(hashes)

    # ---------------------------------------------------------------- stores
    def prepare_store(self, hashes: Sequence[Hashable]) -> StorePlan:
        """Allocates slots for the blocks not yet stored (or in flight).

        Stops at the first block that finds no room (all candidates pinned):
        stores are prefixes, so a later block without its predecessors would
        be useless for a prefix lookup.
        """
        plan = StorePlan([], [])
        for h in hashes:
            if h in self.blocks:
                self.policy.touch(h)
                continue
            if self.admit_after and self.seen.get(h, 0) < self.admit_after:
                continue
            slot = self._alloc(plan)
            if slot is None:
                self.counters.store_rejected += 1
                break
            self.blocks[h] = _Block(slot, ready=False, refs=1)
            plan.hashes.append(h)
            plan.slots.append(slot)
        return plan

    def complete_store(self, hashes: Sequence[Hashable], success: bool = True) -> None:
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or b.ready:
                raise RuntimeError(f"complete_store for a block not being stored: {h!r}")
            b.refs -= 1
            if success:
                b.ready = True
                self.evictable += 1  # refs is 0 now: a block being stored is never loaded
                self.policy.insert(h)
                self.seen.pop(h, None)
                self.events.append(("stored", h))
                self.counters.stored_blocks += 1
            else:  # half-written: never served, slot reused
                del self.blocks[h]
                self.free.append(b.slot)
                self.counters.failed_stores += 1

    def set_capacity(self, capacity: int) -> None:
        """Grows the pool (slots beyond the old capacity become free)."""
        if capacity < self.capacity:
            raise ValueError("the host pool can only grow")
        self.free = list(range(capacity - 1, self.capacity - 1, -1)) + self.free
        self.capacity = capacity
        if isinstance(self.policy, ARCPolicy):
            self.policy.c = capacity

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    def reset(self) -> int:
        """Forgets every block: ready, in flight (store not completed) and pinned by loads alike;
        every slot is free again and the policy's state (ARC's ghosts too) goes; admission
        counts (`seen`, bounded by seen_limit) and pending events stay, as vLLM's own CPU
        manager keeps them.
        Returns how many blocks were in flight or pinned.

        For callers whose transfers outlive the reset (vLLM: the scheduler discards the
        completions of every job issued before a reset and its workers wait for those jobs
        before they submit new ones): complete_store/complete_load must not be called for
        pre-reset blocks afterwards. Keeping such blocks instead would pin their slots forever
        (nothing completes them) and leave their keys in flight forever."""
        busy = sum(1 for b in self.blocks.values() if b.refs or not b.ready)
        clear = getattr(self.policy, "clear", None)
        if clear is not None:
            clear()
        else:  # a policy without clear(): one remove per block (a reset is rare)
            for h in self.blocks:
                self.policy.remove(h)
        self.blocks.clear()
        self.evictable = 0
        self.free = list(range(self.capacity - 1, -1, -1))
        return busy

    def discard(self, h: Hashable) -> bool:
        """Drops one ready block no load holds (no event: not an eviction); False if it is
        absent, in flight or pinned."""
        b = self.blocks.get(h)
        if b is None or not b.ready or b.refs:
            return False
        del self.blocks[h]
        self.policy.remove(h)
        self.free.append(b.slot)
        self.evictable -= 1
        return True

    # ---------------------------------------------------------------- internals
    def _alloc(self, plan: StorePlan) -> Optional[int]:
        if self.free:
            return self.free.pop()
        if not self.evictable:
            return None  # every block in flight or pinned: no scan
        for h in self.policy.victims():
            b = self.blocks.get(h)
            if b is None or not b.ready or b.refs:
                continue  # in flight: never evicted
            del self.blocks[h]
            self.policy.remove(h)
            self.evictable -= 1
            self.events.append(("evicted", h))
            self.counters.evictions += 1
            plan.evicted.append(h)
            return b.slot
        return None
