"""Why `staged` H2D of small blocks costs the host 3-4x what `dma` does, and whether that is
tied to the open staged-H2D fault (profiling/probes/repro_staged_fault.py).

    python -m profiling.probes.probe_staged_h2d [--out DIR] [--blocks N] [--block-bytes B]

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
import time

import numpy as np
import torch

from kernels import BlockCopier
from kernels import native
from kernels.copy import DEFAULT_MAX_DESC_PER_CALL
from profiling.common import big_copy_refs, results_dir, write_rows


def buffers(bb: int, n: int):
    """[2n, bb] device and pinned host blocks, and n random host and device ids."""
    g = torch.empty(2 * n * bb, dtype=torch.uint8, device="cuda").view(2 * n, bb)
    h = torch.empty(2 * n * bb, dtype=torch.uint8, pin_memory=True).view(2 * n, bb)
    rng = np.random.default_rng(0)
    return g, h, rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--blocks", type=int, default=65536)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--per-call", action="store_true",
                    help="instead: descriptors per driver call swept, the variants taking turns")
    a = ap.parse_args()
    a.out = results_dir(a.out)
    if a.per_call:
        return per_call(a)
    bb, n = a.block_bytes, a.blocks
    g, h, hi, gi = buffers(bb, n)
    cp = BlockCopier("cuda")
    cp1 = BlockCopier("cuda", dma_lanes=1)
    cpl = BlockCopier("cuda")
    cpl.dma_mode = native.DMA_LOOP
    cp4 = BlockCopier("cuda", dma_lanes=4, dma_lane_min_desc_bytes=0)
    cp8 = BlockCopier("cuda", dma_lanes=8, dma_lane_min_desc_bytes=0)
    # the batcher caps a driver call at 2048 descriptors (kvo::kMaxDescPerCall, since the staged-H2D
    # fault): "one call" variants ask for more and get calls of 2048
    cpbig = BlockCopier("cuda", dma_lanes=1, max_descriptors_per_call=1 << 20)
    cpsmall = BlockCopier("cuda", dma_lanes=1, max_descriptors_per_call=2048)
    cpnh = BlockCopier("cuda", dma_lanes=1)
    cpnh.dma_mode = native.DMA_BATCH_NO_HINT
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


def per_call(a):
    """Descriptors per cudaMemcpyBatchAsync call, both directions, the variants taking turns
    (so a drift of the machine's state shows as spread, not as a difference): is the cost per
    descriptor a matter of the call size or of when the call ran?"""
    bb, n = a.block_bytes, a.blocks
    g, h, hi, gi = buffers(bb, n)
    ref = big_copy_refs(g.view(-1), h.view(-1))
    sizes = (128, 256, 512, 1024, 2048)  # the batcher caps a call at 2048 (kvo::kMaxDescPerCall)
    cps = {k: BlockCopier("cuda", dma_lanes=1, max_descriptors_per_call=k) for k in sizes}
    stg = {k: BlockCopier("cuda", max_descriptors_per_call=k) for k in (512, 2048)}
    dflt = BlockCopier("cuda")  # the defaults: lanes, DEFAULT_MAX_DESC_PER_CALL
    fns = {}
    for d in ("h2d", "d2h"):
        s_, t_, si, di = (h, g, hi, gi) if d == "h2d" else (g, h, gi, hi)
        for k in sizes:
            fns[f"{d} dma per_call={k}"] = (lambda c=cps[k], s_=s_, t_=t_, si=si, di=di:
                                            c.copy(s_, t_, si, di, method="dma"))
        for k, c in stg.items():
            fns[f"{d} staged per_call={k}"] = (lambda c=c, s_=s_, t_=t_, si=si, di=di:
                                               c.copy(s_, t_, si, di, method="staged"))
        fns[f"{d} dma defaults"] = lambda s_=s_, t_=t_, si=si, di=di: dflt.copy(s_, t_, si, di, method="dma")
    for f in fns.values():  # warm-up
        f()
    torch.cuda.synchronize()
    hs = {k: [] for k in fns}
    for _ in range(a.reps):
        for k, f in fns.items():
            torch.cuda.synchronize()
            c0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            hs[k].append((time.perf_counter() - c0) * 1e3)
    rows = []
    print(f"{n} blocks of {bb} B, random ids; ms per job to completion (median, then each turn), us per descriptor")
    for k, v in hs.items():
        m = float(np.median(v))
        gbps = n * bb / m / 1e6
        r = ref[k[:3]]
        rows.append({"variant": k, "dir": k[:3], "blocks": n, "block_bytes": bb, "ms": round(m, 2),
                     "us_per_desc": round(m * 1e3 / n, 3), "turns_ms": [round(x, 1) for x in v],
                     "gbps": round(gbps, 2), "of_ref": round(gbps / r, 4)})
        print(f"{k:>28}: {m:8.2f} ms {m * 1e3 / n:6.3f} us/desc {gbps:6.2f} GB/s = {gbps / r:6.1%} of {r:.1f}  turns "
              + " ".join(f"{x:.0f}" for x in v), flush=True)
    write_rows(f"dma_per_call_{bb}", rows, out_dir=a.out,
               extra={"ref_gbps": {k: round(v, 2) for k, v in ref.items() if isinstance(v, float)},
                      "default_max_desc_per_call": DEFAULT_MAX_DESC_PER_CALL,
                      "timing": "each job from an idle GPU to completion (host issue included), the variants "
                                "taking turns; median of the turns"})


if __name__ == "__main__":
    main()
