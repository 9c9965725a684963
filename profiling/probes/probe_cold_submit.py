"""Why a submit right after a big transfer costs 2-5x its steady-state host time.

    python -m profiling.probes.probe_cold_submit [--reps 15] [--out DIR]

Times three host operations, each alone, right after one of several ways of waiting:
  check   the C++ id check of 1000 random pairs (CPU only: no driver call);
  record  one CUDA event record on a side stream (one driver call);
  copy    BlockCopier.copy(method="cuda") of 1000 x 4 KiB blocks GPU -> pinned host (a whole submit).
Waits (the op is timed after each; median of --reps):
  small-sync  an 8 MiB D2H copy, then torch.cuda.synchronize()   (the benchmarks' "after a small job");
  big-sync    a 2 GiB D2H copy (~37 ms), then torch.cuda.synchronize()   ("after a big job");
  big-poll    the same copy, polled with event.query() in a Python loop;
  big-pinned  big-sync with the process pinned to one CPU, the lowest it may use (no migration);
  idle-spin   no GPU work, a 40 ms Python busy loop (CPU hot, GPU idle);
  idle-sleep  no GPU work, time.sleep(0.04) (the thread sleeps, GPU idle).
Comparing them separates a cold CPU (sleep vs spin), a GPU gone idle (idle-spin vs small-sync),
the bulk DMA itself (big-poll vs idle-spin) and thread migration (big-pinned vs big-sync).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from kernels import BlockCopier
from kernels.copy import check_id_pairs
from profiling.common import results_dir, write_rows

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    big_g = torch.empty(2 * GiB, dtype=torch.uint8, device=dev)
    big_h = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    nb, bb = 1 << 15, 4096
    g = torch.empty(nb, bb, dtype=torch.uint8, device=dev)
    h = torch.empty(nb, bb, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    si, di = rng.permutation(nb)[:1000], rng.permutation(nb)[:1000]
    cp = BlockCopier(dev)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    ops = {
        "check": lambda: check_id_pairs(si, di, nb, nb),
        "record": lambda: ev.record(side),
        "copy": lambda: cp.copy(g, h, si, di, method="cuda"),
    }
    for f in ops.values():  # warm: compile, bind, first launches
        f()
    torch.cuda.synchronize()

    def copy_then(nbytes: int):
        big_h[:nbytes].copy_(big_g[:nbytes], non_blocking=True)

    def spin(s: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < s:
            pass

    def big_poll() -> None:
        copy_then(2 * GiB)
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            pass

    waits = {
        "small-sync": lambda: (copy_then(8 << 20), torch.cuda.synchronize()),
        "big-sync": lambda: (copy_then(2 * GiB), torch.cuda.synchronize()),
        "big-poll": big_poll,
        "big-pinned": lambda: (copy_then(2 * GiB), torch.cuda.synchronize()),
        "idle-spin": lambda: spin(0.04),
        "idle-sleep": lambda: time.sleep(0.04),
    }
    rows = []
    cpus = os.sched_getaffinity(0)
    for wname, wait in waits.items():
        pinned = wname == "big-pinned"
        if pinned:
            os.sched_setaffinity(0, {min(cpus)})  # Python has no sched_getcpu: the lowest allowed CPU
        try:
            for oname, op in ops.items():
                ts = []
                for _ in range(a.reps):
                    wait()
                    t0 = time.perf_counter()
                    op()
                    ts.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
                med = float(np.median(ts))
                rows.append({"wait": wname, "op": oname, "median_us": round(med, 1),
                             "min_us": round(min(ts), 1), "max_us": round(max(ts), 1)})
                print(f"{wname:>11} {oname:>7}: median {med:8.1f} us  (min {min(ts):7.1f}, max {max(ts):8.1f})",
                      flush=True)
        finally:
            if pinned:
                os.sched_setaffinity(0, cpus)
    out = results_dir(a.out)
    write_rows("cold_submit", rows, {"reps": a.reps}, out)
    from profiling.analysis.plots import plot

    plot("cold_submit", out)


if __name__ == "__main__":
    main()
