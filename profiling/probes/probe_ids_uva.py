"""Do the cuda kernel's jobs gain by reading their block ids through UVA from the pinned ring
slot instead of uploading them first? A/B on one BlockCopier (warp shape), the two settings
taking turns in shuffled order (kernels._timing.cuda_ms_round_robin), per direction, block
size and job size ("1000 blocks", "1 GiB"), `--passes` times over. The figures behind
BlockCopier's ids_uva_d2h_max_bytes / ids_uva_h2d_max_bytes defaults.

    python -m profiling.probes.probe_ids_uva [--out DIR] [--passes 3]
Writes ids_uva.json/.csv/.png (GB/s = bytes / max(device, host) medians, as bench_transfer).
"""
import argparse

import numpy as np

from kernels import BlockCopier
from profiling.common import TIMING, cuda_ms_round_robin, probe_setup, results_dir, write_rows
from profiling.analysis.plots import plot

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BIG = 1 << 62


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--sizes", default="4,8,16,32,64", help="block sizes, KiB")
    a = ap.parse_args()
    a.out = results_dir(a.out)
    g, h, ref, rows = probe_setup()
    cp = BlockCopier("cuda")
    cp.cuda_variant = "warp"
    rng = np.random.default_rng(0)
    for p in range(a.passes):
        for wl in ("1000 blocks", "1 GiB"):
            for kib in (int(x) for x in a.sizes.split(",")):
                bb = kib * KiB
                nbuf = 2 * GiB // bb
                n = min(nbuf, 1000 if wl == "1000 blocks" else GiB // bb)
                gv, hv = g[: nbuf * bb].view(nbuf, bb), h[: nbuf * bb].view(nbuf, bb)
                si, di = rng.permutation(nbuf)[:n], rng.permutation(nbuf)[:n]
                line = []
                for d, (s, t) in (("d2h", (gv, hv)), ("h2d", (hv, gv))):
                    def job(cap, s=s, t=t):
                        cp.ids_uva_d2h_max_bytes = cp.ids_uva_h2d_max_bytes = cap
                        cp.copy(s, t, si, di, method="cuda")
                    fns = {"upload": lambda: job(0), "uva": lambda: job(BIG)}
                    reps = 5 if n * bb >= 256 * MiB else 40
                    hms = {}
                    ms = cuda_ms_round_robin(fns, reps, warmup=1, host_ms=hms, idle_every=1 if reps == 5 else 2)
                    for k in fns:
                        gbps = n * bb / max(ms[k], hms[k]) / 1e6
                        rows.append({"section": "ab", "pass": p, "workload": wl, "dir": d, "block_bytes": bb, "count": n,
                                     "ids": k, "gbps": round(gbps, 2), "of_ref": round(gbps / ref[d], 4),
                                     "device_gbps": round(n * bb / ms[k] / 1e6, 2), "host_us": round(hms[k] * 1e3, 1)})
                    up, uv = rows[-2]["gbps"], rows[-1]["gbps"]
                    line.append(f"{d} upload={up:6.2f} uva={uv:6.2f} ({uv - up:+5.2f})")
                print(f"pass {p} {wl:>11} {bb:>7} B x {n:>6}: " + "   ".join(line), flush=True)
    print(write_rows("ids_uva", rows, extra={"reference_gbps": ref}, out_dir=a.out, timing=TIMING))
    print(plot("ids_uva", a.out))


if __name__ == "__main__":
    main()
