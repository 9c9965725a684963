"""Do we need two staged pipelines? The same per-layer pack jobs through both, in one run.

kvoffload has two implementations of "staged" (pack into GPU staging on the SMs, DMA the staging
to or from the host, two halves pipelined): the Python one (BlockCopier.staged_pipeline, on the
caller's stream) and the C++ one (StagedPipe in kernels/csrc/dma_submitter.h, on the native
submitter's thread). Issue 36 asks for one unless a same-run measurement shows both are needed;
docs/design/two-staged-pipelines.md holds the question, the decision rule and the figures.

Jobs: a per-layer KV cache of the Llama-3.1-8B shape (32 layers, layout TWO_NB_BS_NH_HS: K and V
apart per layer, a block = 16 tokens x 8 kv heads x 128 x bf16 = 32 KiB per tensor, so 64
fragments and a 2 MiB unified block), `--blocks` blocks per job (default 64 and 512) with random
GPU block ids and random host slots, store (D2H) and load (H2D), through one TransferWorker per
path:

  cpp-staged   native_submit=True, method "staged": the submitter's StagedPipe (PACK_STAGED)
  py-staged    native_submit=False, method "staged": BlockCopier.staged_pipeline on the
               worker's stream (the general path: prepare + run)
  pack-direct  native_submit=True, method "cuda": the pack kernel straight over PCIe (reference)

Each path is first checked bit-exact once per direction (random non-zero source, destination
poisoned with 0, every byte outside the job's blocks untouched). Then, interleaved path by path:

  alone    one job at a time on an idle GPU (`--reps` jobs after a warm-up job);
  beside   `--reps` jobs back to back while a bf16 8192^3 GEMM loop runs on another stream
           (`--rounds` windows), the worker's compute stream idle so that the jobs overlap it.

Per configuration: GB/s = job bytes / the job's GPU time (JobResult.ms: CUDA events around the
job on its stream), median over jobs; the caller's host time per submit (time.perf_counter
around submit_store / submit_load), median; beside compute, the GEMM's slowdown = median time of
the GEMM iterations that ran entirely inside the jobs' span over the median of an alone window
just before (CUDA events around every iteration). Reference: the same-run big pinned copy.

    python -m profiling.probes.probe_staged_pipes [--out DIR] [--quick]

Writes staged_pipes.json/.csv. Without CUDA it checks its own expected-bytes model against the
torch path of KVBlockMover on CPU and exits (a dry run).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PATHS = ("cpp-staged", "py-staged", "pack-direct")
LAYOUT = "TWO_NB_BS_NH_HS"


def expected_unified(kv: list, bi: torch.Tensor) -> torch.Tensor:
    """The unified blocks of GPU blocks `bi` as bytes [n, unified_block_bytes], built with torch
    indexing only: per block, layer by layer, K then V (kv[l] is [2, NB, BS, NH, HS])."""
    x = torch.stack([t[:, bi] for t in kv], dim=0)            # [NL, 2, n, BS, NH, HS]
    x = x.permute(2, 0, 1, 3, 4, 5).contiguous()               # [n, NL, 2, BS, NH, HS]
    return x.view(torch.uint8).reshape(bi.shape[0], -1)


def self_test_cpu() -> None:
    """The expected-bytes model above against KVBlockMover's torch path, on a tiny CPU cache."""
    from layout import KVBlockMover, KVLayout, KVSpec, allocate
    spec = KVSpec(3, 2, 8, 4)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 10, device="cpu")
    for t in kv:
        t.view(torch.uint8).random_(1, 255)
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    host = torch.zeros(6, spec.unified_block_bytes, dtype=torch.uint8)
    bi, si = np.array([7, 2, 5], dtype=np.int64), np.array([4, 0, 3], dtype=np.int64)
    mover.pack(bi, host, si, method="torch")
    exp = expected_unified(kv, torch.from_numpy(bi))
    assert torch.equal(host[torch.from_numpy(si)], exp), "expected_unified disagrees with the torch path"
    assert int(host[[1, 2, 5]].count_nonzero()) == 0, "bytes outside the job were written"
    print("CPU self-test: expected_unified matches KVBlockMover's torch path")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: profiling.common.results_dir)")
    ap.add_argument("--quick", action="store_true", help="3 reps, 1 compute window per configuration")
    ap.add_argument("--blocks", default="64,512", help="blocks per job, comma-separated")
    ap.add_argument("--reps", type=int, default=9, help="timed jobs per configuration (>= 7 for a real run)")
    ap.add_argument("--rounds", type=int, default=2, help="compute windows per configuration and path")
    ap.add_argument("--num-blocks", type=int, default=1024, help="GPU KV blocks and host slots (2 MiB each)")
    a = ap.parse_args()
    if a.quick:
        a.reps, a.rounds = 3, 1
    sizes = [int(x) for x in a.blocks.split(",") if x]
    if not sizes or min(sizes) < 1 or max(sizes) > a.num_blocks:
        ap.error(f"--blocks must be in [1, --num-blocks={a.num_blocks}]")
    if not torch.cuda.is_available():
        self_test_cpu()
        print("probe_staged_pipes: no CUDA device; nothing measured (dry run: arguments parsed, "
              f"sizes {sizes}, reps {a.reps}, rounds {a.rounds})")
        return 0
    from kernels import native
    native.require("probe_staged_pipes")
    return run(a, sizes)


def run(a, sizes) -> int:
    from connector import TransferWorker
    from kernels.copy import STAGED_PACK_CTAS
    from layout import MODELS, KVBlockMover, KVLayout, allocate
    from profiling.common import TIMING, ComputeLoad, probe_setup, results_dir, write_rows

    out = results_dir(a.out, smoke=a.quick)
    t_start = time.perf_counter()
    torch.cuda.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    spec = MODELS["llama-3.1-8b"]
    ub = spec.unified_block_bytes
    nb = a.num_blocks
    # the reference's pinned buffer is the host pool (nb unified blocks: 2 GiB by default)
    g, h, ref, rows = probe_setup(nb * ub)
    del g
    host = h.view(nb, ub)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device=dev)
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    cp = mover.copier
    cs = torch.cuda.Stream(dev)  # the workers' compute stream: idle, so jobs overlap the GEMMs
    workers = {
        "cpp-staged": TransferWorker(mover, host, method="staged", compute_stream=cs, native_submit=True),
        "py-staged": TransferWorker(mover, host, method="staged", compute_stream=cs, native_submit=False),
        "pack-direct": TransferWorker(mover, host, method="cuda", compute_stream=cs, native_submit=True),
    }
    # how each path must show up in the worker's method counters (what was really issued)
    expect = {"cpp-staged": "staged-native", "py-staged": "staged", "pack-direct": "cuda-native"}
    jid = [0]
    issued_as: dict = {p: set() for p in PATHS}

    def submit(p: str, kind: str, bi: np.ndarray, si: np.ndarray) -> tuple[int, float]:
        w = workers[p]
        jid[0] += 1
        before = dict(w.methods)
        t0 = time.perf_counter()
        ok = w.submit_store(jid[0], bi, si) if kind == "store" else w.submit_load(jid[0], si, bi)
        us = (time.perf_counter() - t0) * 1e6
        if not ok:
            raise RuntimeError(f"{p} {kind}: submit refused ({w.get_finished()})")
        issued_as[p].update(k.split(":", 1)[1] for k, v in w.methods.items() if v != before.get(k, 0))
        return jid[0], us

    def finish(p: str) -> dict:
        w = workers[p]
        w.flush()
        torch.cuda.synchronize()
        res = {r.job_id: r for r in w.get_finished()}
        bad = [r for r in res.values() if not r.ok]
        if bad:
            raise RuntimeError(f"{p}: failed jobs {bad[:2]}")
        return res

    rng = np.random.default_rng(0)

    def ids(n: int) -> tuple[np.ndarray, np.ndarray]:
        return (np.ascontiguousarray(rng.permutation(nb)[:n].astype(np.int64)),
                np.ascontiguousarray(rng.permutation(nb)[:n].astype(np.int64)))

    def check(p: str, kind: str, bi: np.ndarray, si: np.ndarray) -> bool:
        """One job of path p, bit-exact: random non-zero source, destination poisoned with 0,
        every byte outside the job's blocks untouched."""
        bt, st = torch.from_numpy(bi).to(dev), torch.from_numpy(si).to(dev)
        if kind == "store":
            for t in kv:
                t.view(torch.uint8).random_(1, 255)
            host.zero_()
            # the workers wait for their compute stream (idle here), not for the stream that
            # filled the cache: finish the setup first, or a job may race it
            torch.cuda.synchronize()
            submit(p, kind, bi, si)
            finish(p)
            hg = host.to(dev)
            keep = torch.ones(nb, dtype=torch.bool, device=dev)
            keep[st] = False
            return torch.equal(hg[st], expected_unified(kv, bt)) and int(hg[keep].count_nonzero()) == 0
        hg = torch.empty((nb, ub), dtype=torch.uint8, device=dev).random_(1, 255)
        host.copy_(hg)
        for t in kv:
            t.view(torch.uint8).zero_()
        torch.cuda.synchronize()  # (as above: the zeroing must be done before the job writes)
        submit(p, kind, bi, si)
        finish(p)
        # the expected cache: zero everywhere, host[si] in blocks bi
        src = hg[st].view(len(bi), spec.num_layers, 2, -1)   # [n, NL, 2, bytes per K or V block]
        ok = True
        for l, t in enumerate(kv):
            tb = t.view(torch.uint8).reshape(2, nb, -1)
            e = torch.zeros_like(tb)
            e[:, bt] = src[:, l].transpose(0, 1)
            ok = ok and torch.equal(tb, e)
        return ok

    # ---- bit-exactness, once per path and direction (100 blocks: several chunks, both halves reused)
    exact = {}
    nchk = min(100, nb)
    for p in PATHS:
        for kind in ("store", "load"):
            bi, si = ids(nchk)
            err = None
            try:
                ok = check(p, kind, bi, si)
            except Exception as e:  # a path that fails here is left out of the timings, not the run
                ok, err = False, f"{type(e).__name__}: {e}"
            exact[f"{p}:{kind}"] = bool(ok)
            print(f"bit-exact {p:12s} {kind:5s}: {'ok' if ok else 'MISMATCH'}{'' if err is None else ' ' + err}", flush=True)
            rows.append({"section": "exact", "path": p, "dir": "d2h" if kind == "store" else "h2d",
                         "blocks": nchk, "ok": bool(ok), "error": err})
    torch.cuda.empty_cache()
    live = [p for p in PATHS if exact[f"{p}:store"] and exact[f"{p}:load"]]
    if "cpp-staged" not in live or "py-staged" not in live:
        print("WARNING: a staged path failed its bit-exact check: its rows are left out", flush=True)

    # ---- alone: one job at a time, paths interleaved
    cl = ComputeLoad("gemm", iters=10)
    gemm_events = [torch.cuda.Event(enable_timing=True) for _ in range(1001)]

    def gemm_window(iters: int) -> list:
        """Queues `iters` GEMMs on the compute stream with an event around each; returns the events."""
        ev = gemm_events[: iters + 1]
        with torch.cuda.stream(cl.comp):
            ev[0].record(cl.comp)
            for i in range(iters):
                cl.work()
                ev[i + 1].record(cl.comp)
        return ev

    def iter_times(ev) -> list:
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(len(ev) - 1)]

    results = []
    alone_job_ms: dict = {}
    for n in sizes:
        for kind in ("store", "load"):
            d = "d2h" if kind == "store" else "h2d"
            ms = {p: [] for p in live}
            hus = {p: [] for p in live}
            bi, si = ids(n)
            for rep in range(a.reps + 1):  # rep 0: warm-up
                for p in live:
                    torch.cuda.synchronize()
                    j, us = submit(p, kind, bi, si)
                    r = finish(p)[j]
                    if rep:
                        ms[p].append(r.ms)
                        hus[p].append(us)
            for p in live:
                m = float(np.median(ms[p]))
                alone_job_ms[(n, kind, p)] = max(m, float(np.median(hus[p])) / 1e3)
                results.append(dict(section="staged", path=p, dir=d, blocks=n, job_mib=n * ub / MiB,
                                    compute="alone", gbps=round(n * ub / m / 1e6, 2),
                                    gbps_min=round(n * ub / max(ms[p]) / 1e6, 2),
                                    pct_ref=round(100 * n * ub / m / 1e6 / ref[d], 1),
                                    host_us=round(float(np.median(hus[p])), 1),
                                    host_us_max=round(float(max(hus[p])), 1), jobs=len(ms[p])))
                _print(results[-1])

    write_rows("staged_pipes", rows + results, {"partial": "alone rows only"}, out, timing=TIMING)

    # ---- beside compute: back-to-back jobs while a GEMM loop runs; paths interleaved per round
    t_gemm = float(np.median(iter_times(_run_alone(gemm_window, 10))))
    rows.append({"section": "gemm", "ms_per_iter_alone": round(t_gemm, 3), "shape": "bf16 8192^3"})
    print(f"GEMM alone: {t_gemm:.3f} ms per iteration", flush=True)
    for n in sizes:
        for kind in ("store", "load"):
            d = "d2h" if kind == "store" else "h2d"
            acc = {p: {"ms": [], "us": [], "slow": [], "covered": [], "inside": []} for p in live}
            bi, si = ids(n)
            for _ in range(a.rounds):
                for p in live:
                    alone_it = iter_times(_run_alone(gemm_window, 8))
                    # a window well past the jobs' expected span (jobs beside a GEMM run slower than
                    # alone; a pack kernel on a default-priority stream most): `covered` says if it was
                    span = a.reps * alone_job_ms[(n, kind, p)] * 4.0 + 4 * t_gemm
                    iters = min(len(gemm_events) - 1, max(12, math.ceil(span / t_gemm) + 4))
                    torch.cuda.synchronize()
                    ev = gemm_window(iters)
                    x0 = torch.cuda.Event(enable_timing=True)
                    x0.record(cs)  # the jobs wait on cs (idle): they start about now
                    js = []
                    for _ in range(a.reps):
                        j, us = submit(p, kind, bi, si)
                        js.append(j)
                        acc[p]["us"].append(us)
                    workers[p].flush()  # every job on its stream before the end marker
                    x1 = torch.cuda.Event(enable_timing=True)
                    x1.record(workers[p].store_stream if kind == "store" else workers[p].load_stream)
                    res = finish(p)
                    acc[p]["ms"] += [res[j].ms for j in js]
                    lo, hi = ev[0].elapsed_time(x0), ev[0].elapsed_time(x1)
                    its = iter_times(ev)
                    starts = np.cumsum([0.0] + its[:-1])
                    inside = [t for t, s in zip(its, starts) if s >= lo and s + t <= hi]
                    acc[p]["covered"].append(hi <= ev[0].elapsed_time(ev[-1]))
                    acc[p]["inside"].append(len(inside))
                    if len(inside) >= 3:
                        acc[p]["slow"].append(float(np.median(inside)) / float(np.median(alone_it)) - 1)
            for p in live:
                q = acc[p]
                m = float(np.median(q["ms"]))
                results.append(dict(section="staged", path=p, dir=d, blocks=n, job_mib=n * ub / MiB,
                                    compute="beside", gbps=round(n * ub / m / 1e6, 2),
                                    gbps_min=round(n * ub / max(q["ms"]) / 1e6, 2),
                                    pct_ref=round(100 * n * ub / m / 1e6 / ref[d], 1),
                                    host_us=round(float(np.median(q["us"])), 1),
                                    host_us_max=round(float(max(q["us"])), 1), jobs=len(q["ms"]),
                                    gemm_slowdown=round(float(np.median(q["slow"])), 4) if q["slow"] else None,
                                    gemm_iters_inside=int(sum(q["inside"])), covered=all(q["covered"])))
                _print(results[-1])

    # ---- (a) against (b), per configuration: the inputs of the decision rule
    by = {(r["path"], r["dir"], r["blocks"], r["compute"]): r for r in results}
    cmp = []
    print("\ncpp-staged / py-staged (GB/s ratio, host us ratio):")
    for (p, d, n, c), r in by.items():
        if p != "cpp-staged":
            continue
        b = by.get(("py-staged", d, n, c))
        if b is None:
            continue
        cmp.append(dict(section="compare", dir=d, blocks=n, compute=c,
                        gbps_a_over_b=round(r["gbps"] / b["gbps"], 3),
                        host_us_a_over_b=round(r["host_us"] / b["host_us"], 3) if b["host_us"] else None))
        x = cmp[-1]
        print(f"  {d} {n:4d} {c:6s}  GB/s {x['gbps_a_over_b']:.3f}  host {x['host_us_a_over_b']}", flush=True)
    extra = {"config": {"layout": LAYOUT, "model": "llama-3.1-8b", "unified_block_bytes": ub,
                        "fragments_per_block": mover.table.num_fragments, "num_blocks": nb, "reps": a.reps,
                        "rounds": a.rounds, "staging_bytes": cp.staging_bytes,
                        "staged_chunk_bytes": cp.staged_chunk_bytes, "staged_pack_ctas": STAGED_PACK_CTAS,
                        "num_ctas": cp.num_ctas, "ids": "random GPU blocks, random host slots",
                        "issued_as": {p: sorted(v) for p, v in issued_as.items()},
                        "expected_issue": expect, "exact": exact,
                        "seconds": round(time.perf_counter() - t_start, 1)},
             "reference_gbps": {k: round(v, 2) for k, v in ref.items()}}
    for p, v in issued_as.items():
        if v != {expect[p]}:
            print(f"WARNING: {p} was issued as {sorted(v)}, expected {expect[p]}: its rows do not measure "
                  f"what they are named for", flush=True)
    for w in workers.values():
        w.shutdown()
    path = write_rows("staged_pipes", rows + results + cmp, extra, out, timing=TIMING)
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0 if all(exact.values()) else 1


def _run_alone(gemm_window, iters: int) -> list:
    torch.cuda.synchronize()
    ev = gemm_window(iters)
    torch.cuda.synchronize()
    return ev


def _print(r: dict) -> None:
    s = (f"{r['path']:12s} {r['dir']} {r['blocks']:4d} blk {r['compute']:6s} {r['gbps']:7.2f} GB/s "
         f"({r['pct_ref']:5.1f}% ref)  host {r['host_us']:9.1f} us/submit")
    if r["compute"] == "beside":
        sd = r.get("gemm_slowdown")
        s += f"  GEMM {'n/a' if sd is None else f'{100 * sd:+6.1f}%'}" + ("" if r["covered"] else " (not covered)")
    print(s, flush=True)


if __name__ == "__main__":
    sys.exit(main())
