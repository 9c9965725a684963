"""Issue 6: host<->device bandwidth of several GPUs sharing one pinned host pool.

    python -m profiling.bench.bench_multi_gpu [--gib 1] [--pool hostpool|pinned|tp] [--numa-node N] [--out DIR]

--pool tp is the tensor-parallel case itself: one process per GPU, each mapping the same
shared /dev/shm HostPool laid out as vLLM does (a row per block, a cell per rank, see
connector.tp) and moving only its own cells by BlockCopier dma. Processes start each pass
together (a barrier) and report host-clock (CLOCK_MONOTONIC, shared by processes) start and
end times; the aggregate is all bytes over the span from the first start to the last end.

One pinned host region (the shared pool) holds one 1 GiB cell per GPU. Measures, in one run:
each GPU alone (D2H, H2D, both directions), then every GPU at once (D2H, H2D, both), and
reports the aggregate against the sum of the GPUs alone. Timed on the host clock around
a synchronisation of every device (copies on different GPUs share no CUDA event clock),
after warm-up, median of 5. Also records each GPU's NUMA node (sysfs). Writes multi_gpu.json/.csv.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from profiling.common import nvtx_range, results_dir, write_rows
from profiling.analysis.plots import plot


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
    ap.add_argument("--pool", choices=["hostpool", "pinned", "tp"], default="hostpool",
                    help="hostpool: connector.HostPool, 2 MiB blocks moved by BlockCopier dma (the "
                         "connector's path); pinned: one torch pinned tensor, one big copy per cell; "
                         "tp: one process per GPU sharing one HostPool (see the module docstring)")
    ap.add_argument("--numa-node", type=int, default=None,
                    help="bind the pool to this NUMA node (hostpool/tp; the machine must have several)")
    a = ap.parse_args()
    a.out = results_dir(a.out)
    if a.pool == "tp":
        return main_tp(a)
    n = torch.cuda.device_count()
    nbytes = int(a.gib * (1 << 30))
    bb = 2 << 20
    nb = nbytes // bb
    if a.pool == "hostpool":
        from connector.host_pool import HostPool
        from kernels import BlockCopier

        pool = HostPool(2 * n * nb, bb, device="cuda:0", numa_node=a.numa_node)  # one pool: a D2H and an H2D cell per GPU
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
    print(f"pool: {a.pool}, {numa_desc(a.numa_node)}", flush=True)
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
    write_rows(f"multi_gpu{'_pinned' if a.pool == 'pinned' else ''}", rows,
               {"gpus": n, "numa_nodes": [numa_node(d) for d in range(n)], **numa_meta(a.numa_node),
                                   "gpu_names": [torch.cuda.get_device_name(d) for d in range(n)],
                                   "bytes_per_copy": nbytes, "reps": a.reps, "pool": a.pool,
                                   "block_bytes": bb if a.pool == "hostpool" else nbytes}, a.out)
    plot(f"multi_gpu{'_pinned' if a.pool == 'pinned' else ''}", a.out)


def numa_meta(bound) -> dict:
    from connector.host_pool import numa_node_count
    try:
        cpus = open("/sys/devices/system/cpu/online").read().strip()
    except OSError:
        cpus = "?"
    return {"host_numa_nodes": numa_node_count(), "pool_numa_node": bound, "cpus_online": cpus}


def numa_desc(bound) -> str:
    m = numa_meta(bound)
    where = f"pool bound to node {bound}" if bound is not None else "pool placed by the GPU's node (if known)"
    return f"{m['host_numa_nodes']} host NUMA node(s), CPUs {m['cpus_online']}, {where}"


def _tp_rank(rank, world, name, nb, bb, reps, numa, bar, q):
    """One TP rank on GPU `rank`: its D2H cells are rows [0, nb), its H2D cells rows [nb, 2nb)."""
    try:
        from connector.host_pool import HostPool
        from connector.tp import rank_cells, row_bytes
        from kernels import BlockCopier

        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        pool = HostPool(2 * nb, row_bytes(bb, world, False), dev, shared_name=name, background=False,
                        numa_node=numa)
        mine = rank_cells(pool.tensor, rank, world, bb)
        out_cells, in_cells = mine[:nb], mine[nb:]
        g_src = torch.randint(1, 255, (nb, bb), dtype=torch.uint8, device=dev)
        g_dst = torch.empty(nb, bb, dtype=torch.uint8, device=dev)
        # the same-run reference: one big copy of a private pinned region, per direction
        big_h = torch.empty(nb * bb, dtype=torch.uint8, pin_memory=True)
        big_d = torch.empty(nb * bb, dtype=torch.uint8, device=dev)
        big_d2 = torch.empty(nb * bb, dtype=torch.uint8, device=dev)
        big_h2 = torch.empty(nb * bb, dtype=torch.uint8, pin_memory=True)
        sd, sh = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        cp = BlockCopier(dev)
        rng = np.random.default_rng(rank)
        pg, ph = rng.permutation(nb), rng.permutation(nb)
        q.put(("ready", rank, pool.info))
        while True:
            cmd = q_get(bar)
            if cmd is None:
                break
            kind, active = cmd
            torch.cuda.synchronize(dev)
            bar["b"].wait()
            t0 = time.perf_counter()
            if rank in active and kind.startswith("big-"):
                for _ in range(reps):
                    if kind in ("big-d2h", "big-both"):
                        with torch.cuda.stream(sd):
                            big_h.copy_(big_d, non_blocking=True)
                    if kind in ("big-h2d", "big-both"):
                        with torch.cuda.stream(sh):
                            big_d2.copy_(big_h2, non_blocking=True)
                torch.cuda.synchronize(dev)
            elif rank in active:
                for _ in range(reps):
                    if kind in ("d2h", "both"):
                        cp.copy(g_src, out_cells, pg, ph, method="dma", stream=sd)
                    if kind in ("h2d", "both"):
                        cp.copy(in_cells, g_dst, ph, pg, method="dma", stream=sh)
                torch.cuda.synchronize(dev)
            q.put(("t", rank, t0, time.perf_counter()))
        # the bytes went where they should: this rank's cells hold its GPU blocks
        ok = torch.equal(out_cells[torch.as_tensor(ph)].to(dev), g_src[torch.as_tensor(pg, device=dev)])
        q.put(("done", rank, ok))
        del mine, out_cells, in_cells
        pool.close()
    except Exception as e:
        q.put(("error", rank, repr(e)))


def q_get(bar):
    return bar["cmd"].get()


def main_tp(a):
    import multiprocessing as mp
    import uuid

    n = torch.cuda.device_count()
    bb = 2 << 20
    nb = int(a.gib * (1 << 30)) // bb
    nbytes = nb * bb
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = f"bench-{uuid.uuid4().hex[:8]}"
    cmds = [ctx.Queue() for _ in range(n)]
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=_tp_rank, args=(r, n, name, nb, bb, a.reps, a.numa_node,
                                                 {"b": barrier, "cmd": cmds[r]}, q)) for r in range(n)]
    for p in procs:
        p.start()
    infos = {}
    try:
        for _ in range(n):
            m = q.get(timeout=300)
            if m[0] != "ready":
                raise RuntimeError(m)
            infos[m[1]] = m[2]

        def timed(active, kind):
            spans = []
            for _ in range(6):
                for c in cmds:
                    c.put((kind, active))
                ts = [q.get(timeout=300) for _ in range(n)]
                if any(t[0] != "t" for t in ts):
                    raise RuntimeError(ts)
                ts = [t for t in ts if t[1] in active]
                spans.append(max(t[3] for t in ts) - min(t[2] for t in ts))
            dirs = 2 if kind.endswith("both") else 1
            return len(active) * dirs * a.reps * nbytes / float(np.median(spans[1:])) / 1e9

        rows = []
        ref = {}
        for kind in ("d2h", "h2d", "both"):  # physical-limit reference, this run
            ref[kind] = [timed([d], "big-" + kind) for d in range(n)]
            rows += [{"kind": "big-" + kind, "gpus": str(d), "gbps": round(g, 2)} for d, g in enumerate(ref[kind])]
        print(f"pool: tp ({n} processes, one shared HostPool, rows of {n} x 2 MiB cells), "
              f"{numa_desc(a.numa_node)}; GPU NUMA nodes {[numa_node(d) for d in range(n)]}", flush=True)
        for kind in ("d2h", "h2d", "both"):
            alone = []
            for d in range(n):
                g = timed([d], kind)
                alone.append(g)
                rows.append({"kind": kind, "gpus": str(d), "gbps": round(g, 2)})
            for d in range(n):
                rows[-n + d]["of_big_copy"] = round(alone[d] / ref[kind][d], 4)
            agg = timed(list(range(n)), kind)
            rows.append({"kind": kind, "gpus": "all", "gbps": round(agg, 2), "sum_alone_gbps": round(sum(alone), 2),
                         "of_sum_alone": round(agg / sum(alone), 4),
                         "of_sum_big_copy": round(agg / sum(ref[kind]), 4)})
            print(f"{kind:>4}: alone " + " ".join(f"gpu{d} {g:6.1f} ({g / r:.1%} of its big copy {r:.1f})"
                                                 for d, (g, r) in enumerate(zip(alone, ref[kind])))
                  + f" | all at once {agg:6.1f} GB/s = {agg / sum(alone):.1%} of the sum", flush=True)
        for c in cmds:
            c.put(None)
        done = [q.get(timeout=300) for _ in range(n)]
        ok = all(d[0] == "done" and d[2] for d in done)
        print(f"each rank's cells hold its own GPU blocks: {ok} {done if not ok else ''}", flush=True)
        write_rows("multi_gpu_tp", rows, {"gpus": n, "numa_nodes": [numa_node(d) for d in range(n)],
                                          **numa_meta(a.numa_node), "pool_info": infos,
                                          "gpu_names": [torch.cuda.get_device_name(d) for d in range(n)],
                                          "bytes_per_copy": nbytes, "reps": a.reps, "pool": "tp",
                                          "block_bytes": bb, "cells_verified": ok}, a.out)
        plot("multi_gpu_tp", a.out)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        try:
            os.unlink(f"/dev/shm/kvoffload-{name}")
        except OSError:
            pass


if __name__ == "__main__":
    main()
