"""Host submit time of a Triton block copy with the direct launcher on and off (same run).

    python -m profiling.probes.probe_triton_launch [--out DIR]

1000 and 32768 blocks of 4 KiB, GPU -> pinned host, through BlockCopier.bind(method="triton"):
median host microseconds per call, after a device sync and with the GPU busy (bursts of 8
behind a sleep kernel), with kernels.triton_copy's direct launch of the compiled kernel
(default) and with every launch going through Triton's JIT (KVO_TRITON_FAST_LAUNCH=0)."""
import argparse
import os

import numpy as np
import torch

from kernels import BlockCopier, triton_copy
from profiling.common import host_us, host_us_busy, results_dir, write_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("KVO_RESULTS"))
    a = ap.parse_args()
    a.out = results_dir(a.out)
    bb, nb = 4096, 65536
    g = torch.randint(0, 255, (nb, bb), dtype=torch.uint8, device="cuda")
    h = torch.empty((nb, bb), dtype=torch.uint8, pin_memory=True)
    cp = BlockCopier("cuda")
    b = cp.bind(g, h, method="triton")
    rng = np.random.default_rng(0)
    rows = []
    for n in (1000, 32768):
        si, di = rng.permutation(nb)[:n], rng.permutation(nb)[:n]
        for fast in (True, False, True, False):  # twice each, alternating
            triton_copy._FAST = fast
            us = host_us(lambda: b(si, di))
            busy = host_us_busy(lambda i: b(si, di))
            rows.append({"count": n, "fast_launch": fast, "host_us": round(us, 1), "host_us_busy": round(busy, 1)})
            print(f"triton-bind n={n:>6} fast_launch={fast!s:>5}: {us:7.1f} us after a sync, {busy:7.1f} us busy",
                  flush=True)
    triton_copy._FAST = True
    torch.cuda.synchronize()
    assert torch.equal(h[torch.from_numpy(di)].cuda(), g[torch.from_numpy(si)])
    write_rows("triton_launch", rows, {"triton": __import__("triton").__version__}, out_dir=a.out)


if __name__ == "__main__":
    main()
