"""How much slower host work runs right after the calling thread has waited (no GPU needed).

    python -m profiling.probes.probe_cold_host [--reps 100] [--out DIR]

Times the C++ id check of 1000 random pairs (what every copy call runs first) back to back,
after a `time.sleep` of each length (the thread idles, as in a blocking wait) and after a busy
wait of the same length (the core stays hot). 'After a sync' host figures in the results pay
whichever the GPU wait amounted to.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kernels.copy import check_id_pairs
from profiling.common import results_dir, write_rows


def busy(s: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < s:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--waits-ms", default="0,0.5,2,20")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.out = results_dir(a.out)
    rng = np.random.default_rng(0)
    si = rng.permutation(4000)[:1000].astype(np.int64)
    di = rng.permutation(4000)[:1000].astype(np.int64)
    rows = []
    for w in (float(x) for x in a.waits_ms.split(",")):
        for how, wait in (("sleep", time.sleep), ("spin", busy)):
            if w == 0 and how == "spin":
                continue
            ts = []
            for _ in range(a.reps):
                if w:
                    wait(w / 1e3)
                t0 = time.perf_counter()
                check_id_pairs(si, di, 4000, 4000)
                ts.append((time.perf_counter() - t0) * 1e6)
            med, p90 = float(np.median(ts)), float(np.percentile(ts, 90))
            label = "back to back" if w == 0 else f"after {how} {w:g} ms"
            rows.append({"wait": how if w else "none", "wait_ms": w, "median_us": round(med, 2), "p90_us": round(p90, 2)})
            print(f"id check, 1000 pairs, {label:>20}: median {med:7.1f} us  p90 {p90:7.1f} us", flush=True)
    print(f"wrote {write_rows('cold_host', rows, {'cpu_count': os.cpu_count()}, a.out)}")


if __name__ == "__main__":
    main()
