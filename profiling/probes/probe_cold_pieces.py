"""Which layer of a submit goes cold after a 40 ms wait: a trivial Python call, a numpy
attribute read, the same through _C.int64_pair, the C++ id check called straight (_C.check_ids), a 16 KiB memcpy, one CUDA
event record. Companion of probe_cold_submit.py (whole ops) and probe_cold_simd.cpp (the bare
C++ scan per instruction set).

    python -m profiling.probes.probe_cold_pieces      # prints one aligned line per (piece, wait)
"""
import os
import time

import numpy as np
import torch

from kernels import native


def main() -> None:
    n = 1000
    rng = np.random.default_rng(0)
    src = np.empty(n, np.int64)
    dst = np.empty(n, np.int64)
    buf = np.empty(2 * n, np.int64)
    ev = torch.cuda.Event()
    side = torch.cuda.Stream()
    ev.record(side)
    sh, eh = side.cuda_stream, ev.cuda_event

    def noop():
        return None

    pieces = {
        "python noop call": noop,
        "numpy .ctypes.data x2": lambda: (src.ctypes.data, dst.ctypes.data),
        "_C.int64_pair": lambda: native.int64_pair(src, dst),
        "_C.check_ids 1000 pairs": lambda: native.check_ids(src.ctypes.data, dst.ctypes.data, n, 4096, 4096),
        "np.copyto 16 KiB": lambda: np.copyto(buf[:n], src),
        "_C.event_record": lambda: native.event_record(eh, sh, 0),
    }

    def spin(s):
        t = time.perf_counter()
        while time.perf_counter() - t < s:
            pass

    waits = {"none": lambda: None, "spin 40 ms": lambda: spin(0.04), "sleep 40 ms": lambda: time.sleep(0.04),
             "sync after 40 ms GPU": lambda: (torch.cuda._sleep(40_000_000), torch.cuda.synchronize())}
    print(f"# {torch.cuda.get_device_name()}, {time.strftime('%FT%TZ', time.gmtime())}, "
          f"sha {os.environ.get('KVO_GIT_SHA', 'unknown')}")
    print(f"{'piece':<26} {'wait':<22} {'median_us':>9} {'min_us':>8} {'max_us':>8}")
    for name, fn in pieces.items():
        for wname, wait in waits.items():
            ts = []
            for _ in range(21):
                src[:] = rng.integers(0, 4096, n)
                dst[:] = rng.permutation(4096)[:n]
                wait()
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            ts.sort()
            print(f"{name:<26} {wname:<22} {ts[10]:9.1f} {ts[0]:8.1f} {ts[-1]:8.1f}", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
