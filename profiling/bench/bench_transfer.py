"""Transfer benchmark: every method and direction against the same-run big pinned copy.

    python -m profiling.bench.bench_transfer [--quick] [--out DIR]

Measures, in one run (medians of CUDA-event timings after warm-up):
  1. references: 2 GiB pinned cudaMemcpyAsync D2H, H2D, and both at once, each the better
     of one copy and the same bytes split over two streams (profiling.common.big_copy_refs);
  2. GB/s vs block size (4 KiB .. 16 MiB) per method and direction, for
     "1000 blocks" and "1 GiB" workloads, random ids on both sides, plus what
     auto picks (idle and busy) and how far it is from the best qualifying method;
  3. bidirectional 2 MiB blocks with loads and stores in flight together;
  4. host time per submitted job;
  5. interference: a bf16 8192^3 GEMM and an HBM-bound copy, alone vs beside
     each method moving data at full speed.
Writes transfer.json/.csv and transfer.png under profiling/results (or --out).
"""
from __future__ import annotations

import argparse
import os
import weakref

import numpy as np
import torch

from kernels import BlockCopier
from kernels import native
from profiling.common import (TIMING, ComputeLoad, big_copy_refs, cuda_ms, cuda_ms_round_robin, host_us, host_us_busy, meta, nvtx_range,
                              on_two_streams, results_dir, write_rows)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
METHODS = ["dma", "cuda", "cuda-warp", "cuda-cta", "cuda-bulk", "triton", "staged"]
# Measured beside METHODS but not among the choices `auto` is held to: the SM kernels with
# their block ids read through UVA from the pinned ring slot (BlockCopier(ids_via_uva=True)).
UVA_METHODS = ["cuda-uva", "triton-uva"]


# copier -> its twin with ids read through UVA (the bench's own table: no copier attribute)
_UVA_TWINS: "weakref.WeakKeyDictionary[BlockCopier, BlockCopier]" = weakref.WeakKeyDictionary()


def run_copy(cp, s, t, si, di, method, **kw):
    """cp.copy with bench labels: 'cuda-cta' is the CTA-per-block CUDA kernel; 'X-uva' is
    method X on a twin copier whose kernels read their ids through UVA."""
    if method.endswith("-uva"):
        twin = _UVA_TWINS.get(cp)
        if twin is None:  # made once per copier, through the public constructor
            twin = _UVA_TWINS[cp] = BlockCopier(cp.device, ids_via_uva=True, num_ctas=cp.num_ctas,
                                                cost_model=cp.cost_model)
        return twin.copy(s, t, si, di, method=method[:-4], **kw)
    if method in ("cuda-warp", "cuda-cta", "cuda-bulk"):
        cp.cuda_variant = method[5:]
        try:
            return cp.copy(s, t, si, di, method="cuda", **kw)
        finally:
            cp.cuda_variant = "auto"
    return cp.copy(s, t, si, di, method=method, **kw)


def refs(g, h, detail=None):
    with nvtx_range("ref big copy"):
        return big_copy_refs(g, h, detail=detail)


def views(g, h, bb):
    nbuf = (2 * GiB) // bb
    return g[: nbuf * bb].view(nbuf, bb), h[: nbuf * bb].view(nbuf, bb), nbuf


def sweep(cp, g, h, ref, sizes, workloads, rng, rows, save=None):
    for wl in workloads:
        for bb in sizes:
            gv, hv, nbuf = views(g, h, bb)
            n = 1000 if wl == "1000 blocks" else GiB // bb
            n = min(n, nbuf)
            si = rng.permutation(nbuf)[:n]
            di = rng.permutation(nbuf)[:n]
            for d, (s, t) in (("d2h", (gv, hv)), ("h2d", (hv, gv))):
                names = METHODS + UVA_METHODS + ["auto-idle", "auto-busy"]
                kws = {m: ({"method": "auto", "busy": m == "auto-busy"} if m.startswith("auto") else {"method": m})
                       for m in names}
                fns = {m: (lambda kw=kws[m]: run_copy(cp, s, t, si, di, **kw)) for m in names}
                used = {}

                def note(m):
                    used[m] = m[:-4] if m.endswith("-uva") else cp.last_method
                # medians of 3 were hit by transient dips; jobs of < 16 MiB (~0.1-0.3 ms, much of it
                # host time) take 30, their host time varies by 10-20% between calls. The methods
                # take turns, so auto and the method it picks are timed under the same conditions.
                # Big jobs: 6 host samples (an idle-stream call every round), not 3: the host time
                # of 1 GiB of small DMA blocks (tens of ms of descriptors) varied by up to 1.7x
                # between samples (dadf049), and it bounds their rate. Small jobs: 40 turns.
                big = n * bb >= 256 * MiB
                reps = 5 if big else (10 if n * bb >= 16 * MiB else 40)
                hms, ims = {}, {}
                with nvtx_range(f"sweep {wl} {d} bb={bb}"):
                    ms = cuda_ms_round_robin(fns, reps, warmup=1, after=note, host_ms=hms, idle_ms=ims,
                                             idle_every=1 if big else 2)
                # back-to-back rate: the slower of device and host bounds it (kernels/_timing.py)
                res = {m: (n * bb / max(ms[m], hms[m]) / 1e6, used[m]) for m in names}
                best_idle = max(res[m][0] for m in METHODS)
                best_busy = max(res[m][0] for m in ("dma", "staged"))
                for m, (gbps, u) in res.items():
                    row = {"section": "sweep", "workload": wl, "dir": d, "block_bytes": bb,
                           "count": n, "method": m, "used": u, "gbps": round(gbps, 2),
                           "of_ref": round(gbps / ref[d], 4), "device_gbps": round(n * bb / ms[m] / 1e6, 2),
                           "host_us": round(hms[m] * 1e3, 1),
                           "idle_gbps": round(n * bb / ims[m] / 1e6, 2)}  # from an idle stream, as before 4361a1b
                    if m == "auto-idle":
                        row["of_best"] = round(gbps / best_idle, 4)
                    if m == "auto-busy":
                        row["of_best"] = round(gbps / best_busy, 4)
                    rows.append(row)
                print(f"{wl:>11} {d} {bb:>9} x{n:>7} | " + " ".join(
                    f"{m}={res[m][0]:6.1f}" for m in METHODS + UVA_METHODS) +
                    f" | auto-idle {res['auto-idle'][1]}={res['auto-idle'][0]:6.1f}"
                    f" auto-busy {res['auto-busy'][1]}={res['auto-busy'][0]:6.1f}"
                    f" | ref {ref[d]:.1f}", flush=True)
            if save is not None:
                save()  # a partial sweep survives a time limit


def bidirectional(cp_store, cp_load, g, h, ref, rng, rows, bb=2 * MiB):
    gv, hv, nbuf = views(g, h, bb)
    n = GiB // bb  # 1 GiB each way, as the bidirectional reference moves
    gi = rng.permutation(nbuf)
    hi = rng.permutation(nbuf)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for m in METHODS:
        both = on_two_streams(lambda st, m=m: run_copy(cp_store, gv, hv, gi[:n], hi[:n], m, stream=st),
                              lambda st, m=m: run_copy(cp_load, hv, gv, hi[n:2 * n], gi[n:2 * n], m, stream=st),
                              (s1, s2))
        with nvtx_range(f"bidir {m}"):
            gbps = 2 * n * bb / cuda_ms(both, 9) / 1e6
        rows.append({"section": "bidir", "block_bytes": bb, "count": n, "method": m,
                     "gbps": round(gbps, 2), "of_ref": round(gbps / ref["bidir"], 4)})
        print(f"bidir {m:>7} 2 x {n} x {bb} B: {gbps:6.1f} GB/s = {gbps / ref['bidir']:.1%} of "
              f"{ref['bidir']:.1f}", flush=True)
    # DMA variants: issue mode (overlap hint or not, batch or loop), and one copy-engine lane
    if not native.AVAILABLE:
        return
    one = (BlockCopier(cp_store.device, dma_lanes=1), BlockCopier(cp_load.device, dma_lanes=1))
    for label, mode, (cs, cl) in (("dma-nohint", native.DMA_BATCH_NO_HINT, (cp_store, cp_load)),
                                  ("dma-loop", native.DMA_LOOP, (cp_store, cp_load)),
                                  ("dma-1lane", native.DMA_BATCH, one)):
        k = n
        cs.dma_mode = cl.dma_mode = mode
        both = on_two_streams(lambda st: run_copy(cs, gv, hv, gi[:k], hi[:k], "dma", stream=st),
                              lambda st: run_copy(cl, hv, gv, hi[k:2 * k], gi[k:2 * k], "dma", stream=st),
                              (s1, s2))
        gbps = 2 * k * bb / cuda_ms(both, 9) / 1e6
        cs.dma_mode = cl.dma_mode = None
        rows.append({"section": "bidir_variant", "block_bytes": bb, "count": k, "method": label,
                     "gbps": round(gbps, 2), "of_ref": round(gbps / ref["bidir"], 4)})
        print(f"bidir {label:>15} 2 x {k} x {bb} B: {gbps:6.1f} GB/s = {gbps / ref['bidir']:.1%}", flush=True)


def host_cost(cp, g, h, rng, rows):
    for n in (1000, 32768):
        bb = 4 * KiB
        gv, hv, nbuf = views(g, h, bb)
        si, di = rng.permutation(nbuf)[:n], rng.permutation(nbuf)[:n]
        sdi = np.sort(di)
        for m in METHODS + UVA_METHODS:
            us = host_us(lambda: run_copy(cp, gv, hv, si, sdi, m))
            # as an engine submits: GPU busy, the thread never blocked between calls
            busy = host_us_busy(lambda i: run_copy(cp, gv, hv, si, sdi, m))
            rows.append({"section": "host", "count": n, "block_bytes": bb, "method": m,
                         "host_us": round(us, 1), "host_us_busy": round(busy, 1), "used_busy": cp.last_method})
            print(f"host submit {m:>10} n={n:>6}: {us:8.1f} us after a device sync, {busy:8.1f} us with the "
                  f"GPU busy ({cp.last_method})", flush=True)
        # BlockCopier.bind: the buffers checked once, calls take ids. "-random" rows: destination ids
        # in random order, as a block allocator hands them out (sorted ones skip the duplicate bitmap)
        bind_rows(cp, gv, hv, si, n, bb, rows, (("cuda", sdi, "cuda-bind"), ("triton", sdi, "triton-bind"),
                                                 ("dma", sdi, "dma-bind"), ("cuda", di, "cuda-bind-random")))
        if n >= 8192 and native.host_threads is not None and native.host_threads()[1]:
            # the same jobs with the id pass on the calling thread alone: what the helper
            # threads (kernels/csrc/work_pool.h) buy, measured in the same run
            native.host_threads(enable=0)
            try:
                bind_rows(cp, gv, hv, si, n, bb, rows, (("cuda", sdi, "cuda-bind-serial"),
                                                         ("triton", sdi, "triton-bind-serial"),
                                                         ("cuda", di, "cuda-bind-random-serial")))
            finally:
                native.host_threads(enable=1)


def bind_rows(cp, gv, hv, si, n, bb, rows, cases):
    """Host submit rows of BlockCopier.bind calls: (method, dst ids, label) per case."""
    for m, d_ids, label in cases:
        b = cp.bind(gv, hv, method=m)
        us = host_us(lambda: b(si, d_ids))
        busy = host_us_busy(lambda i: b(si, d_ids))
        rows.append({"section": "host", "count": n, "block_bytes": bb, "method": label,
                     "host_us": round(us, 1), "host_us_busy": round(busy, 1), "used_busy": m})
        print(f"host submit {label:>23} n={n:>6}: {us:8.1f} us after a device sync, {busy:8.1f} us "
              f"with the GPU busy", flush=True)


def interference(cp, g, h, ref, rng, rows, quick):
    """Compute slowdown beside each method moving data flat out (paired, median of 3)."""
    labels = {"dma": {"method": "dma"}, "cuda": {"method": "cuda"},
              "cuda-4cta": {"method": "cuda", "num_ctas": 4}, "cuda-bulk": {"method": "cuda-bulk"},
              "triton": {"method": "triton"},
              "staged": {"method": "staged"}, "auto-busy": {"method": "auto", "busy": True}}
    cases = []
    for bb in (32 * KiB, 2 * MiB):
        for d in ("d2h", "h2d"):
            cases += [("gemm", bb, "random", d, m) for m in labels]
            cases += [("gemm", bb, "contiguous", d, m) for m in ("dma", "staged", "auto-busy")]
            cases += [("hbm_copy", bb, "random", d, m) for m in ("dma", "cuda", "staged")]
    if quick:
        cases = [c for c in cases if c[1] == 32 * KiB]
    loads = {}
    for wname, bb, pattern, d, m in cases:
        load = loads.get(wname) or loads.setdefault(wname, ComputeLoad(wname))
        gv, hv, nbuf = views(g, h, bb)
        n = (512 * MiB) // bb
        gi = rng.permutation(nbuf)[:n]
        hi = rng.permutation(nbuf)[:n] if pattern == "random" else np.arange(n) + 7
        s, t, si, di = (gv, hv, gi, hi) if d == "d2h" else (hv, gv, hi, gi)
        kw = labels[m]
        window_ms = (1.6 if wname == "gemm" else 0.5) * load.iters
        n_copies = int(window_ms / (n * bb / (ref[d] * 1e6)) * 1.3) + 2
        with nvtx_range(f"interf {wname} {d} {m} bb={bb} {pattern}"):
            slow, t_x, covered, base = load.measure(
                lambda st: run_copy(cp, s, t, si, di, stream=st, **kw), n_copies)
        gbps = n_copies * n * bb / t_x / 1e6
        rows.append({"section": "interference", "workload": wname, "dir": d, "method": m,
                     "used": cp.last_method, "block_bytes": bb, "host_ids": pattern,
                     "alone_ms": round(base, 4), "slowdown": round(slow, 4), "gbps": round(gbps, 2),
                     "of_ref": round(gbps / ref[d], 4), "copy_covered_window": covered})
        print(f"interf {wname:>8} {d} {m:>9}->{cp.last_method:<6} bb={bb:>8} host={pattern:<10}"
              f" compute {slow:+7.1%}  copy {gbps:6.1f} GB/s ({gbps / ref[d]:.0%})"
              f"{'' if covered else '  [copy ended early]'}", flush=True)


def cta_sweep(cp, g, h, ref, rng, rows):
    """SM-kernel bandwidth against CTA (program) count: where PCIe saturates."""
    for bb in (4 * KiB, 32 * KiB, 2 * MiB):
        gv, hv, nbuf = views(g, h, bb)
        n = GiB // bb
        si, di = rng.permutation(nbuf)[:n], rng.permutation(nbuf)[:n]
        for d, (s, t) in (("d2h", (gv, hv)), ("h2d", (hv, gv))):
            line = []
            for m in ("cuda", "cuda-cta", "cuda-bulk", "triton"):
                for c in (2, 4, 8, 16, 32, 64, 132):
                    cp.cuda_variant = m[5:] if m.startswith("cuda-") else "warp"
                    ms = cuda_ms(lambda: cp.copy(s, t, si, di, method=m.split("-")[0], num_ctas=c),
                                 3, warmup=1)
                    gbps = n * bb / ms / 1e6
                    rows.append({"section": "ctas", "dir": d, "block_bytes": bb, "count": n,
                                 "method": m, "num_ctas": c, "gbps": round(gbps, 2),
                                 "of_ref": round(gbps / ref[d], 4)})
                    line.append(f"{ {'cuda-cta': 'C', 'cuda-bulk': 'B'}.get(m, m[0])}{c}={gbps:5.1f}")
            cp.cuda_variant = "auto"
            print(f"ctas {d} {bb:>8} B x {n}: " + " ".join(line), flush=True)


def plot(rows, ref, path, info=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from profiling.analysis.plots import save_png

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    for i, wl in enumerate(("1 GiB", "1000 blocks")):
        for j, d in enumerate(("d2h", "h2d")):
            ax = axes[i][j]
            for m in METHODS + UVA_METHODS + ["auto-idle", "auto-busy"]:
                rs = [r for r in rows if r.get("section") == "sweep" and r["workload"] == wl and
                      r["dir"] == d and r["method"] == m]
                if rs:
                    ax.plot([r["block_bytes"] for r in rs], [r["gbps"] for r in rs], marker="o",
                            ls="--" if m.startswith("auto") else (":" if m.endswith("-uva") else "-"), label=m)
            ax.axhline(ref[d], color="k", lw=1, label=f"big copy {ref[d]:.1f}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{d.upper()}, {wl}")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("block bytes")
    m = info or meta()
    fig.suptitle(f"kvoffload block copy on {m.get('gpu')} ({m['date']}, {m['git_sha'][:10]})")
    fig.tight_layout()
    save_png(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and cases")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--replot", default=None, help="redraw the PNG from a results JSON and exit")
    a = ap.parse_args()
    if a.replot:
        import json

        doc = json.load(open(a.replot))
        plot(doc["rows"], doc["reference_gbps"], a.replot.replace(".json", ".png"), doc["meta"])
        return
    torch.cuda.init()
    g = torch.randint(1, 255, (2 * GiB,), dtype=torch.uint8, device="cuda")
    h = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    h.copy_(g)
    rng = np.random.default_rng(0)
    ref_detail: dict = {}
    ref = refs(g, h, ref_detail)
    print(f"reference: D2H {ref['d2h']:.1f} GB/s  H2D {ref['h2d']:.1f} GB/s  both {ref['bidir']:.1f} "
          f"GB/s  ({torch.cuda.get_device_name()}; the better of one copy and two streams: {ref_detail})",
          flush=True)
    rows = [{"section": "reference", "dir": k, "gbps": round(v, 2)} for k, v in ref.items()]
    cp = BlockCopier("cuda")
    cp2 = BlockCopier("cuda")
    skip = set(a.skip.split(","))
    sizes = [4 * KiB << k for k in range(13)]
    if a.quick:
        sizes = [4 * KiB, 32 * KiB, 256 * KiB, 2 * MiB, 16 * MiB]
    out = results_dir(a.out, smoke=a.quick)
    extra = {"reference_gbps": ref, "reference_detail": ref_detail,
             "cost_model_source": cp.cost_model.table.get("source")}
    done = []

    def save() -> str:
        # rewritten after every sweep point and section: a run cut short by a time limit keeps
        # what it measured, and `sections_done` says how far it got
        return write_rows("transfer", rows, {**extra, "sections_done": done,
                                             "sections_skipped": sorted(x for x in skip if x)}, out, timing=TIMING)

    sections = (("sweep", lambda: sweep(cp, g, h, ref, sizes, ["1000 blocks", "1 GiB"], rng, rows, save)),
                ("ctas", lambda: cta_sweep(cp, g, h, ref, rng, rows)),
                ("bidir", lambda: bidirectional(cp, cp2, g, h, ref, rng, rows)),
                ("host", lambda: host_cost(cp, g, h, rng, rows)),
                ("interference", lambda: interference(cp, g, h, ref, rng, rows, a.quick)))
    p = save()
    for name, run_section in sections:
        if name not in skip:
            run_section()
            done.append(name)
            p = save()
    plot(rows, ref, os.path.join(os.path.dirname(p), "transfer.png"))
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
