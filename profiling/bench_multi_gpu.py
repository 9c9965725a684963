"""Issue 6: host<->device bandwidth of several GPUs sharing one pinned host pool.

    python profiling/bench_multi_gpu.py [--gib 1] [--out DIR]

One pinned host region (the shared pool) holds one 1 GiB cell per GPU. Measures, in one run:
each GPU alone (D2H, H2D, both directions), then every GPU at once (D2H, H2D, both), and
reports the aggregate against the sum of the GPUs alone. Timed on the host clock around
a synchronisation of every device (copies on different GPUs share no CUDA event clock),
after warm-up, median of 5. Also records each GPU's NUMA node (sysfs). Writes multi_gpu.json/.csv.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from profiling.common import nvtx_range, write_rows  # noqa: E402
from profiling.plots import plot  # noqa: E402


def numa_node(d: int) -> int:
    try:
        p = torch.cuda.get_device_properties(d)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        return int(open(f"/sys/bus/pci/devices/{bus}/numa_node").read())
    except Exception:
        return -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pool", choices=["hostpool", "pinned"], default="hostpool",
                    help="hostpool: connector.HostPool, 2 MiB blocks moved by BlockCopier dma (the "
                         "connector's path); pinned: one torch pinned tensor, one big copy per cell")
    a = ap.parse_args()
    n = torch.cuda.device_count()
    nbytes = int(a.gib * (1 << 30))
    bb = 2 << 20
    nb = nbytes // bb
    if a.pool == "hostpool":
        from connector.host_pool import HostPool
        from kernels import BlockCopier

        pool = HostPool(2 * n * nb, bb, device="cuda:0")  # one pool: a D2H and an H2D cell per GPU
        pool.wait_pinned()
        host = pool.tensor.view(-1)
    else:
        host = torch.empty(2 * n * nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    cells = [(host[(2 * d) * nbytes:(2 * d + 1) * nbytes], host[(2 * d + 1) * nbytes:(2 * d + 2) * nbytes])
             for d in range(n)]
    gpu = [(torch.empty(nbytes, dtype=torch.uint8, device=d), torch.empty(nbytes, dtype=torch.uint8, device=d))
           for d in range(n)]
    streams = [(torch.cuda.Stream(d), torch.cuda.Stream(d)) for d in range(n)]
    copiers = [BlockCopier(f"cuda:{d}") for d in range(n)] if a.pool == "hostpool" else None
    rng = np.random.default_rng(0)
    perm = [(rng.permutation(nb), rng.permutation(nb)) for _ in range(n)]  # random slots, no coalescing

    def issue(d, kind):
        (hd, hh), (gd, gh), (sd, sh) = cells[d], gpu[d], streams[d]
        for _ in range(a.reps):
            if copiers is not None:
                cp, (pg, ph) = copiers[d], perm[d]
                if kind in ("d2h", "both"):
                    cp.copy(gd.view(nb, bb), hd.view(nb, bb), pg, ph, method="dma", stream=sd)
                if kind in ("h2d", "both"):
                    cp.copy(hh.view(nb, bb), gh.view(nb, bb), ph, pg, method="dma", stream=sh)
                continue
            if kind in ("d2h", "both"):
                with torch.cuda.stream(sd):
                    hd.copy_(gd, non_blocking=True)
            if kind in ("h2d", "both"):
                with torch.cuda.stream(sh):
                    gh.copy_(hh, non_blocking=True)

    def timed(devs, kind):
        ts = []
        for i in range(6):
            for d in devs:
                torch.cuda.synchronize(d)
            t0 = time.perf_counter()
            for d in devs:
                issue(d, kind)
            for d in devs:
                torch.cuda.synchronize(d)
            ts.append(time.perf_counter() - t0)
        dirs = 2 if kind == "both" else 1
        return len(devs) * dirs * a.reps * nbytes / float(np.median(ts[1:])) / 1e9

    rows = []
    print(f"pool: {a.pool}", flush=True)
    print(f"{n} GPUs, NUMA nodes {[numa_node(d) for d in range(n)]}, {a.gib} GiB x {a.reps} per copy", flush=True)
    for kind in ("d2h", "h2d", "both"):
        alone = []
        for d in range(n):
            with nvtx_range(f"multi_gpu alone gpu={d} {kind}"):
                g = timed([d], kind)
            alone.append(g)
            rows.append({"kind": kind, "gpus": str(d), "gbps": round(g, 2)})
        with nvtx_range(f"multi_gpu all {kind}"):
            agg = timed(list(range(n)), kind)
        rows.append({"kind": kind, "gpus": "all", "gbps": round(agg, 2), "sum_alone_gbps": round(sum(alone), 2),
                     "of_sum_alone": round(agg / sum(alone), 4)})
        print(f"{kind:>4}: alone " + " ".join(f"gpu{d} {g:6.1f}" for d, g in enumerate(alone))
              + f" | all at once {agg:6.1f} GB/s = {agg / sum(alone):.1%} of the sum", flush=True)
    write_rows("multi_gpu", rows, {"gpus": n, "numa_nodes": [numa_node(d) for d in range(n)],
                                   "gpu_names": [torch.cuda.get_device_name(d) for d in range(n)],
                                   "bytes_per_copy": nbytes, "reps": a.reps, "pool": a.pool,
                                   "block_bytes": bb if a.pool == "hostpool" else nbytes}, a.out)
    plot("multi_gpu", a.out)


if __name__ == "__main__":
    main()
