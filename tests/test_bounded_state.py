"""Nothing grows per request: the scheduler side's state stays bounded, and the soak measures the
engine, not its own records (issue 37 item 3, "no growth after warm-up").

An 8-minute H200 soak (vLLM 0.26, integrity on) saw the offload engine's process RSS grow
linearly, ~215 KB per wave of 48 requests, the engine without offloading by 32 KB in all. Two
causes, each with its test here:

  * the soak driver: the offload engine runs in the driver's process (in-process vLLM), and the
    driver kept the baseline's reference of every request it had ever compared (full greedy
    tokens and top-2 margins as Python objects, ~3.6 KB a request: ~175 KB a wave). The driver
    now lets a compared wave's references go (`Comparer(drop_from=...)`), keeps those the
    negative controls run again, and reports what it still keeps (`driver_bytes`);
  * ours, small: BlockManager counted every missed lookup in `seen` (admission counts) even
    with admission off (admit_after=0, the default), and dropped a count only when its key was
    stored: a key that missed and was never stored (its request aborted before its blocks were
    computed, its store refused, or dropped by a reset) stayed for the life of the engine. Now
    counts are kept only with admission on, at most `seen_limit` of them (least recently looked
    up first out, as vLLM's CPU manager bounds its own).
The vLLM test drives vLLM's real Scheduler with our connector (tests/vllm_harness.py) through
requests aborted while they wait for device blocks (vLLM's offloading scheduler looks a
request's keys up in order and stops at the first miss: one count per lookup, never stored)
and in the middle of a chunked prefill, and checks every per-request or per-job structure of
ours (and of vLLM's offloading scheduler) is empty once the engine is idle.
Negative control (run before the fix): with BlockManager.lookup counting every miss, the two
BlockManager tests and the vLLM test fail (5000 counts kept; 19 counts left by the 20 requests
aborted while waiting); with Comparer keeping every reference, the soak test fails (all 50
waves' references kept).
"""
from __future__ import annotations

import pytest

from connector.block_manager import BlockManager


def test_no_admission_counts_without_admission():
    m = BlockManager(8)  # admit_after=0: store everything, count nothing
    for i in range(5000):
        assert m.lookup([("never-stored", i)]) == 0
    assert len(m.seen) == 0
    p = m.prepare_store(["a"])
    assert p.hashes == ["a"]


def test_admission_counts_are_bounded_and_still_admit():
    m = BlockManager(8, admit_after=2, seen_limit=100)
    for i in range(5000):
        m.lookup([("flood", i)])
    assert len(m.seen) == 100
    m.lookup(["x"])
    m.lookup(["x"])
    assert m.prepare_store(["x"]).hashes == ["x"]  # admitted after two lookups, as before
    m.lookup(["y"])
    for i in range(100):  # 100 newer keys push y's count out (least recently looked up first)
        m.lookup([("later", i)])
    assert "y" not in m.seen and len(m.seen) == 100
    m.lookup(["y"])
    assert m.prepare_store(["y"]).hashes == []  # one lookup since its count went
    with pytest.raises(ValueError):
        BlockManager(8, seen_limit=0)


@pytest.mark.vllm
def test_aborted_requests_leave_no_state_in_the_scheduler_side(tmp_path):
    pytest.importorskip("vllm", reason="vLLM not installed")
    from vllm.v1.request import RequestStatus

    from connector import vllm_compat as compat
    from tests.vllm_harness import BLOCK, Harness, make_model_dir

    if compat.VERSION < (0, 32):
        pytest.skip("vLLM 0.26's scheduler asserts when a request is aborted before all its blocks were allocated")
    cfg = dict(kv_connector="KVOffloadConnector", kv_connector_module_path="connector.vllm_adapter",
               kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22})
    h = Harness(make_model_dir(str(tmp_path / "m")), cfg, num_gpu_blocks=12, max_num_batched_tokens=128)
    conn = h.connector
    cs = conn.connector_scheduler
    m = cs.manager
    # 1. a request holds 9 (at the end 11) of the 12 device blocks: each new one (5 blocks) is
    # looked up (its first block misses), finds too few device blocks, waits, and is aborted
    # there (a client gone while queued)
    h.add_request("big", [(t * 7) % 900 + 50 for t in range(8 * BLOCK)], max_tokens=40)
    h.step()
    h.step()
    waiting_aborted = 0
    for k in range(20):
        h.add_request(f"w{k}", [(k * 997 + t) % 900 + 50 for t in range(4 * BLOCK)], max_tokens=4)
        h.step()
        waiting_aborted += h.scheduler.requests[f"w{k}"].status == RequestStatus.WAITING
        h.scheduler.finish_requests(f"w{k}", RequestStatus.FINISHED_ABORTED)
    h.run_until_idle(max_steps=400)
    assert waiting_aborted == 20
    # 2. requests aborted in the middle of a chunked prefill (128 tokens a step), beside others
    aborted = 0
    for k in range(10):
        h.add_request(f"a{k}", [(k * 983 + t) % 900 + 50 for t in range(10 * BLOCK)], max_tokens=4)
        h.add_request(f"b{k}", [(k * 991 + t) % 900 + 50 for t in range(2 * BLOCK + 5)], max_tokens=4)
        h.step()
        if f"a{k}" in h.scheduler.requests:
            h.scheduler.finish_requests(f"a{k}", RequestStatus.FINISHED_ABORTED)
            aborted += 1
        h.run_until_idle(max_steps=400)
    assert aborted == 10 and not h.scheduler.has_unfinished_requests()
    assert m.bm.counters.stored_blocks > 0 and m.bm.counters.miss_blocks > 0
    # ours: per-request / per-job state all gone, the pool within its capacity
    assert len(m.bm.seen) == 0, f"{len(m.bm.seen)} admission counts kept for keys never stored"
    assert len(m.bm.blocks) <= m.bm.capacity and all(b.refs == 0 and b.ready for b in m.bm.blocks.values())
    assert not m._doomed and not conn._load_slots and not conn._failed_stores
    w = h.worker.connector_worker.worker
    assert not w._stores and not w._loads and not w._failed_stores and not w._finished and not w._load_errors
    # vLLM's offloading scheduler: no request or job left behind
    for name in ("_req_status", "_jobs", "_block_id_to_pending_jobs"):
        v = getattr(cs, name, None)
        assert v is None or len(v) == 0, f"vLLM's {name}: {len(v)} left"


def test_soak_comparer_lets_compared_references_go():
    from profiling.bench import soak_vllm as S

    out = {"waves": [], "examples": []}
    refs: dict = {}
    cmp = S.Comparer(out, refs, "t", lambda s: None, drop_from=2)
    n_waves, per_wave = 50, 8
    for k in range(n_waves):
        reqs = [S.Req(f"w{k}-r{i}", k, [5] * 8, 4, 0, None, -1) for i in range(per_wave)]
        refs.update({r.rid: {"tokens": [300 + i] * 4, "margins": [0.5] * 4} for i, r in enumerate(reqs)})
        res = {r.rid: {"tokens": [300 + i] * 4, "finished": True, "aborted": False, "abort_state": None}
               for i, r in enumerate(reqs)}
        cmp.add(k, reqs, res, {"wave": k, "delta": {}, "resources": {}, "secs": 0.1, "steps": 3})
    assert [w["wave"] for w in out["waves"]] == list(range(n_waves))
    assert sum(w["mismatches"] for w in out["waves"]) == 0
    # only the waves the controls run again (< drop_from) keep their references
    assert sorted(refs) == sorted(f"w{k}-r{i}" for k in range(2) for i in range(per_wave))
    # a wave still waiting for its reference keeps what it needs
    reqs = [S.Req("w50-r0", 50, [5] * 8, 4, 0, None, -1)]
    cmp.add(50, reqs, {"w50-r0": {"tokens": [1], "finished": True, "aborted": False, "abort_state": None}},
            {"wave": 50, "delta": {}, "resources": {}, "secs": 0.1, "steps": 3})
    assert out["uncompared_waves"] == [50]


def test_soak_growth_figures_tell_a_slope_from_a_step():
    """The RSS slope per wave and the pinned cache's rises, from per-wave rows (negative control:
    a pinned cache that rises every wave fails, one rise of a few bytes does not)."""
    import argparse

    from profiling.bench import soak_vllm as S

    def run(rss, pinned):
        rows = [{"wave": k, "resources": {"vmrss": r, "torch_pinned_bytes": p}}
                for k, (r, p) in enumerate(zip(rss, pinned))]
        return {"warm_wave": 2, "waves": rows, "resources_start": rows[2]["resources"],
                "resources_end": rows[-1]["resources"], "driver_bytes_start": 1000, "driver_bytes_end": 1500}

    a = argparse.Namespace(rss_tol_mib=64, events_tol=0, gpu_tol_mib=16, gpu_reserved_tol_mib=64, fds_tol=4,
                           pinned_cache_tol_kib=64, pinned_cache_rises=3)
    t = {"waves": 1, "waves_run": 1, "mismatches": 0, "tokens": 1, "incomplete": 0, "uncompared_waves": 0,
         "requests": 1, "aborted": 1, "abort_states": {}}
    counters = {k: k for k in ("stored", "loaded", "evicted", "preemptions", "integrity_failed", "failed_load")}
    S.COUNTERS.update({k: v for k, v in counters.items() if k not in S.COUNTERS})
    step = run([100 << 20] * 3 + [101 << 20] * 40, [1000] * 30 + [1004] * 13)
    g = S.growth(step, a)
    assert g["torch_pinned_bytes"]["rises"] == 1 and g["driver_bytes"]["growth"] == 500
    assert S.targets(step, t, g, a, "off")["no_growth"]["ok"] is True
    leak = run([(100 << 20) + k * 200_000 for k in range(43)], [1000 + 16 * k for k in range(43)])
    g = S.growth(leak, a)
    assert abs(g["vmrss"]["per_wave"] - 200_000) < 1 and g["torch_pinned_bytes"]["rises"] == 40
    T = S.targets(leak, t, g, a, "off")
    assert T["no_growth"]["ok"] is False and "torch_pinned_bytes_rises" in T["no_growth"]["detail"]
