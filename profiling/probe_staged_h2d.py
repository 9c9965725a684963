"""Why `staged` H2D of small blocks costs the host 3-4x what `dma` does, and whether that is
tied to the open staged-H2D fault (profiling/repro_staged_fault.py).

    python profiling/probe_staged_h2d.py [--out DIR] [--blocks N] [--block-bytes B]

Every transfer.json since 4361a1b shows it: 1 GiB of 4 KiB blocks H2D, `dma` ~0.5 us of host
time per descriptor, `staged` ~1.6 us, although staged issues the same descriptors (random host
blocks into consecutive staging slots) in chunks of 8192. The variants below take the staged
pipeline apart: the same descriptors as one DMA call, as chunks, as chunks with the pipeline's
cross-stream events, on the legacy default stream (which batch copies replace with the
per-thread stream) or on a created stream, and with the cudaMemcpyAsync loop. One line per
variant: host ms per call (median after a warm-up, a device sync before each call), device ms
(CUDA events), and us of host time per descriptor.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import BlockCopier  # noqa: E402
from kernels._ext import _C  # noqa: E402
from profiling.common import write_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--blocks", type=int, default=65536)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    bb, n = a.block_bytes, a.blocks
    nbuf = 2 * n
    g = torch.empty(nbuf * bb, dtype=torch.uint8, device="cuda").view(nbuf, bb)
    h = torch.empty(nbuf * bb, dtype=torch.uint8, pin_memory=True).view(nbuf, bb)
    rng = np.random.default_rng(0)
    hi, gi = rng.permutation(nbuf)[:n], rng.permutation(nbuf)[:n]
    cp = BlockCopier("cuda")
    cp1 = BlockCopier("cuda", dma_lanes=1)
    cpl = BlockCopier("cuda")
    cpl.dma_mode = _C.DMA_LOOP
    cp4 = BlockCopier("cuda", dma_lanes=4, dma_lane_min_desc_bytes=0)
    cp8 = BlockCopier("cuda", dma_lanes=8, dma_lane_min_desc_bytes=0)
    cpbig = BlockCopier("cuda", dma_lanes=1, max_descriptors_per_call=1 << 20)
    cpsmall = BlockCopier("cuda", dma_lanes=1, max_descriptors_per_call=2048)
    cpnh = BlockCopier("cuda", dma_lanes=1)
    cpnh.dma_mode = _C.DMA_BATCH_NO_HINT
    his = np.sort(hi)
    side = torch.cuda.Stream()
    aux = torch.cuda.Stream()
    per = cp.staged_chunk_bytes // bb
    evs = [torch.cuda.Event() for _ in range(4)]

    def chunks(events: bool):
        def f():
            s = torch.cuda.current_stream()
            for j, c in enumerate(range(0, n, per)):
                if events and j >= 2:
                    s.wait_event(evs[2 + j % 2])  # the pipeline's "free" wait
                cp1.copy(h, g, hi[c:c + per], gi[c:c + per], method="dma")
                if events:
                    evs[j % 2].record(s)          # "ready"
                    aux.wait_event(evs[j % 2])
                    evs[2 + j % 2].record(aux)    # "free"
        return f

    def on(stream, fn):
        def f():
            with torch.cuda.stream(stream):
                fn()
        return f

    variants = {
        "dma": lambda: cp.copy(h, g, hi, gi, method="dma"),
        "dma-1lane": lambda: cp1.copy(h, g, hi, gi, method="dma"),
        "dma-1lane-side": on(side, lambda: cp1.copy(h, g, hi, gi, method="dma")),
        "dma-chunks": chunks(False),
        "dma-chunks-events": chunks(True),
        "dma-chunks-events-side": on(side, chunks(True)),
        "dma-4lanes-tiny": lambda: cp4.copy(h, g, hi, gi, method="dma"),
        "dma-8lanes-tiny": lambda: cp8.copy(h, g, hi, gi, method="dma"),
        "dma-1lane-onecall": lambda: cpbig.copy(h, g, hi, gi, method="dma"),
        "dma-1lane-calls2048": lambda: cpsmall.copy(h, g, hi, gi, method="dma"),
        "dma-1lane-nohint": lambda: cpnh.copy(h, g, hi, gi, method="dma"),
        "dma-1lane-hostsorted": lambda: cp1.copy(h, g, his, gi, method="dma"),
        "staged": lambda: cp.copy(h, g, hi, gi, method="staged"),
        "staged-side": on(side, lambda: cp.copy(h, g, hi, gi, method="staged")),
        "staged-loop": lambda: cpl.copy(h, g, hi, gi, method="staged"),
        "staged-d2h": lambda: cp.copy(g, h, gi, hi, method="staged"),
        "dma-d2h": lambda: cp.copy(g, h, gi, hi, method="dma"),
        "dma-d2h-4lanes-tiny": lambda: cp4.copy(g, h, gi, hi, method="dma"),
    }
    rows = []
    print(f"H2D unless named, {n} blocks of {bb} B, random host ids; host ms / device ms / us per descriptor")
    for name, fn in variants.items():
        hs, ds = [], []
        for r in range(a.reps + 1):
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = side if name.endswith("-side") else torch.cuda.current_stream()
            t0.record(stream)
            c0 = time.perf_counter()
            fn()
            c1 = time.perf_counter()
            t1.record(stream)
            torch.cuda.synchronize()
            if r:
                hs.append((c1 - c0) * 1e3)
                ds.append(t0.elapsed_time(t1))
        hm, dm = float(np.median(hs)), float(np.median(ds))
        rows.append({"variant": name, "blocks": n, "block_bytes": bb, "host_ms": round(hm, 2),
                     "device_ms": round(dm, 2), "host_us_per_desc": round(hm * 1e3 / n, 3)})
        print(f"{name:>24}: host {hm:8.2f} ms  device {dm:8.2f} ms  {hm * 1e3 / n:6.3f} us/desc", flush=True)
    write_rows("staged_h2d_probe", rows, out_dir=a.out)


if __name__ == "__main__":
    main()
