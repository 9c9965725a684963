"""Where the host time of one copy() goes, piece by piece (median microseconds).

    python profiling/host_overhead.py
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


if __name__ == "__main__":
    main()
