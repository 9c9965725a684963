"""Offload-engine benchmark: host pool start-up, worker bidirectional throughput, submit cost.

    python -m profiling.bench.bench_connector [--pool-gib 32] [--out DIR]

In one run:
  * HostPool of --pool-gib GiB: time to the first usable block and to fully
    pinned, against cudaHostAlloc of the same size (same run);
  * TransferWorker with a Llama-3.1-8B-shaped UnifiedKVCache (2 MiB blocks):
    stores and loads in flight together vs the same-run bidirectional big copy;
  * host time to submit a 1000-block job (store and load).
Writes connector.json/.csv.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from connector import HostPool, TransferWorker
from kernels import native
from layout import MODELS, KVBlockMover, KVLayout, UnifiedKVCache, allocate
from profiling.common import TIMING, big_copy_refs, cuda_ms, host_us_busy, nvtx_range, results_dir, write_rows
from profiling.analysis.plots import plot

GiB = 1 << 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-gib", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.cuda.init()
    rows = []
    spec = MODELS["llama-3.1-8b"]
    ub = spec.unified_block_bytes
    # ---- pool start-up vs cudaHostAlloc of the same size
    nbytes = a.pool_gib * GiB
    if nbytes:
        pool_startup(nbytes, ub, rows, a.pool_gib)
    worker_bench(spec, ub, rows)
    out = results_dir(a.out)
    p = write_rows("connector", rows, {}, out, timing=TIMING)
    print(f"wrote {p}")
    plot("connector", out)


def worker_bidir(w, wname, gb, hs, n, ub, ref_bidir, job, rows):
    """Stores and loads of n unified blocks each, in flight together through worker `w`."""

    def both(ev=None):
        """A store and a load of n blocks each, both after `ev` (default: recorded now)."""
        if ev is None:
            ev = torch.cuda.Event()
            ev.record()
        job[0] += 2
        w.submit_store(job[0], gb[:n], hs[:n], after=ev)
        w.submit_load(job[0] + 1, hs[n:], gb[n:], after=ev)
        w.fence(job[0])
        w.fence(job[0] + 1)

    with nvtx_range(f"worker bidir {wname}"):
        gbps_issue = 2 * n * ub / cuda_ms(both, 7) / 1e6
    fin = w.get_finished()
    assert all(r.ok for r in fin), fin
    # The timing above starts when the GPU reaches `ev`, which is before the host has issued
    # the load (the store's ~500 descriptors take the driver ~0.5 ms): that stagger is host
    # issue, not transfer. Here both jobs are queued behind a 10 ms GPU sleep and timed from
    # the end of the sleep, so both directions start together, as jobs already queued do.
    spans = []
    for _ in range(7):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(20e6))
        t0.record()
        both(t0)
        t1.record()
        t1.synchronize()
        spans.append(t0.elapsed_time(t1))
    fin = w.get_finished()
    assert all(r.ok for r in fin), fin
    gbps = 2 * n * ub / float(np.median(spans)) / 1e6
    rows.append({"section": "worker_bidir", "worker": wname, "block_bytes": ub, "blocks_each_way": n, "gbps": round(gbps, 2),
                 "ref_bidir_gbps": round(ref_bidir, 2), "of_ref": round(gbps / ref_bidir, 4),
                 "gbps_with_issue": round(gbps_issue, 2), "of_ref_with_issue": round(gbps_issue / ref_bidir, 4)})
    print(f"worker bidir ({wname:>6}) 2 x {n} x {ub} B: {gbps:.1f} GB/s = {gbps / ref_bidir:.1%} of {ref_bidir:.1f} "
          f"(timed from the first job's start: {gbps_issue:.1f} GB/s = {gbps_issue / ref_bidir:.1%})", flush=True)


def pool_startup(nbytes, ub, rows, gib):
    with nvtx_range("pool"):
        t0 = time.perf_counter()
        pool = HostPool(nbytes // ub, ub)
        first = time.perf_counter() - t0
        pool.wait_pinned()
        full = time.perf_counter() - t0
    info = dict(pool.info)
    pool.close()
    del pool
    with nvtx_range("cudaHostAlloc"):
        ha = native.time_cuda_host_alloc(nbytes=nbytes)
    rows.append({"section": "pool", "gib": gib, "first_usable_s": round(first, 3),
                 "all_pinned_s": round(full, 3), "cuda_host_alloc_s": round(ha, 3),
                 "prefault_s": round(info.get("prefault_s", 0.0), 3), "register_s": round(info.get("register_s", 0.0), 3),
                 "ratio": round(full / ha, 3), **{k: v for k, v in info.items() if not k.endswith("_s")}})
    print(f"pool {gib} GiB: first usable {first:.3f} s, fully pinned {full:.2f} s; "
          f"cudaHostAlloc {ha:.2f} s -> {full / ha:.0%}  ({info})", flush=True)


def pool_vs_pinned(pool, h, g, ub, n, rows):
    """The same 1 GiB DMA (512 contiguous 2 MiB blocks, one job) from the registered pool and from
    a cudaHostAlloc buffer, each direction: does registered (mmap + cudaHostRegister) memory
    move as fast as driver-allocated pinned memory? Also how much of the pool is on 2 MiB pages."""
    from kernels import BlockCopier

    cp = BlockCopier(torch.device("cuda"))
    gv = g[: n * ub].view(n, ub)
    ids = np.arange(n)
    huge = pool.huge_page_bytes()
    for name, host in (("pool", pool.tensor[:n]), ("cudaHostAlloc", h[: n * ub].view(n, ub))):
        for d in ("d2h", "h2d"):
            src, dst = (gv, host) if d == "d2h" else (host, gv)
            ms = cuda_ms(lambda: cp.copy(src, dst, ids, ids, method="dma"), 5)
            gbps = n * ub / ms / 1e6
            rows.append({"section": "pool_vs_pinned", "memory": name, "dir": d, "gbps": round(gbps, 2),
                         "huge_page_fraction": round(huge / pool.nbytes, 3) if (huge is not None and name == "pool")
                         else None})
            print(f"dma {d} 1 GiB from {name:>13}: {gbps:6.1f} GB/s", flush=True)
    print(f"pool on 2 MiB pages: {huge} of {pool.nbytes} B", flush=True)


def worker_bench(spec, ub, rows):
    # ---- worker: bidirectional through the worker, 2 MiB unified blocks
    n = GiB // ub
    cache = UnifiedKVCache(spec, 2 * n, device="cuda")
    cache.buffer.random_(1, 255)
    pool = HostPool(2 * n, ub)
    pool.wait_pinned()
    g = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    # the reference uses one cudaHostAlloc buffer: a single cudaMemcpy cannot
    # span the pool's separate registrations (it fails with invalid argument)
    h = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    ref_bidir = big_copy_refs(g, h)["bidir"]
    pool_vs_pinned(pool, h, g, ub, n, rows)
    del g, h
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    # the worker as issued inline (the caller's thread) and with its default, the native thread
    w = TransferWorker(mover, pool.tensor, native_submit=False)
    wn = TransferWorker(mover, pool.tensor)
    rng = np.random.default_rng(0)
    gb, hs = rng.permutation(2 * n), rng.permutation(2 * n)
    job = [0]
    for wname, wb in (("inline", w), ("native", wn)):
        worker_bidir(wb, wname, gb, hs, n, ub, ref_bidir, job, rows)
    # ---- host submit cost, 1000-block jobs (unified: DMA; per-layer: pack kernel)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 1024, device="cuda")
    # the per-layer fast path as the worker issues it by default (pack jobs through the native
    # thread), and inline (_C.pack_native on the caller's thread), for a same-run comparison
    pl = TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor, method="cuda")
    pli = TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor, method="cuda",
                         native_submit=False)
    # the worker's default method: auto packs straight to host (the fast path) with compute idle
    # and through GPU staging (the general path) while compute runs
    pla_ = TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor)
    # the same without the per-layer fast path (every job through prepare + run), for a same-run comparison
    plg = TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor, method="cuda")
    plg._fast_fn = None  # the strategy's fast path, bound at construction: None sends every job down the general path
    pla = TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor, method="cuda",
                         async_submit=True)
    wa = TransferWorker(mover, pool.tensor, async_submit=True)
    # "unified": inline issue (the caller's thread); "unified-native": the C++ submit thread,
    # the worker's default
    # "-lists": the same worker given its ids as Python lists (converted by submit_store/load)
    same = lambda a: a  # noqa: E731
    lists = lambda a: a.tolist()  # noqa: E731
    for name, wk, conv in (("unified", w, same), ("unified-native", wn, same), ("per-layer-cuda", pl, same),
                           ("per-layer-auto", pla_, same), ("per-layer-auto-lists", pla_, lists),
                           ("per-layer-cuda-inline", pli, same),
                           ("per-layer-cuda-general", plg, same),
                           ("unified-async", wa, same),
                           ("per-layer-cuda-async", pla, same)):
        methods0 = dict(wk.methods)
        for kind in ("store", "load"):
            ts, tis = [], []
            for i in range(21):
                ids = conv(rng.permutation(1000))
                slots = conv(np.sort(rng.permutation(2 * n)[:1000]))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if kind == "store":
                    wk.submit_store(10_000 + i, ids, slots)
                else:
                    wk.submit_load(10_000 + i, slots, ids)
                t1 = time.perf_counter()
                wk.flush()  # until the submit thread has queued it (async workers)
                ts.append((t1 - t0) * 1e6)
                tis.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
                fin = wk.get_finished()
                assert fin and all(r.ok for r in fin), fin
            us, ius = float(np.median(ts[1:])), float(np.median(tis[1:]))
            # GPU idle as an engine sees it: the previous job's end observed by polling
            # get_finished, with no device synchronize before the submit
            tp = []
            for i in range(21):
                ids = conv(rng.permutation(1000))
                slots = conv(np.sort(rng.permutation(2 * n)[:1000]))
                t0 = time.perf_counter()
                if kind == "store":
                    wk.submit_store(15_000 + i, ids, slots)
                else:
                    wk.submit_load(15_000 + i, slots, ids)
                tp.append((time.perf_counter() - t0) * 1e6)
                fin = []
                while not fin:
                    fin = wk.get_finished()
                assert all(r.ok for r in fin), fin
            pus = float(np.median(tp[1:]))
            # the same after a sync, but the job before the timed one was 4 blocks (8 MiB), not
            # 1000 (2 GB): a bulk DMA leaves the host's caches cold for the submit path
            tw = []
            for i in range(21):
                small = rng.permutation(1000)[:4]
                ids = rng.permutation(1000)
                slots = np.sort(rng.permutation(2 * n)[:1000])
                ids, slots, small, slots4 = conv(ids), conv(slots), conv(small), conv(slots[:4])
                for jid, a, b, timed in ((16_000 + 2 * i, small, slots4, False), (16_001 + 2 * i, ids, slots, True)):
                    torch.cuda.synchronize()
                    wk.get_finished()
                    t0 = time.perf_counter()
                    if kind == "store":
                        wk.submit_store(jid, a, b)
                    else:
                        wk.submit_load(jid, b, a)
                    if timed:
                        tw.append((time.perf_counter() - t0) * 1e6)
                    wk.flush()
            torch.cuda.synchronize()
            assert all(r.ok for r in wk.get_finished())
            wus = float(np.median(tw[1:]))
            # as an engine submits: compute running, no host wait between submits
            jb = [(conv(rng.permutation(1000)), conv(np.sort(rng.permutation(2 * n)[:1000]))) for _ in range(8)]
            if kind == "store":
                def one(i, wk=wk):
                    return wk.submit_store(20_000 + i, *jb[i % 8])
            else:
                def one(i, wk=wk):
                    return wk.submit_load(20_000 + i, jb[i % 8][1], jb[i % 8][0])
            bus = host_us_busy(one, reps=24, burst=8, between=lambda wk=wk: (wk.flush(), wk.wait(list(wk.jobs)),
                                                                              wk.get_finished()))
            rows.append({"section": "submit", "worker": name, "kind": kind, "blocks": 1000, "host_us": round(us, 1),
                         "issued_us": round(ius, 1), "host_us_polled": round(pus, 1), "host_us_after_small": round(wus, 1), "host_us_busy": round(bus, 1), "async_submit": wk.async_submit,
                         "native_submit": wk._native is not None, "strategy": type(wk._strategy).__name__.lstrip("_"),
                         "fast_path": wk._fast_fn is not None,
                         # how this row's jobs so far were issued (a worker may serve two rows)
                         "methods": {k: v - methods0.get(k, 0) for k, v in wk.methods.items() if v > methods0.get(k, 0)}})
            print(f"submit {name:>22} {kind}: {us:7.1f} us on the caller per 1000-block job, "
                  f"issued after {ius:7.1f} us; {pus:7.1f} us polled idle; {wus:7.1f} us after a small job; "
                  f"{bus:7.1f} us with the GPU busy",
                  flush=True)

if __name__ == "__main__":
    main()
