"""Does splitting one DMA job over several streams (several copy engines) hide the copy
engines' per-descriptor cost? One job = 1 GiB of random blocks (ids permuted on both
sides), issued by kvoffload's DMA batcher (`_C.dma_blocks`, batch API) either on one stream
or cut into `lanes` contiguous pieces, each on its own stream, forked from and joined back
to the timing stream with events. Also bidirectional 2 MiB jobs (1 GiB each way, the size of
the bidirectional reference) with 1 and 2 lanes per direction.

    python -m profiling.probes.probe_dma_lanes [--out DIR]
"""
import argparse

import numpy as np
import torch

from kernels import native
from profiling.common import cuda_ms, probe_setup, results_dir, write_rows
from profiling.analysis.plots import plot

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    a.out = results_dir(a.out)
    native.require("probe_dma_lanes")
    g, h, ref, rows = probe_setup()
    rng = np.random.default_rng(0)
    side = [torch.cuda.Stream() for _ in range(8)]

    def job(src, dst, si, di, bb, lanes, mode, streams):
        """Queue si->di on `lanes` streams forked from/joined to the current stream."""
        cur = torch.cuda.current_stream()
        n = si.shape[0]
        cuts = np.linspace(0, n, lanes + 1).astype(np.int64)
        if lanes == 1:
            parts = [(cur, 0, n)]
        else:
            ev = torch.cuda.Event()
            ev.record(cur)
            parts = []
            for i, s in enumerate(streams[:lanes]):
                s.wait_event(ev)
                parts.append((s, cuts[i], cuts[i + 1]))
        for s, lo, hi in parts:
            native.dma_blocks(si[lo:hi].ctypes.data, di[lo:hi].ctypes.data, int(hi - lo), src.data_ptr(),
                          dst.data_ptr(), bb, bb, bb, False, 16384, mode, False, s.cuda_stream)
        if lanes > 1:
            for s, _, _ in parts:
                e = torch.cuda.Event()
                e.record(s)
                cur.wait_event(e)

    for bb in (64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, MiB, 2 * MiB):
        nbuf = 2 * GiB // bb
        n = GiB // bb
        si = np.ascontiguousarray(rng.permutation(nbuf)[:n].astype(np.int64))
        di = np.ascontiguousarray(rng.permutation(nbuf)[:n].astype(np.int64))
        for d, (src, dst) in (("d2h", (g, h)), ("h2d", (h, g))):
            line = []
            for mode_name, mode in (("batch", native.DMA_BATCH), ("nohint", native.DMA_BATCH_NO_HINT)):
                for lanes in (1, 2, 3, 4):
                    ms = cuda_ms(lambda: job(src, dst, si, di, bb, lanes, mode, side), a.reps)
                    gbps = n * bb / ms / 1e6
                    rows.append({"section": "lanes", "dir": d, "block_bytes": bb, "count": n, "mode": mode_name,
                                 "lanes": lanes, "gbps": round(gbps, 2), "of_ref": round(gbps / ref[d], 4)})
                    line.append(f"{mode_name[:2]}{lanes}={gbps / ref[d]:6.1%}")
            print(f"{d} {bb:>8} x{n:>6}: " + " ".join(line), flush=True)

    # bidirectional 2 MiB, 1 GiB each way (the reference moves 1 GiB each way)
    bb = 2 * MiB
    nbuf = 2 * GiB // bb
    n = nbuf // 2
    gi, hi = rng.permutation(nbuf).astype(np.int64), rng.permutation(nbuf).astype(np.int64)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for nn in (n // 2, n):
        for lanes in (1, 2):
            for mode_name, mode in (("batch", native.DMA_BATCH), ("nohint", native.DMA_BATCH_NO_HINT)):
                def both():
                    cur = torch.cuda.current_stream()
                    ev = torch.cuda.Event()
                    ev.record(cur)
                    for s, (src, dst, a_, b_), sides in ((s1, (g, h, gi[:nn], hi[:nn]), side[:4]),
                                                         (s2, (h, g, hi[n:n + nn], gi[n:n + nn]), side[4:])):
                        s.wait_event(ev)
                        with torch.cuda.stream(s):
                            job(src, dst, np.ascontiguousarray(a_), np.ascontiguousarray(b_), bb, lanes, mode, sides)
                        e = torch.cuda.Event()
                        e.record(s)
                        cur.wait_event(e)
                ms = cuda_ms(both, max(a.reps, 9))
                gbps = 2 * nn * bb / ms / 1e6
                rows.append({"section": "bidir", "block_bytes": bb, "count": nn, "mode": mode_name, "lanes": lanes,
                             "gbps": round(gbps, 2), "of_ref": round(gbps / ref["bidir"], 4)})
                print(f"bidir 2 x {nn} x 2 MiB {mode_name} lanes={lanes}: {gbps:6.1f} GB/s = "
                      f"{gbps / ref['bidir']:.1%}", flush=True)
    print(write_rows("dma_lanes", rows, extra={"reference_gbps": ref}, out_dir=a.out))
    print(plot("dma_lanes", a.out))


if __name__ == "__main__":
    main()
