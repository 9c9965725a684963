"""Offload engine: host pool (CPU fallback + GPU pinning), transfer worker ordering and faults."""
import sys
import warnings

import numpy as np
import pytest
import torch

from connector import HostPool, TransferWorker
from kernels import BlockCopier
from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache, allocate
from tests.conftest import HAS_CUDA


def test_pool_geometry_and_pageable_fallback():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = HostPool(10, 4096, chunk_bytes=3 * 4096)
        p.wait_pinned()
    try:
        assert p.chunks == [(0, 3), (3, 6), (6, 9), (9, 10)]  # chunk edges on block edges
        assert p.tensor.shape == (10, 4096) and p.usable_blocks == 10
        if not HAS_CUDA:
            assert p.pinned is False and p.error and any("pageable" in str(x.message) for x in w)
        p.tensor[9].fill_(7)
        assert int(p.tensor[9].sum()) == 7 * 4096
        # start-up time split into faulting pages in and pinning (none here when nothing pins)
        assert p.info["prefault_s"] >= 0.0
        if not p.pinned:
            assert "register_s" not in p.info
    finally:
        p.close()


def test_pool_rejects_empty():
    with pytest.raises(ValueError, match="at least one block"):
        HostPool(0, 4096)


def test_pool_numa_node_is_checked_and_recorded():
    from connector.host_pool import numa_node_count
    n = numa_node_count()
    with pytest.raises(ValueError, match="NUMA node"):
        HostPool(2, 4096, numa_node=n)  # nodes are 0..n-1
    with pytest.raises(ValueError, match="NUMA node"):
        HostPool(2, 4096, numa_node=-1)
    p = HostPool(2, 4096, numa_node=0, background=False, pin=False)
    try:
        assert p.info["numa_node"] == 0 and p.info["numa_nodes"] == n
        assert p.info["numa_bound"] == (n > 1)  # one node: nothing to bind
    finally:
        p.close()


@pytest.mark.gpu
def test_pool_pins_lazily_and_dma_never_spans_chunks():
    bb = 1 << 20
    p = HostPool(96, bb, chunk_bytes=8 * bb)
    assert p.usable_blocks >= 8  # first chunk before the constructor returned
    p.wait_pinned()
    assert p.pinned and p.tensor.is_pinned() and p.usable_blocks == 96
    g = torch.randint(1, 255, (96, bb), dtype=torch.uint8, device="cuda")
    cp = BlockCopier("cuda")
    ids = np.arange(96)
    cp.copy(g, p.tensor, ids, ids, method="dma")  # one run across 12 registrations
    back = torch.zeros_like(g)
    cp.copy(p.tensor, back, ids, ids, method="dma")
    torch.cuda.synchronize()
    assert torch.equal(back, g)
    p.close()


def test_pool_faults_the_next_chunk_while_it_registers_this_one(monkeypatch):
    """CPU: the background pinning is a two-stage pipeline. Every chunk after the first is
    faulted once and registered once, in order, each fault before its registration and the
    blocks usable only after it; the fault of chunk i+1 runs while chunk i registers (the stub
    registration waits for it: without the overlap it times out); the overlapped faults use one
    thread fewer; close() mid-way stops the pipeline with no fault left running."""
    import threading

    log, lock = [], threading.Lock()
    started = {}

    def fault(self, i, threads):
        with lock:
            log.append(("fault", i, threads))
            started.setdefault(i, threading.Event()).set()

    def register(self, i):
        nxt = i + 1
        if 0 < i and nxt < len(self.chunks):  # the first chunk is pinned alone, in the constructor
            overlapped = started.setdefault(nxt, threading.Event()).wait(5)
        else:
            overlapped = None
        with lock:
            log.append(("register", i, overlapped, self.usable_blocks))
        self._usable = self.chunks[i][1]

    monkeypatch.setattr(HostPool, "_fault", fault)
    monkeypatch.setattr(HostPool, "_register", register)
    p = HostPool(40, 4096, chunk_bytes=4 * 4096, threads=4, background=False, pin=False)
    n = len(p.chunks)
    assert n == 10 and p.usable_blocks == 40
    faults = [e for e in log if e[0] == "fault"]
    regs = [e for e in log if e[0] == "register"]
    assert [e[1] for e in faults] == list(range(n)) and [e[1] for e in regs] == list(range(n))
    # the first chunk and the pipeline's first stage use every thread; overlapped faults one fewer
    assert [e[2] for e in faults] == [4, 4] + [3] * (n - 2)
    assert regs[0][2] is None and all(e[2] is True for e in regs[1:-1]) and regs[-1][2] is None
    for i in range(n):  # each fault before its registration; blocks usable only after it
        assert log.index(faults[i]) < log.index(regs[i]) and regs[i][3] == p.chunks[i][0]
    p.close()

    # close() while the pipeline runs: it stops, and no helper thread is left faulting
    log.clear()
    started.clear()
    gate = threading.Event()

    def slow_register(self, i):
        if i > 0:  # the first chunk (in the constructor) goes through; chunk 1 waits for the gate
            gate.wait(5)
        register(self, i)

    monkeypatch.setattr(HostPool, "_register", slow_register)
    q = HostPool(40, 4096, chunk_bytes=4 * 4096, threads=4, background=True, pin=False)
    q._closed = True  # as close() sets it, before it joins
    gate.set()
    q.wait_pinned()
    assert q.usable_blocks in (q.chunks[0][1], q.chunks[1][1])  # whether it saw _closed before chunk 1 or after
    assert not [t for t in threading.enumerate() if t.name == "kvo-hostpool-fault"]
    q.close()


def _int64(x):
    return np.array(x, dtype=np.int64)


def _mover(nb=16):
    spec = KVSpec(4, 2, 64, 16)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda",
                  fill=lambda t: t.view(-1).view(torch.uint8).random_(1, 255))
    return spec, kv, KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [True, False], ids=["raw-handles", "torch-events"])
@pytest.mark.parametrize("async_submit", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("method", ["auto", "cuda", "staged", "dma"])
@pytest.mark.parametrize("ids_", [list, _int64], ids=["list", "int64"])
def test_store_waits_for_compute_and_compute_waits_for_store(method, async_submit, raw, ids_):
    """Both ways a job starts: one C++ call on raw handles (_C.job_begin, the default), and
    torch's Event/Stream calls (the fallback without the extension's job_begin). int64 ids with
    method cuda take the per-layer fast path (_C.pack_native: record, wait, launch in one call);
    auto sees compute running and packs through staging."""
    spec, kv, mover = _mover()
    host = torch.zeros(8, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host, method=method, async_submit=async_submit)
    if raw and not w._raw:
        pytest.skip("kernels._C (with job_begin) is not built")
    w._raw = raw
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                  # compute still busy ...
    for t in kv:
        t[:, 3].fill_(11)                           # ... then writes block 3 (value A)
    w.submit_store(1, ids_([3]), ids_([5]))         # host returns at once
    w.fence(1)                                      # compute reuses block 3 only after the store
    for t in kv:
        t[:, 3].fill_(99)                           # overwrite (value B)
    torch.cuda.synchronize()
    res = w.get_finished()
    assert [(r.job_id, r.ok) for r in res] == [(1, True)] and res[0].nbytes == spec.unified_block_bytes
    got = host[5].view(spec.dtype)
    assert torch.equal(got, torch.full_like(got, 11)), "store read KV that was not yet written, or too late"
    st = w._strategy
    if raw and not async_submit and ids_ is _int64 and method in ("cuda", "auto") and w._fast_fn is not None:
        native = type(st).__name__ == "_NativePack"
        fast = "cuda-native" if native else "cuda"
        staged = "staged-native" if native and st.pipes is not None else "staged"
        assert w.methods == {"store:" + (fast if method == "cuda" else staged): 1}, w.methods


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [True, False], ids=["raw-handles", "torch-events"])
def test_caller_event_never_recorded_means_no_wait(raw):
    """A caller's `after` event that was never recorded has nothing to wait for, as with torch's
    Stream.wait_event: the job runs and is exact."""
    spec, kv, mover = _mover()
    host = torch.zeros(8, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host, method="cuda")
    if raw and not w._raw:
        pytest.skip("kernels._C (with job_begin) is not built")
    w._raw = raw
    for t in kv:
        t[:, 2].fill_(7)
    # the job waits for nothing (that is the point), so the fill must be done before it is
    # queued: without this the copy raced the default stream's fill (random bytes read back
    # in a GPU run with 4 test workers sharing the GPU, both parametrisations)
    torch.cuda.synchronize()
    assert w.submit_store(1, [2], [4], after=torch.cuda.Event())
    w.wait([1])
    res = w.get_finished()
    assert [(r.job_id, r.ok) for r in res] == [(1, True)], res
    got = host[4].view(spec.dtype)
    assert torch.equal(got, torch.full_like(got, 7))
    w.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inline", "async", "native"])
def test_worker_reuses_its_cuda_events_and_jobs_stay_exact(mode):
    """Sequential jobs take their events from the worker's pool (made at construction) and
    give them back when reported finished: after 30 jobs the pool holds what it started with,
    none made and none lost, and every job's bytes are still exact."""
    spec = KVSpec(4, 2, 64, 16)
    cache = UnifiedKVCache(spec, 16, device="cuda")
    cache.buffer.random_(1, 255)
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    host = torch.zeros(32, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host, method="dma", async_submit=mode == "async", native_submit=mode == "native")
    pool0 = (len(w._free_events[True]), len(w._free_events[False]))
    assert pool0[0] > 0 and pool0[1] > 0
    made = []  # events made because the pool was empty
    w_event = w._event

    def counting(timing):
        n = len(w._free_events[timing])
        e = w_event(timing)
        if n == 0:
            made.append(e)
        return e
    w._event = counting
    for i in range(30):
        b, s = i % 16, 31 - i
        assert w.submit_store(i, [b], [s])
        w.wait([i])
        res = w.get_finished()
        assert [(r.job_id, r.ok) for r in res] == [(i, True)]
        assert torch.equal(host[s], cache.buffer.view(16, -1)[b].cpu())
    timing, plain = len(w._free_events[True]), len(w._free_events[False])
    assert (timing, plain) == pool0 and not made, (timing, plain, pool0, len(made))
    w.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inline", "native"])
def test_worker_event_pool_returns_to_its_size_after_a_burst(mode):
    """More jobs in flight than the pool holds make events; once they are reported, the pool
    is back at its size at construction (the extra events are destroyed), so a long run holds
    a constant number of CUDA events whatever its peak concurrency (issue 37's soak)."""
    from connector.worker import EVENTS_PREMADE
    spec = KVSpec(4, 2, 64, 16)
    cache = UnifiedKVCache(spec, 16, device="cuda")
    cache.buffer.random_(1, 255)
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    n = EVENTS_PREMADE + 40
    host = torch.zeros(n, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host, method="dma", native_submit=mode == "native")
    pool0 = (len(w._free_events[True]), len(w._free_events[False]))
    assert pool0 == (2 * EVENTS_PREMADE, EVENTS_PREMADE)
    for burst in range(2):
        torch.cuda._sleep(20_000_000)  # jobs queue behind it: all n are in flight at once
        for i in range(n):
            assert w.submit_store(burst * n + i, [i % 16], [i])
        assert len(w.jobs) == n
        w.wait(list(range(burst * n, burst * n + n)))
        res = w.get_finished()
        assert len(res) == n and all(r.ok for r in res)
        assert (len(w._free_events[True]), len(w._free_events[False])) == pool0
    for i in range(n):
        assert torch.equal(host[i], cache.buffer.view(16, -1)[i % 16].cpu())
    w.shutdown()


@pytest.mark.gpu
def test_load_then_fence_then_read_and_bidirectional_jobs():
    spec, kv, mover = _mover()
    ub = spec.unified_block_bytes
    host = torch.randint(1, 255, (8, ub), dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host)
    before = [t[:, 0].clone() for t in kv]
    w.submit_store(10, [0], [7])                    # store block 0 -> slot 7
    w.submit_load(11, [2, 4], [9, 12])              # load slots 2, 4 -> blocks 9, 12 (other stream)
    w.fence(11)
    out = torch.cat([t[:, [9, 12]].transpose(0, 1).reshape(2, -1) for t in kv], 1)  # reads after the load
    w.flush()                                       # job 10 was never fenced: let it be issued first
    torch.cuda.synchronize()
    ref = torch.zeros(2, ub, dtype=torch.uint8)
    mover.pack([9, 12], ref, [0, 1], method="torch")
    assert torch.equal(ref, host[[2, 4]])
    assert out.shape[0] == 2
    res = {r.job_id: r for r in w.get_finished()}
    assert res[10].ok and res[11].ok and res[11].nbytes == 2 * ub and res[11].ms >= 0
    chk = torch.zeros(1, ub, dtype=torch.uint8)
    mover.pack([0], chk, [0], method="torch")
    # compare bytes: random bf16 bit patterns include NaNs, which never compare equal
    assert torch.equal(chk[0], host[7])
    assert all(torch.equal(b.view(torch.uint8), t[:, 0].contiguous().view(torch.uint8)) for b, t in zip(before, kv))


@pytest.mark.gpu
def test_failed_job_is_reported_and_shutdown_drains():
    spec, kv, mover = _mover()
    host = torch.zeros(4, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host)
    assert w.submit_store(1, [99], [0]) is False    # bad block id: nothing queued
    torch.cuda._sleep(100_000_000)
    assert w.submit_store(2, [1, 2], [0, 1])
    res = {r.job_id: r for r in w.shutdown(drain=True)}
    assert res[1].ok is False and "out of range" in res[1].error
    assert res[2].ok and w.stats["failed_jobs"] == 1
    with pytest.raises(RuntimeError):
        w.submit_load(3, [0], [0])
    w2 = TransferWorker(mover, host)
    w2.submit_store(4, [3], [2])
    res = w2.shutdown(drain=False)
    assert res[0].ok is False and "cancelled" in res[0].error


@pytest.mark.gpu
def test_worker_with_unified_cache_uses_block_copies():
    spec = KVSpec(4, 2, 64, 16)
    c = UnifiedKVCache(spec, 8, device="cuda")
    c.buffer.random_(1, 255)
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, c.unified())
    host = torch.zeros(8, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host)
    w.submit_store(1, [6, 7], [0, 1])
    w.wait([1])
    assert torch.equal(host[:2], c.buffer[6:8].cpu()) and w.get_finished()[0].ok


def test_pool_reports_its_huge_pages():
    import re

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    pool = HostPool(32, 2 << 20, background=False, pin=False)
    try:
        got = pool.huge_page_bytes()
        assert got is not None and 0 <= got <= pool.nbytes
        if re.search(r"\[(always|madvise)\]", mode):
            # prefaulted after MADV_HUGEPAGE: most of a 64 MiB private pool sits on 2 MiB pages
            assert got >= pool.nbytes // 2, (got, pool.nbytes, mode)
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("native,ids_", [(True, list), (True, _int64), (False, list)],
                         ids=["native", "native-fast", "inline"])
def test_native_submit_keeps_the_ordering_rules(native, ids_):
    """DMA jobs issued by the C++ submit thread wait for compute, and fences/loads order after them.
    int64 numpy ids take the native fast path (record + plan + queue in one C++ call)."""
    spec = KVSpec(4, 2, 64, 16)
    c = UnifiedKVCache(spec, 16, device="cuda")
    c.buffer.random_(1, 255)
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, c.unified())
    host = torch.zeros(8, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host, method="dma", native_submit=native)
    assert (w._native is not None) == native
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                  # compute still busy ...
    c.buffer[3].fill_(11)                           # ... then writes block 3
    assert w.submit_store(1, ids_([3]), ids_([5]))  # returns at once
    w.fence(1)                                      # compute reuses block 3 only after the store
    c.buffer[3].fill_(99)
    assert w.submit_load(2, ids_([5]), ids_([10]))  # slot 5 -> block 10
    w.fence(2)
    seen = c.buffer[10].clone()                     # reads after the load
    assert w.submit_store(3, ids_([99]), ids_([0])) is False  # bad ids: rejected before anything is queued
    if native:
        assert w.methods == {"store:dma-native": 1, "load:dma-native": 1}, w.methods
    torch.cuda.synchronize()
    res = {r.job_id: r for r in w.get_finished()}
    assert res[1].ok and res[2].ok and res[1].ms > 0 and res[1].nbytes == spec.unified_block_bytes
    assert res[3].ok is False and "out of range" in res[3].error
    assert (host[5] == 11).all(), "store read KV that was not yet written, or too late"
    assert (seen == 11).all() and (c.buffer[3] == 99).all()
    assert not w.jobs and w.shutdown() == []


@pytest.mark.gpu
@pytest.mark.parametrize("method,spec", [("dma", KVSpec(4, 2, 64, 16)), ("auto", KVSpec(32, 8, 128, 16))],
                         ids=["dma-32KiB", "auto-2MiB"])
def test_native_fast_path_bytes_errors_and_fallbacks(monkeypatch, method, spec):
    """The native fast path (int64 numpy ids; method dma, or auto where the cost model picks DMA
    whether or not the GPU is busy, as for 2 MiB blocks): never calls `prepare`, moves random
    non-zero bytes exactly into poisoned slots and touches nothing else; bad ids still
    come back as a failed job with the general path's message; lists, int32 arrays and CPU
    tensors are converted and take the fast path, a caller's event takes the general path, and
    each is exact."""
    c = UnifiedKVCache(spec, 64, device="cuda")
    c.buffer.random_(1, 255)
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, c.unified())
    host = torch.empty(96, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    host.fill_(0xA5)
    w = TransferWorker(mover, host, method=method, native_submit=True)
    if w._fast_fn is None:
        pytest.skip("no native fast path here (kernels._C without submit_native)")
    rng = np.random.default_rng(5)
    prepared = []
    real_prepare = mover.prepare
    monkeypatch.setattr(mover, "prepare", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))
    ids = rng.permutation(64)[:40].astype(np.int64)
    slots = np.sort(rng.permutation(96)[:40]).astype(np.int64)
    slots[:8] = np.arange(8)  # a host-side run: coalesced descriptors too
    blocks = c.buffer.view(64, -1).cpu()
    assert w.submit_store(1, ids, slots)
    w.wait([1])
    assert not prepared, "the fast path called prepare"
    res = w.get_finished()
    assert [(r.job_id, r.ok, r.nbytes) for r in res] == [(1, True, 40 * spec.unified_block_bytes)], res
    assert torch.equal(host[torch.from_numpy(slots)], blocks[torch.from_numpy(ids)])
    untouched = np.setdiff1d(np.arange(96), slots)
    assert (host[torch.from_numpy(untouched)] == 0xA5).all(), "bytes outside the job's slots changed"
    # load them back into other, poisoned GPU blocks
    dst = np.setdiff1d(np.arange(64), ids)[:20].astype(np.int64)
    c.buffer.view(64, -1)[torch.from_numpy(dst).cuda()] = 0x5A
    before = c.buffer.view(64, -1).cpu()
    assert w.submit_load(2, slots[:20].copy(), dst)
    w.wait([2])
    after = c.buffer.view(64, -1).cpu()
    assert torch.equal(after[torch.from_numpy(dst)], blocks[torch.from_numpy(ids[:20])])
    keep = np.setdiff1d(np.arange(64), dst)
    assert torch.equal(after[torch.from_numpy(keep)], before[torch.from_numpy(keep)])
    assert not prepared and w.methods == {"store:dma-native": 1, "load:dma-native": 1}, w.methods
    # bad ids on the fast path's input types: the general path reports them, nothing queued
    assert w.submit_store(3, np.array([64], np.int64), np.array([0], np.int64)) is False
    assert w.submit_store(4, np.array([1, 2], np.int64), np.array([5, 5], np.int64)) is False
    assert w.submit_load(5, np.array([0], np.int64), np.array([-1], np.int64)) is False
    res = {r.job_id: r for r in w.get_finished()}
    assert "out of range" in res[3].error and "duplicate" in res[4].error and "negative" in res[5].error
    assert w._native.in_flight() == 0 and not w.jobs  # the failures queued nothing
    # other id types (converted: the fast path) and a caller's event (the general path), each
    # exact (the load above rewrote some GPU blocks: read them again)
    blocks = c.buffer.view(64, -1).cpu()
    n_prep, n_fast = len(prepared), w.methods["store:dma-native"]
    for jid, (a, b) in enumerate([([10, 11], [90, 91]), (np.array([12], np.int32), np.array([92], np.int32)),
                                  (torch.tensor([14, 15]), torch.tensor([94, 95]))], 5):
        assert w.submit_store(jid, a, b)
        w.wait([jid])
        assert torch.equal(host[list(map(int, b))], blocks[list(map(int, a))])
    assert w.methods["store:dma-native"] == n_fast + 3
    ev = torch.cuda.Event()
    ev.record()
    assert w.submit_store(8, np.array([13], np.int64), np.array([93], np.int64), after=ev)
    w.wait([8])
    assert torch.equal(host[93], blocks[13])
    assert len(prepared) == n_prep + 1
    assert all(r.ok for r in w.get_finished())
    assert w.shutdown() == []


def test_dma_submitter_bookkeeping():
    """The native queue's tickets, issue tracking, errors and release (CPU: every job fails
    cleanly with the driver's error; GPU: an empty job completes)."""
    from kernels._ext import _C

    if _C is None:
        pytest.skip("kernels._C is not built")
    q = _C.DmaSubmitter(device=0, max_per_call=16)
    ids = np.zeros(0, np.int64)
    t = q.submit_blocks(src_ids=ids.ctypes.data, dst_ids=ids.ctypes.data, n=0, src_base=0, dst_base=0,
                        src_stride=64, dst_stride=64, block_bytes=64, coalesce=True, mode=_C.DMA_BATCH,
                        src_any_order=False, stream=0, wait_event=0, src_seg_base=0, src_seg_bytes=0,
                        dst_seg_base=0, dst_seg_bytes=0)
    assert t == 1 and q.descriptors(ticket=t) == 0
    assert q.holders == 0
    q.hold()
    q.hold()
    assert q.holders == 2
    q.release_hold()
    q.release_hold()
    assert q.holders == 0
    q.wait_issued(ticket=t)
    if torch.cuda.is_available():
        q.synchronize(ticket=t)
        assert q.query(ticket=t) == 1 and q.error(ticket=t) == ""
    else:
        assert q.query(ticket=t) == -1 and q.error(ticket=t).startswith("cuda")
    assert q.in_flight() == 1
    q.release(ticket=t)
    assert q.in_flight() == 0
    with pytest.raises(IndexError):
        q.query(ticket=t)
    q.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        q.submit_blocks(src_ids=ids.ctypes.data, dst_ids=ids.ctypes.data, n=0, src_base=0, dst_base=0,
                        src_stride=64, dst_stride=64, block_bytes=64, coalesce=True, mode=_C.DMA_BATCH,
                        src_any_order=False, stream=0, wait_event=0, src_seg_base=0, src_seg_bytes=0,
                        dst_seg_base=0, dst_seg_bytes=0)


class _CopyingSubmitter:
    """Stands in for _C.DmaSubmitter on CPU: record_and_submit copies each block with
    ctypes.memmove at the addresses and strides it is given, so a wrong argument order
    shows up as wrong bytes (or a wrong recorded argument)."""

    def __init__(self, buffers):
        self.calls = []
        self.ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in buffers]

    def _inside(self, a, nbytes):
        return any(lo <= a and a + nbytes <= hi for lo, hi in self.ranges)

    def record_and_submit(self, record_stream, src_ids, dst_ids, n, src_base, dst_base, src_stride, dst_stride,
                          block_bytes, coalesce, mode, src_any_order, stream, wait_event, src_seg_base,
                          src_seg_bytes, dst_seg_base, dst_seg_bytes):
        import ctypes

        si = np.ctypeslib.as_array(ctypes.cast(src_ids, ctypes.POINTER(ctypes.c_int64)), (n,))
        di = np.ctypeslib.as_array(ctypes.cast(dst_ids, ctypes.POINTER(ctypes.c_int64)), (n,))
        for s, d in zip(si.tolist(), di.tolist()):
            src, dst = src_base + s * src_stride, dst_base + d * dst_stride
            # a wrong base or stride must fail the test, not corrupt the process
            assert self._inside(src, block_bytes) and self._inside(dst, block_bytes), "address outside the buffers"
            ctypes.memmove(dst, src, block_bytes)
        self.calls.append(dict(record_stream=record_stream, n=n, coalesce=coalesce, mode=mode,
                               src_any_order=src_any_order, stream=stream, wait_event=wait_event,
                               segs=(src_seg_base, src_seg_bytes, dst_seg_base, dst_seg_bytes)))
        return len(self.calls)

    def submit_native(self, address, record_stream, src_ids, dst_ids, n, wait_event, fixed):
        """_C.submit_native's documented mapping onto record_and_submit."""
        assert address == 0xADD and len(fixed) == 13
        return self.record_and_submit(record_stream, src_ids, dst_ids, n, *fixed[:9], wait_event, *fixed[9:])


def test_submit_native_refuses_bad_calls_before_any_cuda_call():
    """_C.submit_native (the native fast path's raw entry point) checks its arguments first:
    a wrong count, a fixed part that is not a tuple of 13, n <= 0 or null pointers raise with
    bindings.cu:line, before the submitter is touched (address 0 would crash otherwise)."""
    from kernels._ext import _C

    if _C is None or not hasattr(_C, "submit_native"):
        pytest.skip("kernels._C (with submit_native) is not built")
    fixed = tuple(range(13))
    for args, exc, msg in (((0, 1, 2, 3, 4, 5), TypeError, "takes"),
                           ((0, 1, 2, 3, 4, 5, list(fixed)), TypeError, "tuple of 13"),
                           ((0, 1, 2, 3, 4, 5, fixed[:12]), TypeError, "tuple of 13"),
                           ((0, 1, 2, 3, 0, 5, fixed), ValueError, "n = 0"),
                           ((0, 1, 2, 3, 4, 5, fixed), ValueError, "null submitter"),
                           ((8, 1, 0, 3, 4, 5, fixed), ValueError, "null submitter or ids"),
                           ((8, 1, 2, 3, 4, 5, ("x",) + fixed[1:]), TypeError, "")):
        with pytest.raises(exc, match=msg or None) as e:
            _C.submit_native(*args)
        assert not msg or "bindings.cu:" in str(e.value)


def test_pack_native_refuses_bad_calls_before_any_cuda_call():
    """_C.pack_native (the per-layer fast path's raw entry point) checks its arguments first:
    a wrong count, a fixed part that is not a tuple of 11, a null ring raise with
    bindings.cu:line, before the ring is touched."""
    from kernels._ext import _C

    if _C is None or not hasattr(_C, "pack_native"):
        pytest.skip("kernels._C (with pack_native) is not built")
    ids = np.arange(3, dtype=np.int64)
    fixed = tuple(range(11))
    for args, exc, msg in (((0, ids, ids, 0, False, 1, 1, 2, 3), TypeError, "takes"),
                           ((0, ids, ids, 0, False, 1, 1, 2, 3, list(fixed)), TypeError, "tuple of 11"),
                           ((0, ids, ids, 0, False, 1, 1, 2, 3, fixed[:10]), TypeError, "tuple of 11"),
                           ((0, ids, ids, 0, False, 1, 1, 2, 3, fixed), ValueError, "null ring"),
                           ((0, ids, ids, -1, False, 1, 1, 2, 3, fixed), OverflowError, None)):
        with pytest.raises(exc, match=msg) as e:
            _C.pack_native(*args)
        assert msg is None or "bindings.cu:" in str(e.value)


def test_pack_submit_native_answers_ids_before_any_cuda_call():
    """_C.pack_submit_native (the per-layer fast path through the native submitter) with a real
    DmaSubmitter: bad calls raise with bindings.cu:line (wrong count, fixed not a tuple of 11,
    staged not None or a tuple of 3, a null submitter, a job on another device than the
    submitter's, a bad mode, PACK_STAGED without a pipe); a pipe that add_staged refuses raises
    ValueError; ids that are not int64 id arrays give PACK_NOT_ID_ARRAYS; bad ids give check_ids'
    verdict on the written side's orientation (a pack writes slots, an unpack blocks) with ticket
    -1, before any CUDA call, so the answers are the same on a machine without a GPU."""
    from kernels._ext import _C

    if _C is None or not hasattr(_C, "pack_submit_native"):
        pytest.skip("kernels._C (with pack_submit_native) is not built")
    q = _C.DmaSubmitter(device=0, max_per_call=64)
    try:
        nb, ns = 10, 20
        ids = np.arange(3, dtype=np.int64)
        pipe = q.add_staged(ub=4096, staging_bytes=1 << 20, chunk_bytes=64 << 10, vec_bytes=16, min_ctas=32,
                            dma_mode=_C.DMA_BATCH)
        assert q.staged_shape(pipe) == (16, 512 << 10)  # min(half, chunk) / ub blocks per chunk
        for bad in (dict(ub=4096, staging_bytes=4096), dict(ub=4100, staging_bytes=1 << 20, vec_bytes=16),
                    dict(ub=0, staging_bytes=1 << 20)):  # half below one block; ub not in vectors; no block
            with pytest.raises(ValueError, match="add_staged"):
                q.add_staged(**{**dict(chunk_bytes=1 << 20, vec_bytes=16, min_ctas=32, dma_mode=0), **bad})

        def fixed(to_unified, device=0):  # pack_native's: table .. max_frag_bytes, vec, to_unified, stream, device
            return (1, 1, 1, 1, nb, ns, 64, 16, to_unified, 0, device)

        st = (pipe, 0, 0)
        for args, exc, msg in (((q.address, ids, ids, 0, 0, 1, 5, fixed(True)), TypeError, "takes"),
                               ((q.address, ids, ids, 0, 0, 1, 5, list(fixed(True)), None), TypeError, "tuple of 11"),
                               ((q.address, ids, ids, 0, 0, 1, 5, fixed(True), (pipe, 0)), TypeError, "tuple of 3"),
                               ((0, ids, ids, 0, 0, 1, 5, fixed(True), None), ValueError, "null submitter"),
                               ((q.address, ids, ids, 0, 0, 1, 5, fixed(True, 1), None), ValueError, "device 1"),
                               ((q.address, ids, ids, 0, 3, 1, 5, fixed(True), st), ValueError, "mode 3"),
                               ((q.address, ids, ids, 0, _C.PACK_STAGED, 1, 5, fixed(True), None), ValueError,
                                "needs a staged pipe")):
            with pytest.raises(exc, match=msg) as e:
                _C.pack_submit_native(*args)
            assert "bindings.cu:" in str(e.value)
        for a, b in (([1], [2]), (ids.astype(np.int32), ids), (ids, ids[:2]), (ids[::2], ids[:2]),
                     (np.zeros(0, np.int64), np.zeros(0, np.int64))):
            got = _C.pack_submit_native(q.address, a, b, 0, _C.PACK_AUTO, 1, 5, fixed(True), st)
            assert got[0] == _C.PACK_NOT_ID_ARRAYS and got[4:] == (-1, 0)
        cases = [(np.array([1, 2], np.int64), np.array([7, 7], np.int64)),    # duplicate slots
                 (np.array([5, 5], np.int64), np.array([1, 2], np.int64)),    # duplicate blocks
                 (np.array([1, nb], np.int64), np.array([0, 1], np.int64)),   # block out of range
                 (np.array([1, 2], np.int64), np.array([0, ns], np.int64)),   # slot out of range
                 (np.array([-1, 2], np.int64), np.array([0, 1], np.int64))]   # negative
        seen = set()
        for blocks, slots in cases:
            for to_unified in (True, False):
                s, d, n_s, n_d = (blocks, slots, nb, ns) if to_unified else (slots, blocks, ns, nb)
                want = _C.check_ids(s.ctypes.data, d.ctypes.data, 2, n_s, n_d)[:3]
                if want[0] == 0:
                    continue  # valid ids would go on to the driver
                for mode, staged in ((_C.PACK_DIRECT, None), (_C.PACK_AUTO, st), (_C.PACK_STAGED, st)):
                    got = _C.pack_submit_native(q.address, blocks, slots, 0, mode, 1, 5, fixed(to_unified), staged)
                    assert got == (*want, 2, -1, 0), (blocks, slots, to_unified, mode)
                seen.add((want[0], to_unified))
        # duplicates count on the written side only: both orientations were exercised
        assert len({c for c, _ in seen}) >= 3 and {t for _, t in seen} == {True, False}
        assert q.in_flight() == 0
    finally:
        q.stop()


def test_native_fast_path_arguments_move_the_right_bytes(monkeypatch):
    """CPU: the fast path's positional arguments to record_and_submit (the order of bases,
    strides, ids per direction, the streams, the event, the segments), checked by a stand-in
    submitter that copies with them: random non-zero bytes land exactly, poisoned bytes
    elsewhere stay; list ids, int32 ids, a caller's event and bad ids leave the fast path."""
    from types import SimpleNamespace

    from kernels._ext import _C
    from kernels.plan import register_segments, unregister_segments

    if _C is None:
        pytest.skip("kernels._C is not built")
    spec = KVSpec(2, 2, 16, 4, dtype=torch.float16)
    nb, ns = 12, 20
    cache = UnifiedKVCache(spec, nb, device="cpu")
    cache.buffer.view(torch.uint8).copy_(torch.randint(1, 256, cache.buffer.view(torch.uint8).shape, dtype=torch.uint8))
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    ub = spec.unified_block_bytes
    # host slots 64 B apart (a strided view, as a TP rank's cells are): a stride mix-up moves bytes
    hostbuf = torch.full((ns, ub + 64), 0xA5, dtype=torch.uint8)
    host = hostbuf[:, :ub]
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # CPU stands in for pinned
    w = TransferWorker.__new__(TransferWorker)  # no CUDA streams: the fields the fast path reads
    w.mover, w.host, w.method, w.ub, w.jobs, w.methods, w._closed = mover, host, "dma", ub, {}, {}, False
    w.compute_stream = SimpleNamespace(cuda_stream=1111)
    w._sh = {"store": 2222, "load": 3333}
    w._free_events = {False: [SimpleNamespace(cuda_event=4444 + i) for i in range(8)], True: []}
    w._native = _CopyingSubmitter([cache.buffer, hostbuf])
    from connector.worker import _NativeDma
    s = _NativeDma.__new__(_NativeDma)  # the strategy, its fields set as its __init__ would
    s.w, s.sub, s.kv_blocks = w, w._native, mover._as_blocks()
    s.avail, s.fixed, s.call = mover.copier.available_methods(), {}, (w._native.submit_native, 0xADD)
    s.args = s.fast_args()
    assert s.args is not None
    register_segments(host.data_ptr(), hostbuf.numel(), 4 * (ub + 64))
    try:
        ids = np.array([7, 2, 3, 11, 0], np.int64)
        slots = np.array([4, 5, 6, 19, 1], np.int64)  # a run 4,5,6 (host side only) and stragglers
        kv = cache.buffer.view(torch.uint8).view(nb, ub)
        assert s.submit_fast(1, "store", ids, slots) is True
        c = w._native.calls[-1]
        assert (c["record_stream"], c["stream"], c["wait_event"], c["n"]) == (1111, 2222, 4451, 5)
        # strided host slots: no coalescing (runs are not back to back)
        assert c["coalesce"] is False and c["mode"] == _C.DMA_BATCH and c["src_any_order"] is False
        assert c["segs"] == (0, 0, host.data_ptr(), 4 * (ub + 64))  # KV unregistered, host in 4-slot segments
        assert torch.equal(host[torch.from_numpy(slots)], kv[torch.from_numpy(ids)])
        rest = np.setdiff1d(np.arange(ns), slots)
        assert (host[torch.from_numpy(rest)] == 0xA5).all() and (hostbuf[:, ub:] == 0xA5).all()
        # load slots 4, 19 back into GPU-side blocks 1, 9 (poisoned first)
        kv[[1, 9]] = 0x5A
        before = kv.clone()
        assert s.submit_fast(2, "load", np.array([1, 9], np.int64), np.array([4, 19], np.int64)) is True
        c = w._native.calls[-1]
        assert (c["stream"], c["segs"]) == (3333, (host.data_ptr(), 4 * (ub + 64), 0, 0))
        assert torch.equal(kv[[1, 9]], host[[4, 19]]) and torch.equal(kv[[1, 9]], before[[7, 11]])
        keep = [i for i in range(nb) if i not in (1, 9)]
        assert torch.equal(kv[keep], before[keep])
        assert w.methods == {"store:dma-native": 1, "load:dma-native": 1} and set(w.jobs) == {1, 2}
        assert w.jobs[1].ticket == 1 and w.jobs[2].ticket == 2 and w.jobs[1].own_after
        # not the fast path's jobs: nothing submitted, nothing taken from the event pool
        for a, b in (([1], [2]), (np.array([1], np.int32), np.array([2], np.int32)),
                     (np.array([nb], np.int64), np.array([0], np.int64)),      # out of range
                     (np.array([1, 2], np.int64), np.array([3, 3], np.int64)),  # duplicate slots
                     (np.array([[1]], np.int64), np.array([[2]], np.int64)),  # not 1-D
                     (np.arange(4, dtype=np.int64)[::2], np.array([3, 8], np.int64)),  # strided
                     (np.array([1, 2], np.int64), np.array([3], np.int64))):  # lengths differ
            assert s.submit_fast(3, "store", a, b) is None
        assert s.submit_fast(1, "store", np.array([1], np.int64), np.array([2], np.int64)) is None  # id in use
        w.method = "cuda"  # changed after construction: the fast path (DMA only) steps aside, handing
        # the general path the runs of the ids it checked: (runs of pairs, of src, of dst)
        assert s.submit_fast(3, "store", np.array([1], np.int64), np.array([2], np.int64)) == (1, 1, 1)
        w.method = "dma"
        # a load checks its written side, the blocks: duplicate block ids leave the fast path
        assert s.submit_fast(3, "load", np.array([2, 2], np.int64), np.array([0, 1], np.int64)) is None
        assert len(w._native.calls) == 2 and len(w._free_events[False]) == 6
        # auto: the cost model's answer for both GPU states, asked once per (kind, n, runs)
        asked = []

        from kernels import CostModel

        class _Model(CostModel):  # its choose recorded; dma_either_way (the memo) is the real one
            def __init__(self, picks):
                super().__init__()
                self.picks = picks

            def choose(self, d, ub_, n, busy, avail, n_desc=None, n_desc_host=None):
                asked.append((d, ub_, n, busy, n_desc, n_desc_host))
                return self.picks[busy]

        cp = mover.copier
        monkeypatch.setattr(cp, "cost_model", _Model({False: "dma", True: "dma"}))
        w.method = "auto"
        assert s.submit_fast(5, "store", np.array([3, 4], np.int64), np.array([8, 9], np.int64)) is True
        # runs: 3,4 -> 8,9 is one run on both sides
        assert asked == [("d2h", ub, 2, False, 1, 1), ("d2h", ub, 2, True, 1, 1)]
        assert s.submit_fast(6, "store", np.array([5, 6], np.int64), np.array([10, 11], np.int64)) is True
        assert len(asked) == 2  # same shape: remembered
        assert s.submit_fast(7, "load", np.array([5, 6], np.int64), np.array([10, 11], np.int64)) is True
        assert len(asked) == 4 and asked[-1][0] == "h2d"
        monkeypatch.setattr(cp, "cost_model", _Model({False: "cuda", True: "dma"}))  # a new model: asked again
        # not DMA either way: handed back with the checked ids' runs (one run of pairs, src, dst)
        assert s.submit_fast(8, "store", np.array([3, 4], np.int64), np.array([8, 9], np.int64)) == (1, 1, 1)
        assert len(asked) == 5 and len(w._native.calls) == 5
        # remembered per choose's own 1/16-octave steps of the run counts: 990 and 1000 runs are
        # one step (choose decides both on the same count), 1100 is another
        monkeypatch.setattr(cp, "cost_model", _Model({False: "dma", True: "dma"}))
        asked.clear()
        either = cp.cost_model.dma_either_way
        assert either("d2h", ub, 1000, s.avail, 1000, 1000)
        assert either("d2h", ub, 1000, s.avail, 990, 990) and len(asked) == 2
        assert either("d2h", ub, 1000, s.avail, 1100, 990) and len(asked) == 4
        w.method = "dma"
        # a pool that registers its segments later is seen at the next job
        unregister_segments(host.data_ptr())
        assert s.submit_fast(4, "store", np.array([5], np.int64), np.array([0], np.int64)) is True
        assert w._native.calls[-1]["segs"] == (0, 0, 0, 0)
        # with an NVTX tool listening the submit is one range, closed when the call raises too
        import kernels._nvtx as nv

        log = []
        monkeypatch.setattr(nv, "TOOL", True)
        monkeypatch.setattr(nv, "push", lambda name: log.append(name))
        monkeypatch.setattr(nv, "pop", lambda: log.append("pop"))
        assert s.submit_fast(9, "store", np.array([6], np.int64), np.array([2], np.int64)) is True
        assert log == ["kvo.store.submit native n=1", "pop"]
        free = len(w._free_events[False])
        s.call = (lambda *a: (_ for _ in ()).throw(RuntimeError("record failed")), 0)
        # a failed record queues nothing and is a failed job (as on the pack fast paths), not an exception
        assert s.submit_fast(10, "store", np.array([7], np.int64), np.array([3], np.int64)) is False
        assert log[2:] == ["kvo.store.submit native n=1", "pop"] and len(w._free_events[False]) == free
        assert w.jobs[10].error == "RuntimeError: record failed" and w.jobs[10].ticket is None
    finally:
        unregister_segments(host.data_ptr())


class _PackingRing:
    """Stands in for _C.IndexRing on CPU: pack_job moves every fragment of each block with
    ctypes.memmove at the addresses the fragment table and the unified base and stride give,
    so a wrong argument order shows up as wrong bytes (or a wrong recorded argument). Ids are
    checked as the C++ call checks them (written side: slots for a pack, blocks for an unpack)."""

    def __init__(self, buffers):
        self.calls, self.busy, self.fail = [], False, False
        self.ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in buffers]

    def _inside(self, a, nbytes):
        return any(lo <= a and a + nbytes <= hi for lo, hi in self.ranges)

    capacity = 8  # ids per job, as the real ring's slot capacity
    address = 0xBEE

    def pack_native(self, ring, block_ids, slot_ids, compute, skip_if_busy, num_ctas, after, start, end, fixed):
        """_C.pack_native's documented mapping onto IndexRing::pack_job: the arrays read as
        int64_pair reads them (PACK_NOT_ID_ARRAYS otherwise, or over the capacity)."""
        from kernels._ext import _C

        assert ring == self.address and len(fixed) == 11
        (table, num_frags, unified, unified_stride, n_blocks, n_slots, max_frag_bytes, vec_bytes, to_unified,
         stream, device) = fixed
        pair = _C.int64_pair(block_ids, slot_ids)
        if pair is None or not 0 < pair[0] <= self.capacity:
            return _C.PACK_NOT_ID_ARRAYS, 0, 0, (pair or (0,))[0]
        n, bp, sp = pair
        return (*self.pack_job(table, num_frags, unified, unified_stride, bp, sp, n, n_blocks, n_slots,
                               max_frag_bytes, vec_bytes, to_unified, num_ctas, stream, compute, skip_if_busy,
                               after, start, end, device), n)

    def pack_submit_native(self, sub, block_ids, slot_ids, compute, mode, num_ctas, after, fixed, staged):
        """_C.pack_submit_native's documented mapping onto DmaSubmitter::record_and_submit_pack,
        the thread's work done at once: the arrays read as int64_pair reads them (no capacity
        limit: the job's buffers grow), then as pack_job with no timing events (the submitter's
        own); auto with compute busy runs staged when given a pipe (the same bytes move), else
        answers 6; a ticket and whether the job is staged."""
        from kernels._ext import _C

        assert sub == self.address + 1 and len(fixed) == 11 and mode in (0, 1, 2)
        assert staged is None or len(staged) == 3
        (table, num_frags, unified, unified_stride, n_blocks, n_slots, max_frag_bytes, vec_bytes, to_unified,
         stream, device) = fixed
        pair = _C.int64_pair(block_ids, slot_ids)
        if pair is None or pair[0] <= 0:
            return _C.PACK_NOT_ID_ARRAYS, 0, 0, (pair or (0,))[0], -1, 0
        n, bp, sp = pair
        ticket = 100 + len(self.calls)
        is_staged = mode == 2 or (mode == 1 and self.busy and staged is not None)
        if mode == 1 and self.busy and not is_staged:  # record_and_submit_pack checks the ids first
            code, idx, val, *_ = (_C.check_ids(bp, sp, n, n_blocks, n_slots) if to_unified
                                  else _C.check_ids(sp, bp, n, n_slots, n_blocks))
            return (code, idx, val, n, -1, 0) if code else (6, 0, 0, n, -1, 0)
        code, idx, val = self.pack_job(table, num_frags, unified, unified_stride, bp, sp, n, n_blocks, n_slots,
                                       max_frag_bytes, vec_bytes, to_unified, num_ctas, stream, compute,
                                       mode == 1 and not is_staged, after, 0, 0, device)
        if code == 0:
            self.calls[-1].update(mode=mode, staged=staged, is_staged=is_staged)
        return code, idx, val, n, (ticket if code == 0 else -1), int(is_staged and code == 0)

    def pack_job(self, table, num_frags, unified, unified_stride, block_ids, slot_ids, n, n_blocks, n_slots,
                 max_frag_bytes, vec_bytes, to_unified, num_ctas, stream, compute, skip_if_busy, after, start,
                 end, device):
        import ctypes

        from kernels._ext import _C

        if skip_if_busy and self.busy:
            return 6, 0, 0
        if self.fail:
            raise RuntimeError("launch failed (stand-in)")
        if to_unified:
            code, idx, val, *_ = _C.check_ids(block_ids, slot_ids, n, n_blocks, n_slots)
        else:
            code, idx, val, *_ = _C.check_ids(slot_ids, block_ids, n, n_slots, n_blocks)
        if code:
            return code, idx, val
        as_arr = lambda p, k: np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_int64)), (k,))
        t = as_arr(table, 4 * num_frags).reshape(4, num_frags)
        assert int(t[2].max()) == max_frag_bytes
        for b, s in zip(as_arr(block_ids, n).tolist(), as_arr(slot_ids, n).tolist()):
            for f in range(num_frags):
                kv, host = int(t[0, f] + b * t[1, f]), unified + s * unified_stride + int(t[3, f])
                nbytes = int(t[2, f])
                assert self._inside(kv, nbytes) and self._inside(host, nbytes), "address outside the buffers"
                assert kv % vec_bytes == 0 and host % vec_bytes == 0
                ctypes.memmove(host, kv, nbytes) if to_unified else ctypes.memmove(kv, host, nbytes)
        self.calls.append(dict(n=n, to_unified=to_unified, ctas=num_ctas, stream=stream, compute=compute,
                               skip_if_busy=skip_if_busy, events=(after, start, end), device=device))
        return 0, 0, 0


def _pack_fast_worker(monkeypatch):
    """A TransferWorker with only the fields the per-layer fast paths read, over CPU tensors
    (CPU stands in for pinned), and a _PackingRing standing in for the copier's ring and the
    native submitter. Returns (worker, ring, host buffer with poisoned padding, host view,
    kv tensors, packed(blocks) -> the torch path's unified bytes)."""
    from types import SimpleNamespace

    spec = KVSpec(3, 2, 16, 4, dtype=torch.float16)
    nb, ns = 12, 20
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cpu",
                  fill=lambda t: t.view(torch.uint8).copy_(torch.randint(1, 256, t.view(torch.uint8).shape,
                                                                         dtype=torch.uint8)))
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    assert not mover.contiguous_blocks
    mover._table_dev = torch.from_numpy(mover._host_table)  # the stand-in reads the table on the host
    ub = spec.unified_block_bytes
    hostbuf = torch.full((ns, ub + 64), 0xA5, dtype=torch.uint8)  # strided slots: a stride mix-up moves bytes
    host = hostbuf[:, :ub]
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # CPU stands in for pinned
    ring = _PackingRing([hostbuf, *kv])
    cp = mover.copier
    monkeypatch.setattr(cp, "_ring_get", lambda: SimpleNamespace(ring=ring))
    w = TransferWorker.__new__(TransferWorker)  # no CUDA streams: the fields the fast path reads
    w.mover, w.host, w.method, w.ub, w.jobs, w.methods, w._closed = mover, host, "cuda", ub, {}, {}, False
    w.compute_stream = SimpleNamespace(cuda_stream=1111)
    w._sh, w._dev_index = {"store": 2222, "load": 3333}, 7
    w._free_events = {False: [SimpleNamespace(cuda_event=4444 + i) for i in range(4)],
                      True: [SimpleNamespace(cuda_event=5555 + i) for i in range(8)]}
    from connector.worker import _Inline, _NativePack, _pack_args, _pack_fixed_args

    args = _pack_args(w)
    assert args is not None
    # both per-layer strategies, their fields set as their __init__ would (test handles on w:
    # _t_inline, _t_native)
    si = w._t_inline = _Inline.__new__(_Inline)
    si.w, si.args, si.pack_fixed, si.ring, si.call, si.skip_busy = w, args, _pack_fixed_args(w, args), (None, 0), \
        ring.pack_native, True
    si.fast, si.submit = si.submit_fast, w._submit_held
    sn = w._t_native = _NativePack.__new__(_NativePack)
    sn.w, sn.sub, sn.args, sn.pack_fixed = w, None, args, si.pack_fixed
    sn.modes, sn.call = {"cuda": 0, "auto": 1, "staged": 2}, (ring.pack_submit_native, ring.address + 1)
    sn.pipes, sn.staged_args = None, (-1, None)
    sn.fast, sn.submit = sn.submit_fast, sn.submit_held

    def packed(blocks):  # the reference: the torch path's unified bytes of these blocks
        ref = torch.zeros(len(blocks), ub, dtype=torch.uint8)
        mover.pack(list(blocks), ref, list(range(len(blocks))), method="torch")
        return ref

    return w, ring, hostbuf, host, kv, packed


def _refused_pairs(nb, ns) -> list:
    """(block ids, slot ids) a per-layer fast path must refuse for a store (nothing queued)."""
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    return [([1], [2]), (np.array([1], np.int32), np.array([2], np.int32)),
            (i64(nb), i64(0)), (i64(1), i64(ns)),    # block, slot out of range
            (i64(1, 2), i64(3, 3)),                  # duplicate slots
            (np.array([[1]], np.int64), np.array([[2]], np.int64)),  # not 1-D
            (np.arange(4, dtype=np.int64)[::2], i64(3, 8)),          # strided
            (i64(1, 2), i64(3)), (i64(), i64())]     # lengths differ; empty


def _load_back_two(submit, ring, kv, host, packed, nb):
    """A fast path's load (`submit`, method auto) of slots 4 and 19 into blocks 1 and 9,
    poisoned first, after a store of blocks 7 and 11 into those slots: the stand-in was asked
    whether compute runs, on the load stream, for 2 ids; the blocks hold exactly the slots'
    bytes and no other block changed."""
    for t in kv:
        t[:, [1, 9]] = 0
    before = packed(range(nb))
    assert submit(2, "load", np.array([1, 9], np.int64), np.array([4, 19], np.int64)) is True
    c = ring.calls[-1]
    assert (c["n"], c["to_unified"], c["stream"], c["skip_if_busy"]) == (2, False, 3333, True)
    after = packed(range(nb))
    assert torch.equal(after[[1, 9]], host[[4, 19]]) and torch.equal(after[[1, 9]], packed([7, 11]))
    keep = [i for i in range(nb) if i not in (1, 9)]
    assert torch.equal(after[keep], before[keep])


def test_pack_fast_path_arguments_move_the_right_bytes(monkeypatch):
    """CPU: the per-layer fast path's positional arguments to _C.pack_native (table,
    host base and stride, ids and bounds per direction, streams, events), checked by a
    stand-in ring that packs with them: random non-zero bytes land exactly in poisoned,
    strided host slots and back in poisoned blocks, nothing else moves; inputs it does
    not take (lists, int32, bad ids, compute busy under auto, other methods) queue nothing and
    take no event; a failed launch is a failed job."""
    from kernels._ext import _C

    if _C is None:
        pytest.skip("kernels._C is not built")
    w, ring, hostbuf, host, kv, packed = _pack_fast_worker(monkeypatch)
    cp, ub, nb, ns = w.mover.copier, w.ub, 12, 20
    ids = np.array([7, 2, 3, 11, 0], np.int64)
    slots = np.array([4, 5, 6, 19, 1], np.int64)
    assert w._t_inline.submit_fast(1, "store", ids, slots) is True
    c = ring.calls[-1]
    assert (c["n"], c["to_unified"], c["stream"], c["compute"], c["skip_if_busy"], c["device"]) == \
        (5, True, 2222, 1111, False, 7)
    assert c["events"] == (4447, 5562, 5561) and c["ctas"] == cp.num_ctas
    assert torch.equal(host[torch.from_numpy(slots)], packed(ids))
    rest = np.setdiff1d(np.arange(ns), slots)
    assert (host[torch.from_numpy(rest)] == 0xA5).all() and (hostbuf[:, ub:] == 0xA5).all()
    j = w.jobs[1]
    assert j.nbytes == 5 * ub and j.after.cuda_event == 4447 and j.own_after and j.ticket is None
    assert (j.start.cuda_event, j.end.cuda_event) == (5562, 5561)
    w.method = "auto"
    _load_back_two(w._t_inline.submit_fast, ring, kv, host, packed, nb)
    assert w.methods == {"store:cuda": 1, "load:cuda": 1} and set(w.jobs) == {1, 2}
    # not the fast path's jobs: nothing queued, no event taken
    pools = (len(w._free_events[False]), len(w._free_events[True]))
    for a, b in _refused_pairs(nb, ns) + [(np.arange(9, dtype=np.int64), np.arange(9, dtype=np.int64))]:  # + over
        # the ring's capacity
        assert w._t_inline.submit_fast(3, "store", a, b) is None
    # an unpack writes blocks: duplicate blocks are refused, duplicate slots are fine
    assert w._t_inline.submit_fast(3, "load", np.array([5, 5], np.int64), np.array([0, 1], np.int64)) is None
    assert w._t_inline.submit_fast(1, "store", np.array([1], np.int64), np.array([2], np.int64)) is None  # id in use
    ring.busy = True  # auto with compute running: the general path (staged)
    assert w._t_inline.submit_fast(3, "store", np.array([1], np.int64), np.array([2], np.int64)) is None
    for m in ("staged", "triton", "dma"):
        w.method = m
        assert w._t_inline.submit_fast(3, "store", np.array([1], np.int64), np.array([2], np.int64)) is None
    w.method = "cuda"  # cuda does not ask whether compute runs
    assert w._t_inline.submit_fast(3, "load", np.array([5, 6], np.int64), np.array([0, 0], np.int64)) is True
    assert ring.calls[-1]["skip_if_busy"] is False and len(ring.calls) == 3
    assert (len(w._free_events[False]), len(w._free_events[True])) == (pools[0] - 1, pools[1] - 2)
    # a failed launch: a failed job, its events back in the pools
    ring.fail = True
    assert w._t_inline.submit_fast(4, "store", np.array([1], np.int64), np.array([2], np.int64)) is False
    assert "launch failed" in w.jobs[4].error and w.jobs[4].start is None
    assert (len(w._free_events[False]), len(w._free_events[True])) == (pools[0] - 1, pools[1] - 2)
    # with an NVTX tool listening each submit is one range, closed after a failed launch too
    import kernels._nvtx as nv

    log = []
    monkeypatch.setattr(nv, "TOOL", True)
    monkeypatch.setattr(nv, "push", lambda name: log.append(name))
    monkeypatch.setattr(nv, "pop", lambda: log.append("pop"))
    assert w._t_inline.submit_fast(5, "store", np.array([1], np.int64), np.array([2], np.int64)) is False
    ring.fail = False
    assert w._t_inline.submit_fast(6, "store", np.array([1, 2], np.int64), np.array([2, 3], np.int64)) is True
    assert log == ["kvo.store.submit pack n=1", "pop", "kvo.store.submit pack n=2", "pop"]


def test_pack_native_fast_path_arguments_move_the_right_bytes(monkeypatch):
    """CPU: the per-layer fast path through the native submitter (_submit_fast_pack_native):
    its positional arguments to _C.pack_submit_native, checked by the stand-in that packs with
    them: random non-zero bytes land exactly in poisoned, strided host slots and back in
    poisoned blocks, nothing else moves; the job is tracked by its ticket with the submitter's
    timing events (none taken from the worker's pools); jobs over the ring's capacity are
    taken (the job's buffers grow); inputs it does not take queue nothing and take no event; a
    failed record is a failed job."""
    from kernels._ext import _C

    if _C is None:
        pytest.skip("kernels._C is not built")
    from types import SimpleNamespace

    w, ring, hostbuf, host, kv, packed = _pack_fast_worker(monkeypatch)
    cp, ub, nb, ns = w.mover.copier, w.ub, 12, 20
    w._free_events[False][:0] = [SimpleNamespace(cuda_event=4000 + i) for i in range(6)]  # taken last
    pools = (len(w._free_events[False]), len(w._free_events[True]))
    ids = np.array([7, 2, 3, 11, 0], np.int64)
    slots = np.array([4, 5, 6, 19, 1], np.int64)
    assert w._t_native.submit_fast(1, "store", ids, slots) is True
    c = ring.calls[-1]
    assert (c["n"], c["to_unified"], c["stream"], c["compute"], c["skip_if_busy"], c["device"], c["ctas"]) == \
        (5, True, 2222, 1111, False, 7, cp.num_ctas)
    assert c["events"] == (4447, 0, 0)
    assert torch.equal(host[torch.from_numpy(slots)], packed(ids))
    rest = np.setdiff1d(np.arange(ns), slots)
    assert (host[torch.from_numpy(rest)] == 0xA5).all() and (hostbuf[:, ub:] == 0xA5).all()
    j = w.jobs[1]
    assert (j.nbytes, j.ticket, j.start, j.end, j.after.cuda_event, j.own_after) == (5 * ub, 100, None, None, 4447, True)
    w.method = "auto"
    _load_back_two(w._t_native.submit_fast, ring, kv, host, packed, nb)
    assert w.methods == {"store:cuda-native": 1, "load:cuda-native": 1} and w.jobs[2].ticket == 101
    assert (len(w._free_events[False]), len(w._free_events[True])) == (pools[0] - 2, pools[1])
    # over the ring's capacity of 8: taken
    big = np.arange(10, dtype=np.int64)
    assert w._t_native.submit_fast(3, "store", big, big + 10) is True
    assert torch.equal(host[10:20], packed(range(10)))
    # not the fast path's jobs: nothing queued, no event taken
    calls, free = len(ring.calls), len(w._free_events[False])
    for a, b in _refused_pairs(nb, ns):
        assert w._t_native.submit_fast(4, "store", a, b) is None
    assert w._t_native.submit_fast(4, "load", np.array([5, 5], np.int64), np.array([0, 1], np.int64)) is None
    assert w._t_native.submit_fast(1, "store", np.array([1], np.int64), np.array([2], np.int64)) is None  # in use
    ring.busy = True  # auto with compute running and no staged pipe: the general path (staged),
    # with the ids the C++ call checked taken as checked (); bad ids still go back as None
    assert w._t_native.submit_fast(4, "store", np.array([1], np.int64), np.array([2], np.int64)) == ()
    assert w._t_native.submit_fast(4, "store", np.array([nb], np.int64), np.array([2], np.int64)) is None
    for m in ("staged", "triton", "dma"):  # staged without a pipe, too
        w.method = m
        assert w._t_native.submit_fast(4, "store", np.array([1], np.int64), np.array([2], np.int64)) is None
    assert len(ring.calls) == calls and len(w._free_events[False]) == free and set(w.jobs) == {1, 2, 3}
    w.method = "cuda"  # cuda does not ask whether compute runs
    assert w._t_native.submit_fast(4, "load", np.array([5, 6], np.int64), np.array([0, 0], np.int64)) is True
    assert ring.calls[-1]["skip_if_busy"] is False and ring.calls[-1]["mode"] == 0
    # with staged pipes: auto with compute running and method staged go through them, each job
    # given its direction's pipe and the host's registration segments (looked up once per version)
    import kernels.plan as kplan

    w._t_native.pipes = {"store": 7, "load": 8}
    looked = []
    monkeypatch.setattr(sys.modules["connector.worker"], "segments_for",
                        lambda base: looked.append(base) or (base, 4 * ub))
    w.method = "auto"
    assert w._t_native.submit_fast(6, "store", np.array([8, 10], np.int64), np.array([2, 3], np.int64)) is True
    c = ring.calls[-1]
    hp = w._t_native.args[2]
    assert (c["mode"], c["staged"], c["is_staged"]) == (1, (7, hp, 4 * ub), True)
    assert torch.equal(host[[2, 3]], packed([8, 10]))
    w.method = "staged"
    ring.busy = False
    assert w._t_native.submit_fast(7, "load", np.array([3, 4], np.int64), np.array([2, 3], np.int64)) is True
    c = ring.calls[-1]
    assert (c["mode"], c["staged"], c["is_staged"]) == (2, (8, hp, 4 * ub), True)
    assert looked == [hp]  # once, while the version stays
    kplan.SEGMENTS_VERSION[0] += 1  # (a counter that only grows, as a pool registering would move it)
    w.method = "auto"  # idle: straight to the host, the pipe passed all the same
    assert w._t_native.submit_fast(8, "store", np.array([5], np.int64), np.array([7], np.int64)) is True
    assert (ring.calls[-1]["mode"], ring.calls[-1]["is_staged"]) == (1, False) and looked == [hp, hp]
    assert w.methods == {"store:cuda-native": 3, "load:cuda-native": 2, "store:staged-native": 1,
                         "load:staged-native": 1}, w.methods
    assert w.last_method == "cuda"
    # a failed record or a stopped submitter: a failed job, its event back in the pool
    free = len(w._free_events[False])
    w._t_native.call = (lambda *a: (_ for _ in ()).throw(RuntimeError("DmaSubmitter is stopped")), 0)
    assert w._t_native.submit_fast(5, "store", np.array([1, 2], np.int64), np.array([2, 3], np.int64)) is False
    assert "stopped" in w.jobs[5].error and w.jobs[5].ticket is None and w.jobs[5].nbytes == 2 * ub
    assert len(w._free_events[False]) == free
    # a worker bound to a strategy calls its fast path and its general path with no frame between
    w._bind(w._t_native)
    assert w._fast_fn == w._t_native.submit_fast and w._submit == w._t_native.submit_held
    w._bind(w._t_inline)
    assert w._fast_fn == w._t_inline.submit_fast and w._submit == w._submit_held


def test_submit_converts_ids_for_the_fast_path(monkeypatch):
    """CPU: submit_store / submit_load hand lists, CPU tensors and int32 arrays to the fast path
    as int64 numpy ids (before, they took the general path: ~15x the host time); the bytes land
    exactly where they should. Ids that cannot be converted (floats, 2-D) reach the general path
    as given, which reports them."""
    from kernels._ext import _C

    if _C is None:
        pytest.skip("kernels._C is not built")
    w, ring, hostbuf, host, kv, packed = _pack_fast_worker(monkeypatch)
    general = []
    w._submit = lambda job_id, kind, b, sl, after, runs=None: general.append((kind, b, sl)) or False
    w._fast_fn = w._t_native.submit_fast
    ids, slots = [7, 2, 11], torch.tensor([4, 5, 19])
    assert w.submit_store(1, ids, slots) is True
    c = ring.calls[-1]
    assert c["n"] == 3 and c["to_unified"] and not general
    assert torch.equal(host[slots], packed(ids))
    rest = np.setdiff1d(np.arange(host.shape[0]), slots.numpy())
    assert (host[torch.from_numpy(rest)] == 0xA5).all() and (hostbuf[:, w.ub:] == 0xA5).all()
    w.method = "auto"
    _load_back_two(lambda j, k, b, sl: w.submit_load(j, torch.tensor(sl, dtype=torch.int32), b.astype(np.int32)),
                   ring, kv, host, packed, 12)
    assert w.methods == {"store:cuda-native": 1, "load:cuda-native": 1} and not general
    n = len(ring.calls)
    for bad in ([1.5, 2.0], np.array([[1, 2]], np.int64)):
        assert w.submit_store(3, bad, [0, 1]) is False
        assert general[-1][1] is bad
    assert len(ring.calls) == n and len(general) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False], ids=["native-submit", "inline"])
@pytest.mark.parametrize("method", ["cuda", "auto"])
def test_pack_fast_path_bytes_errors_and_fallbacks(monkeypatch, method, native):
    """The per-layer fast path (int64 numpy ids; method cuda, or auto with compute idle), through
    the native submitter's thread (the default) and inline: never calls `prepare`, packs random
    non-zero bytes exactly into poisoned host slots and unpacks them exactly into poisoned
    blocks, touching nothing else; bad ids still come back as a failed job with the general
    path's message; auto with compute running takes the staged path; the worker's event pools
    end where they started."""
    spec = KVSpec(4, 2, 64, 16)
    nb, ns = 64, 96
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda",
                  fill=lambda t: t.view(torch.uint8).random_(1, 255))
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    ub = spec.unified_block_bytes
    host = torch.empty(ns, ub, dtype=torch.uint8).pin_memory()
    host.fill_(0xA5)
    w = TransferWorker(mover, host, method=method, native_submit=native)
    if w._fast_fn is None:
        pytest.skip("no pack fast path here (kernels._C without pack_native / pack_submit_native)")
    fast = "cuda-native" if native else "cuda"
    pools = (len(w._free_events[False]), len(w._free_events[True]))

    ref_mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)  # its prepare is not counted

    def packed(blocks):  # the torch path's unified bytes of these blocks
        ref = torch.zeros(len(blocks), ub, dtype=torch.uint8)
        ref_mover.pack([int(b) for b in blocks], ref, list(range(len(blocks))), method="torch")
        return ref

    prepared = []
    real_prepare = mover.prepare
    monkeypatch.setattr(mover, "prepare", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))
    rng = np.random.default_rng(9)
    ids = rng.permutation(nb)[:40].astype(np.int64)
    slots = np.sort(rng.permutation(ns)[:40]).astype(np.int64)
    torch.cuda.synchronize()
    assert w.submit_store(1, ids, slots)
    w.wait([1])
    res = w.get_finished()
    assert not prepared, "the fast path called prepare"
    assert [(r.job_id, r.ok, r.nbytes) for r in res] == [(1, True, 40 * ub)] and res[0].ms > 0, res
    assert torch.equal(host[torch.from_numpy(slots)], packed(ids))
    untouched = np.setdiff1d(np.arange(ns), slots)
    assert (host[torch.from_numpy(untouched)] == 0xA5).all(), "bytes outside the job's slots changed"
    # unpack 20 of them into other blocks, poisoned first
    dst = np.setdiff1d(np.arange(nb), ids)[:20].astype(np.int64)
    for t in kv:
        t[:, torch.from_numpy(dst).cuda()] = 0
    before = packed(range(nb))
    assert w.submit_load(2, slots[:20].copy(), dst)
    w.wait([2])
    after = packed(range(nb))
    assert torch.equal(after[torch.from_numpy(dst)], host[torch.from_numpy(slots[:20])])
    keep = np.setdiff1d(np.arange(nb), dst)
    assert torch.equal(after[torch.from_numpy(keep)], before[torch.from_numpy(keep)])
    assert not prepared and w.methods == {f"store:{fast}": 1, f"load:{fast}": 1}, w.methods
    # bad ids: the general path reports them, nothing queued
    assert w.submit_store(3, np.array([nb], np.int64), np.array([0], np.int64)) is False
    assert w.submit_store(4, np.array([1, 2], np.int64), np.array([5, 5], np.int64)) is False
    assert w.submit_load(5, np.array([0, 1], np.int64), np.array([3, 3], np.int64)) is False
    res = {r.job_id: r for r in w.get_finished()}
    assert "out of range" in res[3].error and "duplicate" in res[4].error and "duplicate" in res[5].error
    assert len(prepared) == 3 and not w.jobs
    assert torch.equal(packed(range(nb)), after) and (host[torch.from_numpy(untouched)] == 0xA5).all()
    if method == "auto":  # compute running: packs through GPU staging (the general path)
        torch.cuda._sleep(50_000_000)
        assert w.submit_store(6, np.array([5], np.int64), np.array([untouched[0]], np.int64))
        w.wait([6])
        assert w.methods.get("store:staged-native" if native else "store:staged") == 1, w.methods
        assert torch.equal(host[int(untouched[0])], packed([5])[0])
    assert all(r.ok for r in w.get_finished())
    assert (len(w._free_events[False]), len(w._free_events[True])) == pools
    assert w.shutdown() == []


@pytest.mark.gpu
def test_pack_native_jobs_in_flight_together_grow_and_reuse_buffers():
    """Per-layer jobs through the native submitter queued behind a long GPU sleep, so all are
    in flight at once (more than the submitter keeps spare), with sizes that make the jobs'
    pinned and device id buffers grow (1024 ids, then 3000) while earlier jobs still read
    theirs; then a second round that reuses the released jobs with other sizes. Every slot
    holds exactly its block's bytes (random non-zero, slots poisoned first), the slots no job
    wrote keep the poison, and loads bring the bytes back exactly into a poisoned second cache."""
    spec = KVSpec(2, 1, 16, 1, dtype=torch.float16)  # 128 B unified blocks: many blocks, small bytes
    nb = 10000
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda",
                  fill=lambda t: t.view(torch.uint8).random_(1, 255))
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    ub = spec.unified_block_bytes
    host = torch.empty(nb, ub, dtype=torch.uint8).pin_memory()
    w = TransferWorker(mover, host, method="cuda")
    if w._fast_fn is None:
        pytest.skip("kernels._C without pack_submit_native")
    ref_mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    ref = torch.zeros(nb, ub, dtype=torch.uint8)
    ref_mover.pack(list(range(nb)), ref, list(range(nb)), method="torch")
    rng = np.random.default_rng(4)
    sizes = [5, 1500, 3, 3000, 700, 1, 2500, 9, 1025, 40, 1200, 6]  # 12 jobs: more than 8 spare
    jid = 0
    for rnd in range(2):
        host.fill_(0xA5)
        slots_all, blocks_all = rng.permutation(nb), rng.permutation(nb)  # disjoint across jobs
        order = sizes if rnd == 0 else sizes[::-1]
        assert sum(order) <= nb
        jobs, at = [], 0
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # compute busy: every store waits on it
        for n in order:
            blocks = blocks_all[at:at + n].astype(np.int64)
            slots = np.sort(slots_all[at:at + n]).astype(np.int64)
            at += n
            jid += 1
            assert w.submit_store(jid, blocks, slots)
            jobs.append((jid, blocks, slots))
        assert w._native.in_flight() == len(order)
        w.wait([j for j, _, _ in jobs])
        res = w.get_finished()
        assert len(res) == len(order) and all(r.ok for r in res), res
        for _, blocks, slots in jobs:
            assert torch.equal(host[torch.from_numpy(slots)], ref[torch.from_numpy(blocks)])
        untouched = torch.from_numpy(np.sort(slots_all[at:]))
        assert (host[untouched] == 0xA5).all()
    assert w.methods == {"store:cuda-native": 2 * len(sizes)}, w.methods
    # loads: the last round's slots back into a poisoned second cache
    kv2 = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda", fill=lambda t: t.view(torch.uint8).fill_(0))
    w2 = TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv2), host, method="cuda")
    for i, (_, blocks, slots) in enumerate(jobs):
        assert w2.submit_load(100 + i, slots, blocks)
    w2.wait(list(range(100, 100 + len(jobs))))
    back = torch.zeros(nb, ub, dtype=torch.uint8)
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv2).pack(list(range(nb)), back, list(range(nb)), method="torch")
    written = np.concatenate([b for _, b, _ in jobs])
    assert len(set(written.tolist())) == len(written)
    assert torch.equal(back[torch.from_numpy(written)], ref[torch.from_numpy(written)])
    rest = torch.from_numpy(np.setdiff1d(np.arange(nb), written))
    assert (back[rest] == 0).all()
    assert all(r.ok for r in w2.get_finished()) and w2.methods == {"load:cuda-native": len(jobs)}
    assert w.shutdown() == [] and w2.shutdown() == []


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["staged", "auto"])
def test_pack_native_staged_jobs_exact_across_chunks(method):
    """Per-layer staged jobs through the native submitter's pipeline (method staged; auto with
    compute running), with a staging of 2 x 3 blocks, so each job runs through many chunks and
    both halves, and back-to-back jobs reuse halves the previous job's DMA or unpack still reads:
    stores queued behind a GPU sleep with loads of other slots into a second cache between them.
    Every host slot holds exactly its block's bytes (random non-zero; slots poisoned first, and
    slots no job wrote keep the poison); every loaded block holds its slot's bytes, the rest of
    the second cache keeps its poison; each job is counted as staged-native."""
    spec = KVSpec(3, 2, 32, 8, dtype=torch.float16)
    nb = 96
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda",
                  fill=lambda t: t.view(torch.uint8).random_(1, 255))
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    ub = spec.unified_block_bytes
    host = torch.empty(2 * nb, ub, dtype=torch.uint8).pin_memory()
    host.fill_(0xA5)
    kv2 = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda", fill=lambda t: t.view(torch.uint8).fill_(0))
    m2 = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv2)
    cp = mover.copier  # the device's copier, shared: its staging size is put back at once
    old = cp.staging_bytes
    cp.staging_bytes = 2 * 3 * ub  # halves of 3 blocks (read by the workers' staged pipes)
    try:
        w = TransferWorker(mover, host, method=method)
        w2 = TransferWorker(m2, host, method=method)
    finally:
        cp.staging_bytes = old
    if getattr(w._strategy, "pipes", None) is None:
        pytest.skip("kernels._C without the native staged path")
    assert w._native.staged_shape(w._strategy.pipes["store"])[0] == 3
    ref = torch.zeros(nb, ub, dtype=torch.uint8)
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv).pack(list(range(nb)), ref, list(range(nb)), method="torch")
    # a first round of stores into slots nb.. (the loads' sources), then stores and loads together
    rng = np.random.default_rng(5)
    src_blocks = rng.permutation(nb)[:40].astype(np.int64)
    src_slots = np.sort(nb + rng.permutation(nb)[:40]).astype(np.int64)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    assert w.submit_store(1, src_blocks, src_slots)
    w.wait([1])
    blocks_all, slots_all = rng.permutation(nb), rng.permutation(nb)
    sizes, at, jobs, loads = [1, 7, 3, 16, 2, 11, 5], 0, [], []
    torch.cuda._sleep(400_000_000)  # compute busy (~0.2 s): auto goes staged, and every store waits on it
    for i, n in enumerate(sizes):
        b, sl = blocks_all[at:at + n].astype(np.int64), np.sort(slots_all[at:at + n]).astype(np.int64)
        at += n
        assert w.submit_store(10 + i, b, sl)
        jobs.append((10 + i, b, sl))
        lo = 6 * i
        assert w2.submit_load(50 + i, src_slots[lo:lo + 6].copy(), src_blocks[lo:lo + 6].copy())
        loads.append(50 + i)
    w.wait([j for j, _, _ in jobs])
    w2.wait(loads)
    res = w.get_finished() + w2.get_finished()
    assert len(res) == 1 + 2 * len(sizes) and all(r.ok for r in res), res
    for _, b, sl in jobs:
        assert torch.equal(host[torch.from_numpy(sl)], ref[torch.from_numpy(b)])
    assert (host[torch.from_numpy(np.sort(slots_all[at:]))] == 0xA5).all()
    assert torch.equal(host[torch.from_numpy(src_slots)], ref[torch.from_numpy(src_blocks)])
    got = torch.zeros(nb, ub, dtype=torch.uint8)
    m2.pack(list(range(nb)), got, list(range(nb)), method="torch")
    loaded = src_blocks[:6 * len(sizes)]
    assert torch.equal(got[torch.from_numpy(loaded)], ref[torch.from_numpy(loaded)])
    assert (got[torch.from_numpy(np.setdiff1d(np.arange(nb), loaded))] == 0).all()
    assert w.methods == {"store:staged-native": 1 + len(sizes)}, w.methods
    assert w2.methods == {"load:staged-native": len(sizes)}, w2.methods
    assert w.shutdown() == [] and w2.shutdown() == []


def test_check_pair_is_int64_pair_then_check_ids():
    """_C.check_pair, the native fast path's gate: int64_pair's answer and check_ids' verdict
    on (a, b), or on (b, a) with b_is_src, for valid ids, each kind of bad id, and a job big
    enough to take the check's GIL-free branch; None for empty or non-int64 pairs."""
    from kernels._ext import _C

    if _C is None or not hasattr(_C, "check_pair"):
        pytest.skip("kernels._C (with check_pair) is not built")
    rng = np.random.default_rng(3)
    cases = [(np.array([1, 2, 3, 9], np.int64), np.array([4, 5, 6, 0], np.int64)),
             (np.array([1, 2], np.int64), np.array([7, 7], np.int64)),     # duplicate in b
             (np.array([5, 5], np.int64), np.array([1, 2], np.int64)),     # duplicate in a
             (np.array([1, 10], np.int64), np.array([0, 1], np.int64)),    # a out of range
             (np.array([1, -1], np.int64), np.array([0, 1], np.int64)),    # negative
             (rng.permutation(20000).astype(np.int64), rng.permutation(30000)[:20000].astype(np.int64))]
    for a, b in cases:
        for b_is_src in (False, True):
            na, nb_ = (10, 40000) if len(a) < 1000 else (20000, 30000)
            s, d = (b, a) if b_is_src else (a, b)
            ns, nd = (nb_, na) if b_is_src else (na, nb_)
            want = _C.check_ids(s.ctypes.data, d.ctypes.data, len(a), ns, nd)
            got = _C.check_pair(a, b, ns, nd, b_is_src)  # bounds of (src, dst)
            assert got == (len(a), a.ctypes.data, b.ctypes.data, *want), (a[:4], b[:4], b_is_src)
    assert _C.check_pair(cases[0][0], cases[0][1], 3, 10, False)[3] != 0  # bounds are the caller's
    empty = np.zeros(0, np.int64)
    a, b = cases[0]
    for x, y in ((empty, empty), (a, b[:2]), (a.astype(np.int32), b), ([1], [2]), (a[::2], b[:2])):
        assert _C.check_pair(x, y, 100, 100, False) is None


def test_int64_pair_takes_only_contiguous_int64_id_pairs():
    """_C.int64_pair, the fast paths' gate: (n, addresses) for two 1-D C-contiguous signed int64
    buffers of one length (read-only too), None for anything the general path must judge."""
    from kernels._ext import _C

    if _C is None or not hasattr(_C, "int64_pair"):
        pytest.skip("kernels._C (with int64_pair) is not built")
    a, b = np.arange(10, dtype=np.int64), np.arange(10, 20, dtype=np.int64)
    assert _C.int64_pair(a, b) == (10, a.ctypes.data, b.ctypes.data)
    ro = a.copy()
    ro.flags.writeable = False
    assert _C.int64_pair(ro, b)[0] == 10 and _C.int64_pair(a.astype(np.longlong), b)[0] == 10
    assert _C.int64_pair(a[3:], b[3:]) == (7, a[3:].ctypes.data, b[3:].ctypes.data)
    assert _C.int64_pair(np.zeros(0, np.int64), np.zeros(0, np.int64))[0] == 0
    for x, y in ((a, b[:5]), (a.astype(np.int32), b), (a, b.astype(np.uint64)), (a.astype(np.float64), b),
                 (a[::2], b[:5]), (a.reshape(2, 5), b.reshape(2, 5)), (a.astype(">i8"), b), ([1], [2]),
                 (a, None), (torch.arange(10), b)):
        assert _C.int64_pair(x, y) is None, (x, y)
