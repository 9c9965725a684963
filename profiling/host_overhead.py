"""Where the host time of one copy() goes, piece by piece (median microseconds), and a
cProfile of TransferWorker submits (1000-block jobs, unified and per-layer).

    python profiling/host_overhead.py [--worker]
"""
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import BlockCopier  # noqa: E402
from kernels._ext import _C  # noqa: E402
from kernels.copy import _check_ids_fast  # noqa: E402
from kernels.plan import as_host_ids  # noqa: E402


def us(fn, reps=200):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return np.median(ts) * 1e6


def main():
    cp = BlockCopier("cuda")
    nb, bb = 1 << 17, 4096
    g = torch.empty(nb, bb, dtype=torch.uint8, device="cuda")
    h = torch.empty(nb, bb, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    for n in (1000, 32768):
        si = rng.permutation(nb)[:n]
        di = np.sort(rng.permutation(nb)[:n])
        ring = cp._ring_get()
        s = torch.cuda.current_stream()
        sh = s.cuda_stream
        parts = {
            "current_stream": lambda: torch.cuda.current_stream(cp.device),
            "is_pinned": lambda: h.is_pinned(),
            "_view x2": lambda: (cp._view(g, None, "src"), cp._view(h, None, "dst")),
            "as_host_ids x2": lambda: (as_host_ids(si, "s"), as_host_ids(di, "d")),
            "check_ids": lambda: _check_ids_fast(si, di, nb, nb),
            "ring stage+release": lambda: ring.release(ring.stage(si.ctypes.data, di.ctypes.data, n, sh)[0], sh),
            "kernel launch": lambda: _C.copy_blocks(src=g.data_ptr(), dst=h.data_ptr(),
                                                   src_ids=ring.dev.data_ptr(),
                                                   dst_ids=ring.dev.data_ptr() + 8 * n, n_pairs=n,
                                                   block_bytes=bb, src_stride=bb, dst_stride=bb,
                                                   src_offset=0, dst_offset=0, vec_bytes=16,
                                                   num_ctas=16, stream=sh),
            "copy(cuda)": lambda: cp.copy(g, h, si, di, method="cuda"),
            "copy(triton)": lambda: cp.copy(g, h, si, di, method="triton"),
            "copy(auto idle)": lambda: cp.copy(g, h, si, di, method="auto", busy=False),
            "copy(auto query)": lambda: cp.copy(g, h, si, di, method="auto"),
        }
        for name, fn in parts.items():
            print(f"n={n:>6} {name:<20} {us(fn, 50 if 'copy' in name else 200):9.1f} us", flush=True)


def worker_profile():
    import cProfile
    import pstats

    from connector.host_pool import HostPool
    from connector.worker import TransferWorker
    from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache, allocate

    spec = KVSpec(32, 8, 128, 16, dtype=torch.bfloat16)
    pool = HostPool(2048, spec.unified_block_bytes, torch.device("cuda"))
    pool.wait_pinned()
    uc = UnifiedKVCache(spec, 1024, device="cuda")
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 1024, device="cuda")
    rng = np.random.default_rng(0)
    for name, mover, method in (("unified", KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, uc.unified()), "auto"),
                                ("per-layer", KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), "cuda")):
        w = TransferWorker(mover, pool.tensor, method=method)
        jobs = [(rng.permutation(1000), np.sort(rng.permutation(2048)[:1000])) for _ in range(40)]
        prof = cProfile.Profile()
        for i, (ids, slots) in enumerate(jobs):
            torch.cuda.synchronize()
            if i >= 10:
                prof.enable()
            w.submit_store(i, ids, slots)
            if i >= 10:
                prof.disable()
            torch.cuda.synchronize()
            w.get_finished()
        print(f"--- worker {name} ({method}): 30 submits of 1000 blocks")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_profile()
    else:
        main()
