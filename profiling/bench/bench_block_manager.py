"""Scheduler-side manager cost, before/after, in one run (CPU, pure Python, no vLLM engine).

    python -m profiling.bench.bench_block_manager [--out PATH]

Replays, on `connector.vllm_adapter.KVOffloadManager`, the manager calls of bench_vllm's
throughput section at the H200 shape: 256 requests x 32 blocks (512 tokens, block 16), host pool
10240 slots (default_cpu_bytes: 20 GiB of 2 MiB blocks):
  rate-0 pass: 8192 blocks stored, `--inflight` (2592, what the H200 run left) still in flight
  -> reset_cache -> warm pass: the same 8192-block set of new prompts stored and completed
  -> measured pass, as vLLM schedules it (a 100%-hit request needs one token of compute, so all
     are admitted together): each request's lookups, prepare_load + touch of the full hits (pinned),
     then the misses' prepare_store + complete_store, then the loads' complete_load.
Two managers in the same run:
  before: the old reset_cache (kept stores in flight: their slots stay pinned, nothing completes
          them), the old LRU policy (victims() copies the whole OrderedDict per evicted block) and
          the old allocation (walks every victim even when all are pinned: a refused store is O(pool));
  after:  this tree's KVOffloadManager and BlockManager.
Reports per manager: measured-pass hit requests, evictions (warm + measured) and the manager's
time in the measured pass, total and per engine step (--steps, 8 on the H200), plus the cost of
one eviction at several pool sizes (µs per evicted block, each policy).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


class _CopyingLRU:
    """The old LRUPolicy: identical but victims() copies the OrderedDict (O(pool) per call)."""

    def __init__(self):
        from collections import OrderedDict
        self._od = OrderedDict()

    def touch(self, key):
        if key in self._od:
            self._od.move_to_end(key)

    def insert(self, key):
        self._od[key] = None
        self._od.move_to_end(key)

    def remove(self, key):
        self._od.pop(key, None)

    def victims(self):
        return iter(list(self._od))

    def clear(self):
        self._od.clear()


def managers():
    from connector.block_manager import BlockManager
    from connector.vllm_adapter import KVOffloadManager

    class OldBlockManager(BlockManager):
        def _alloc(self, plan):  # the old body: no evictable count, a scan even when all are pinned
            if self.free:
                return self.free.pop()
            for h in self.policy.victims():
                b = self.blocks.get(h)
                if b is None or not b.ready or b.refs:
                    continue
                del self.blocks[h]
                self.policy.remove(h)
                self.events.append(("evicted", h))
                self.counters.evictions += 1
                plan.evicted.append(h)
                return b.slot
            return None

    class Before(KVOffloadManager):
        def __init__(self, n):
            super().__init__(n)
            self.bm = OldBlockManager(n, policy=_CopyingLRU())

        def reset_cache(self):  # the old body: drops ready, idle blocks only
            for k in [k for k, b in self.bm.blocks.items() if b.ready and not b.refs]:
                b = self.bm.blocks.pop(k)
                self.bm.policy.remove(k)
                self.bm.free.append(b.slot)

    return {"before": Before, "after": KVOffloadManager}


def replay(cls, requests: int, blocks: int, slots: int, inflight: int) -> dict:
    from vllm.v1.kv_offload.base import LookupResult
    m = cls(slots)
    keys = lambda tag, r: [(tag, r, i) for i in range(blocks)]  # noqa: E731
    for r in range(requests):  # rate-0 pass
        m.prepare_store(keys("p0", r), None)
    done = requests * blocks - inflight
    for r in range(requests):
        ks = keys("p0", r)
        n = max(0, min(blocks, done - r * blocks))
        if n:
            m.complete_store(ks[:n], None)
    m.reset_cache()  # vLLM: the completions of the older jobs never come
    ev0 = m.bm.counters.evictions
    for r in range(requests):  # warm pass, every store completes (the bench waits for them)
        out = m.prepare_store(keys("w", r), None)
        if out is not None:
            m.complete_store(list(out.keys_to_store), None)
    warm_ev = m.bm.counters.evictions - ev0
    hits, ev1, loading, missed = 0, m.bm.counters.evictions, [], []
    t = time.perf_counter()
    for r in range(requests):  # measured pass, as vLLM schedules it: a 100%-hit request needs one
        ks = keys("w", r)      # token of compute, so all are admitted at once: lookups, and the
        n = 0                  # hits' loads pinned, before any miss stores its blocks
        for k in ks:
            if m.lookup(k, None) != LookupResult.HIT:
                break
            n += 1
        if n == blocks:
            hits += 1
            m.prepare_load(ks, None)
            m.touch(ks, None)
            loading.append(ks)
        else:
            missed.append(ks)
    for ks in missed:  # the misses compute and store their blocks
        out = m.prepare_store(ks, None)
        if out is not None:
            m.complete_store(list(out.keys_to_store), None)
    for ks in loading:
        m.complete_load(ks, None)
    dt = time.perf_counter() - t
    return {"hit_requests": hits, "warm_evictions": warm_ev, "measured_evictions": m.bm.counters.evictions - ev1,
            "measured_s": dt}


def eviction_us(policy_factory, slots: int, n: int = 400) -> float:
    from connector.block_manager import BlockManager
    m = BlockManager(slots, policy=policy_factory(slots))
    m.prepare_store(list(range(slots)))
    m.complete_store(list(range(slots)))
    t = time.perf_counter()
    for k in range(slots, slots + n):
        m.prepare_store([k])
        m.complete_store([k])
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--blocks", type=int, default=32, help="blocks per request")
    p.add_argument("--slots", type=int, default=10240)
    p.add_argument("--inflight", type=int, default=2592, help="rate-0 blocks still in flight at the reset")
    p.add_argument("--steps", type=int, default=8, help="engine steps of the measured pass (per-step figure)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    from connector.block_manager import ARCPolicy, LRUPolicy

    rows = []
    for name, cls in managers().items():
        runs = [replay(cls, a.requests, a.blocks, a.slots, a.inflight) for _ in range(a.reps)]
        med = statistics.median(r["measured_s"] for r in runs)
        row = dict(runs[0], manager=name, measured_ms=round(med * 1e3, 3),
                   ms_per_step=round(med * 1e3 / a.steps, 3))
        row.pop("measured_s")
        rows.append(row)
        print(f"{name:<7} hit requests {row['hit_requests']:>4}/{a.requests}  evictions warm {row['warm_evictions']:>4}"
              f" measured {row['measured_evictions']:>4}  manager {row['measured_ms']:8.2f} ms"
              f" = {row['ms_per_step']:7.3f} ms/step ({a.steps} steps)", flush=True)
    ev = []
    for slots in (1024, 10240, 65536):
        for pol, fac in (("lru, copying (before)", lambda n: _CopyingLRU()), ("lru", lambda n: LRUPolicy()),
                         ("arc", lambda n: ARCPolicy(n))):
            us = min(eviction_us(fac, slots) for _ in range(3))
            ev.append({"slots": slots, "policy": pol, "us_per_eviction": round(us, 2)})
            print(f"eviction, {slots:>6} slots, {pol:<20} {us:9.2f} us per evicted block", flush=True)
    doc = {"bench": "block_manager", "device": "cpu (pure Python)", "settings": vars(a), "replay": rows,
           "eviction": ev, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
