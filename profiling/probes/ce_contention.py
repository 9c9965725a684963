"""Does a small D2H copy wait behind a bulk copy on another stream? Compares torch's
.tolist() (a cudaMemcpy on a copy engine) with connector.engine.io.tokens_to_host (an SM
copy) while a 4 GiB D2H copy runs, and the same for small uploads behind a 4 GiB H2D copy.
Also an SM block copy (256 x 32 KiB, GPU to GPU) behind the 4 GiB H2D copy, issued through
BlockCopier with its block ids uploaded by cudaMemcpyAsync (the default) and read through UVA
(ids_via_uva=True): the time until the copy is done.

    python -m profiling.probes.ce_contention [--out DIR]
"""
import argparse
import time

import numpy as np
import torch

from connector.engine.io import tokens_to_host, upload
from kernels import BlockCopier
from profiling.common import results_dir, write_rows
from profiling.analysis.plots import plot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.out = results_dir(a.out)
    g = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    h = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    ids = torch.arange(64, device="cuda")
    flat = np.arange(40000, dtype=np.int64)
    tokens_to_host(ids), upload(flat, "cuda")
    cps = {"uploaded (copy engine)": BlockCopier("cuda"), "via UVA": BlockCopier("cuda", ids_via_uva=True)}
    gs = torch.randint(1, 255, (256, 32 << 10), dtype=torch.uint8, device="cuda")
    gd = torch.empty_like(gs)
    rng = np.random.default_rng(0)
    si, di = rng.permutation(256), rng.permutation(256)

    def sm_job(cp):
        cp.copy(gs, gd, si, di, method="cuda")
        torch.cuda.current_stream().synchronize()

    for cp in cps.values():
        sm_job(cp)
        assert torch.equal(gd[torch.from_numpy(di).cuda()], gs[torch.from_numpy(si).cuda()])
    s = torch.cuda.Stream()
    rows = []
    cases = {
        ("d2h", "tolist (copy engine)"): lambda: ids.tolist(),
        ("d2h", "tokens_to_host (SM)"): lambda: tokens_to_host(ids),
        ("h2d", ".to(cuda) (copy engine)"): lambda: torch.from_numpy(flat).to("cuda").sum().item(),
        ("h2d", "upload (SM)"): lambda: upload(flat, "cuda").sum().item(),
        **{("h2d", f"SM block copy, ids {k}"): (lambda cp=cp: sm_job(cp)) for k, cp in cps.items()},
    }
    for (d, name), fn in cases.items():
        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            with torch.cuda.stream(s):
                (h.copy_(g, non_blocking=True) if d == "d2h" else g.copy_(h, non_blocking=True))
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        ms = float(np.median(ts))
        rows.append({"bulk": f"4 GiB {d}", "small_copy": name, "median_ms": round(ms, 3)})
        print(f"behind 4 GiB {d}: {name:<26} {ms:8.3f} ms", flush=True)
    write_rows("ce_contention", rows, {}, a.out)
    plot("ce_contention", a.out)


if __name__ == "__main__":
    main()
